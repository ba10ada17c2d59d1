"""How a moment leaf is stored: a float array of its dtype, or 8-bit block-wise quantized.

``mu_dtype=jnp.int8`` / ``nu_dtype=jnp.uint8`` select the block-wise quantized storage of
`optax_lamb.core._quantize` (never a plain cast): a leaf that `quantizes` is stored as a
`QuantizedMoment` (int8 codes of the signed map for m, uint8 codes of the unsigned map for v,
float32 scales per block of 256 along the last axis); a smaller leaf (under 4,096 elements,
0-d, or a last axis of 1) keeps float32. The layout depends on the param's shape only.

A step loads a moment in the compute dtype (`load`: dequantized), updates it there and stores
it (`store`: quantized from the unrounded values; where the step is skipped the old codes and
scales are selected, bit-identical, never requantized).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core import _quantize, _sharded_views
from optax_lamb.core._quantize import QuantizedMoment

QUANTIZED_FALLBACK = np.dtype(np.float32)  # leaves too small to quantize
MIN_SIZE = 4096  # smaller leaves stay float32 (bitsandbytes' min_8bit_size)


def is_quantized_dtype(dtype: Any) -> bool:
  """Whether `dtype` (a moment dtype option) selects 8-bit quantized storage."""
  return dtype is not None and np.dtype(dtype) in (np.dtype(np.int8), np.dtype(np.uint8))


def is_quantized(stored: Any) -> bool:
  """Whether a stored moment leaf is a `QuantizedMoment` (codes and scales)."""
  return isinstance(stored, QuantizedMoment)


def quantizes(
  shape: tuple[int, ...], block_size: int = _quantize.BLOCK_SIZE, min_size: int = MIN_SIZE
) -> bool:
  """Whether a leaf of ``shape`` is stored quantized. 0-d leaves and leaves under ``min_size``
  elements stay float32 (biases, LayerNorm scales: a negligible share of the bytes), and so do
  leaves whose codes and scales would not be smaller than float32 (a last axis of 1)."""
  size = int(np.prod(shape)) if shape else 1
  if not shape or size < min_size:
    return False
  quantized_bytes = size + 4 * int(np.prod(_quantize.scales_shape(shape, block_size)))
  return quantized_bytes < 4 * size


def init(param: Any, dtype: Any) -> Any:
  """The zero moment of `param` stored in `dtype` (None: the param's dtype).

  For a quantized dtype: ``QuantizedMoment(codes 0, scales 0)`` where the leaf is large
  enough (`quantizes`), else float32 zeros. The codes keep the param's sharding.
  """
  if not is_quantized_dtype(dtype):
    return jnp.zeros_like(param, dtype=dtype)
  shape = tuple(jnp.shape(param))
  if not quantizes(shape):
    return jnp.zeros_like(param, dtype=QUANTIZED_FALLBACK)
  codes = jnp.zeros_like(param, dtype=dtype)
  scales = jnp.zeros(_quantize.scales_shape(shape), jnp.float32)
  sharding = scales_sharding(param, scales.shape)
  return QuantizedMoment(codes, scales if sharding is None else jax.device_put(scales, sharding))


def scales_sharding(param: Any, shape: tuple[int, ...]) -> Any:
  """The params' `NamedSharding` for a concrete param's scales (the last axis split as the
  param's where its blocks divide evenly, else whole), or None (a traced or unsharded param:
  the step's jit then places them)."""
  sharding = getattr(param, "sharding", None) if isinstance(param, jax.Array) else None
  if not isinstance(sharding, jax.sharding.NamedSharding) or isinstance(param, jax.core.Tracer):
    return None
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  last = spec[-1]
  names = () if last is None else (last,) if isinstance(last, str) else tuple(last)
  if shape[-1] % int(np.prod([sharding.mesh.shape[n] for n in names])) != 0:
    spec[-1] = None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def signed(stored: QuantizedMoment) -> bool:
  """The map of a quantized moment, from its codes' dtype: signed (int8, m) or unsigned (v)."""
  return jnp.dtype(stored.codes.dtype) == jnp.int8


def load(stored: Any, dtype: Any) -> jax.Array:
  """A stored moment in the compute `dtype`: dequantized, or cast."""
  if is_quantized(stored):
    return _quantize.dequantize(stored.codes, stored.scales, signed(stored)).astype(dtype)
  return stored.astype(dtype)


def store(moment: jax.Array, old: Any, take: Any = None, *, one_reduction: bool = True) -> Any:
  """`moment` (compute dtype) stored like `old`: quantized from its unrounded values, or cast;
  `old` itself (every array of it, bit-identical) where `take` is 0 (a skipped step).
  `one_reduction`: False in a Pallas kernel (`_quantize.quantize`; the same codes and scales)."""
  return store_all([moment], [old], take, one_reduction=one_reduction)[0]


def store_all(moments: list, olds: list, take: Any = None, *, one_reduction: bool = True) -> list:
  """`store` of each moment like its old one; those stored quantized (one shape: a leaf's m and
  v) from one reduction of their block scales (`_quantize.quantize_all`)."""
  pairs = list(zip(moments, olds, strict=True))
  xs = [jax.lax.stop_gradient(m) for m, o in pairs if is_quantized(o)]  # integer codes: no
  maps = [signed(o) for o in olds if is_quantized(o)]  # derivative flows into them
  codes = iter(_quantize.quantize_all(xs, maps, one_reduction=one_reduction) if xs else ())
  new = [next(codes) if is_quantized(o) else m.astype(o.dtype) for m, o in pairs]
  if take is not None:
    keep = jnp.asarray(take) != 0
    where = lambda n, o: jnp.where(keep, n, o)
    new = [jax.tree.map(where, x, old) for x, old in zip(new, olds, strict=True)]
  if xs and one_reduction:  # XLA: decoding the old codes reads the old scales; the new
    # scales, defined after the new codes (one conditional for all), are written over them in
    # place (defined before, XLA would copy the old ones)
    written = [x for x in new if is_quantized(x)]
    zero = zero_after([x.codes for x in written], written[0].scales)
    new = [x._replace(scales=x.scales + zero) if is_quantized(x) else x for x in new]
  return new


def zero_after(p: jax.Array | list[jax.Array], g: jax.Array) -> jax.Array:
  """0 in g's dtype from a conditional on `p` (an array or a list; XLA fuses nothing across a
  conditional): what uses it runs after `p` is written, so an in-place write that must follow the
  last read of an old value (the new moments after the new params, the new scales after the new
  codes) needs no copy. For XLA:CPU's copy insertion: elsewhere a plain 0 (a conditional's
  predicate XLA:GPU reads on the host)."""
  first = lambda qs: sum(
    jnp.minimum(jnp.abs(_sharded_views.an_element(q).astype(g.dtype)), 0) for q in qs
  )
  ps = tuple(p) if isinstance(p, list) else (p,)

  def on_cpu() -> jax.Array:
    zero = jax.lax.cond(
      jnp.isnan(_sharded_views.an_element(g)), first, lambda qs: jnp.zeros((), g.dtype), ps
    )
    return jnp.where(jnp.isnan(zero), 0, zero).astype(g.dtype)

  return jax.lax.platform_dependent(cpu=on_cpu, default=lambda: jnp.zeros((), g.dtype))
