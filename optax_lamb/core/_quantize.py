r"""Block-wise dynamic 8-bit quantization of one moment leaf (Dettmers et al., 2022).

A leaf is stored as 8-bit codes of its shape plus one float32 scale per block: the block's absolute
maximum s. An element x is stored as the code whose value c (in [-1, 1]) is nearest to x / s, and
read back as c s.

Layout (it depends on the leaf's shape only, never on a mesh, so a checkpoint restores onto any
sharding): blocks of ``block_size`` elements along the last axis, each row of the last axis split
into ceil(n / block_size) blocks, the last one partial. ``codes`` has the leaf's shape (int8 for
the signed map, uint8 for the unsigned one); ``scales`` has shape ``shape[:-1] + (ceil(n /
block_size),)``, float32. Stacked layers (leading axes) get their own blocks per slice. A shard
keeps its blocks whole when it splits leading axes freely and the last axis only into pieces that
are multiples of ``block_size``; its scales are then the matching slice of ``scales`` (the last
axis divided by ``block_size``).

Code maps: the dynamic tree map of bitsandbytes' ``create_dynamic_map``, same 256 values, same
order. Values lie in decades i = 0..6 (10^(i-7) to 10^(i-6)), decade i holding 2^L codes at the
midpoints of 2^L equal bins (L = i signed, i + 1 unsigned), plus 0 and 1.0:

.. math::
  c = N \cdot A_i, \quad N = 2^{L+1} + 18 j + 9, \quad A_i = \mathrm{f32}(2^{-(L+1)} 10^{i-7}),
  \quad j = 0 .. 2^L - 1

so decoding is one exact integer times one per-decade constant (a single rounding, the same on
every backend). Signed (int8, sign and magnitude): code k in -127..127 is sign(k) times the |k|-th
positive value; -128 is +1.0 (the map has no -1.0). Unsigned (uint8): code k is the k-th value in
increasing order, 0 is 0 and 255 is 1.0; codes equal bitsandbytes' indices, and signed codes k map
to its index (k + 127) mod 256.

Encoding is closed-form (no table, no search): each block is first scaled by a power of two so that
its scale s' lies in [1, 2) (exact, so codes do not depend on the scale's exponent); a candidate
code follows from the decade and linear rounding within it; two thresholds, the midpoints between
the candidate and its neighbours (each again one integer times one constant, times s'), move it by
at most one. The result is the nearest code, up to float32 rounding of a midpoint (within 2 ulp of
it either neighbour may be chosen; ties go to the smaller magnitude). Rounding is deterministic,
not stochastic: runs, resumes and skipped steps stay bit-reproducible and the state needs no random
key.

Non-finite inputs: a block holding a NaN or an infinity gets the scale NaN and codes 0, so it
dequantizes to NaN, never to a plausible value; other blocks are unaffected. Negative inputs to the
unsigned map round to its nearest code, 0. Subnormal inputs count as zero (the backends flush
them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lamb.core import _sharded_views

BLOCK_SIZE = 256  # elements per scale: 2 + 8/256 = 2.03 bytes a parameter for both moments
_DECADES = 7


class QuantizedMoment(NamedTuple):
  """A moment leaf as 8-bit codes (int8 signed, uint8 unsigned) and float32 block scales, as
  ``lamb(mu_dtype=jnp.int8, nu_dtype=jnp.uint8)`` stores a leaf of 4,096 elements or more.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.scale_by_adam(mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
    >>> mu = tx.init({"w": jnp.ones((64, 512))}).mu["w"]
    >>> print(type(mu).__name__, mu.codes.dtype, mu.codes.shape, mu.scales.shape)
    QuantizedMoment int8 (64, 512) (64, 2)
  """

  codes: jax.Array
  scales: jax.Array


class _CodeMap(NamedTuple):
  """Per-decade float32 constants of one map (decade i = 0..6)."""

  shift: int  # L - i: 0 signed, 1 unsigned
  one: int  # magnitude index of the value 1.0: 128 signed, 255 unsigned
  bins: tuple  # 2^L: the number of codes in decade i
  area: tuple  # A_i = f32(2^-(L+1) 10^(i-7)): code value = N * A_i
  start: tuple  # f32(10^(i-7)), where decade i starts (candidate only)
  slope: tuple  # 2^L / (9 * 10^(i-7)): j = floor(y * slope - offset) (candidate only)
  offset: tuple  # 2^L / 9


def _code_map(signed: bool) -> _CodeMap:
  shift = 0 if signed else 1
  levels = [i + shift for i in range(_DECADES)]
  return _CodeMap(
    shift=shift,
    one=128 if signed else 255,
    bins=tuple(np.float32(2.0**n) for n in levels),
    area=tuple(np.float32(10.0 ** (i - 7) / 2.0 ** (n + 1)) for i, n in enumerate(levels)),
    start=tuple(np.float32(10.0 ** (i - 7)) for i in range(_DECADES)),
    slope=tuple(np.float32(2.0**n / (9 * 10.0 ** (i - 7))) for i, n in enumerate(levels)),
    offset=tuple(np.float32(2.0**n / 9) for n in levels),
  )


_MAPS = {True: _code_map(True), False: _code_map(False)}


def _select(flags: list[jax.Array], table: tuple) -> jax.Array:
  """table[i] where i = the number of leading true flags (flags are monotone: flags[d-1] = i >= d)."""
  out = jnp.full(flags[0].shape, table[0], dtype=jnp.result_type(table[0]))
  for d in range(1, len(table)):
    out = jnp.where(flags[d - 1], table[d], out)
  return out


def _pow2(k: jax.Array) -> jax.Array:
  """2^k as float32, exact, for int32 k in [-126, 127]."""
  return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _numerator(bins: jax.Array, j: jax.Array) -> jax.Array:
  """N = 2^(L+1) + 18 j + 9, exact in float32: code j of a decade of 2^L codes is N * A_i."""
  return 2 * bins + 18 * j + 9


def _magnitude_value(r: jax.Array, cmap: _CodeMap) -> jax.Array:
  """The value of magnitude index r (0 .. cmap.one): 0, N * A_i, or 1."""
  q = r + cmap.shift  # 2^L <= q < 2^(L+1) for the codes of decade i = L - shift
  flags = [q >= 2 ** (d + cmap.shift) for d in range(1, _DECADES)]
  bins = _select(flags, cmap.bins)
  j = q.astype(jnp.float32) - bins
  value = _numerator(bins, j) * _select(flags, cmap.area)
  return jnp.where(r == 0, 0.0, jnp.where(r == cmap.one, 1.0, value))


def _magnitude_index(a: jax.Array, s: jax.Array, cmap: _CodeMap) -> jax.Array:
  """The magnitude index (int32) of the code nearest to a / s, for 0 <= a <= s, s in [1, 2).

  A candidate from the decade of y = a / s and rounding within it is at most one
  code off (float32 error); the midpoints to its two neighbours decide.
  """
  y = a * (1.0 / s)
  flags = [y >= cmap.start[d] for d in range(1, _DECADES)]
  bins = _select(flags, cmap.bins)
  area = _select(flags, cmap.area)
  j = jnp.clip(jnp.floor(y * _select(flags, cmap.slope) - _select(flags, cmap.offset)), 0, bins - 1)
  n = _numerator(bins, j)  # the candidate's
  last, first, top, bottom = j == bins - 1, j == 0, flags[-1], jnp.logical_not(flags[0])
  # midpoint to the next code: within the decade, into the next decade, or to 1.0
  up = jnp.where(last, jnp.where(top, n + 4.5, n + 27), n + 9) * area
  # midpoint to the previous code: within the decade, from the previous decade's last, or to 0
  down = jnp.where(first, jnp.where(bottom, 0.5 * n, 5 * n - 27), n - 9)
  below = _select(flags, (cmap.area[0],) + cmap.area[:-1])  # A of the previous decade
  down = down * jnp.where(first & ~bottom, below, area)
  candidate = bins - cmap.shift + j
  step = (a > up * s).astype(jnp.float32) - (a <= down * s).astype(jnp.float32)
  return (candidate + step).astype(jnp.int32)


def _normalizers(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Powers of two f1, f2 (both normal floats) with scale * f1 * f2 in [1, 2) for a normal scale."""
  exponent = (lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 0xFF
  k = 127 - exponent  # in [-128, 127]; split so that each factor is a normal float
  return _pow2(k >> 1), _pow2(k - (k >> 1))


def encode(x: jax.Array, scale: jax.Array, *, signed: bool) -> jax.Array:
  """The codes of float32 ``x`` given its block's ``scale`` (broadcastable, the block absmax).

  Elementwise: what a kernel calls on a loaded block after reducing its absmax
  (`block_scale`). A scale that is not finite and positive gives codes 0; an element
  larger than the scale in magnitude (a scale that is not its absmax) saturates at the
  code nearest to +-1.
  """
  cmap = _MAPS[signed]
  x = x.astype(jnp.float32)
  f1, f2 = _normalizers(scale)
  s = scale * f1 * f2
  r = _magnitude_index(jnp.abs(x) * f1 * f2, s, cmap)  # scaling by 2^k is exact
  valid = jnp.isfinite(scale) & (scale > 0)
  if signed:
    r = jnp.where(x < 0, -jnp.minimum(r, cmap.one - 1), r)  # no code for -1.0
    codes = jnp.where(r == cmap.one, -128, r)  # +1.0 is code -128
    return jnp.where(valid, codes, 0).astype(jnp.int8)
  return jnp.where(valid & (x >= 0), r, 0).astype(jnp.uint8)


def decode(codes: jax.Array, scale: jax.Array, *, signed: bool) -> jax.Array:
  """float32 values of ``codes`` given their block's ``scale`` (broadcastable): c * scale."""
  cmap = _MAPS[signed]
  k = codes.astype(jnp.int32)
  if signed:
    r = jnp.where(k == -128, cmap.one, jnp.abs(k))
    unit = jnp.where((k < 0) & (k != -128), -1.0, 1.0) * _magnitude_value(r, cmap)
  else:
    unit = _magnitude_value(k, cmap)
  return unit * scale


def block_scale(x: jax.Array, axis: int = -1) -> jax.Array:
  """The float32 absmax of ``x`` along ``axis``; NaN if any element there is NaN or infinite.
  NaN is mapped to infinity before the max (Triton's max need not propagate it)."""
  a = jnp.abs(x.astype(jnp.float32))
  s = jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), axis=axis)
  return jnp.where(jnp.isinf(s), jnp.nan, s)


def _joint_block_scales(xs: list[jax.Array]) -> list[jax.Array]:
  """`block_scale` of each of ``xs`` (one shape) along the last axis in one variadic reduction:
  XLA:CPU hands a lone max to a library that reads its input from memory (a param-sized temporary).
  Two or more: NaN counts as infinity in the max; a lone one is paired with its non-finite flags."""
  a, axis = [jnp.abs(x.astype(jnp.float32)) for x in xs], (xs[0].ndim - 1,)
  if len(a) == 1:
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.bool_))
    combine = lambda u, w: (jnp.maximum(u[0], w[0]), jnp.logical_or(u[1], w[1]))
    s, bad = lax.reduce((a[0], jnp.logical_not(jnp.isfinite(a[0]))), init, combine, axis)
    return [jnp.where(bad, jnp.nan, s)]
  ops = tuple(jnp.where(jnp.isnan(y), jnp.inf, y) for y in a)
  zeros = tuple(jnp.zeros((), jnp.float32) for _ in ops)
  maxima = lax.reduce(ops, zeros, lambda u, w: tuple(map(jnp.maximum, u, w)), axis)
  return [jnp.where(jnp.isinf(s), jnp.nan, s) for s in maxima]


def scales_shape(shape: tuple[int, ...], block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
  """The shape of a leaf's scales: one per block of the last axis."""
  if not shape:
    raise ValueError("a 0-d leaf has no last axis to split into blocks; keep it in float32")
  return (*shape[:-1], -(-shape[-1] // block_size))


def _block_scales(xs: list[jax.Array], block_size: int, one_reduction: bool) -> list[jax.Array]:
  """The scales of each float32 x of ``xs`` (one shape): whole blocks reduced in place (no padded
  copy), the partial last one apart; by `_joint_block_scales`, or `block_scale` in a Pallas Triton
  kernel (no variadic reduction there): the same scales, a max being exact."""
  n = xs[0].shape[-1]
  whole = n // block_size
  reduce = _joint_block_scales if one_reduction else lambda ys: [block_scale(y) for y in ys]
  parts = []
  if whole or not n:  # n = 0: no blocks, scales of length 0
    blocks = [_sharded_views.last_axis_blocks(x[..., : whole * block_size], block_size) for x in xs]
    parts.append(reduce(blocks))
  if n % block_size:
    parts.append([s[..., None] for s in reduce([x[..., whole * block_size :] for x in xs])])
  return [jnp.concatenate(p, axis=-1) if len(p) > 1 else p[0] for p in zip(*parts, strict=True)]


def _per_element(scales: jax.Array, n: int, block_size: int) -> jax.Array:
  """Each element's block scale: the scales repeated along the last axis, cut to ``n`` (index
  arithmetic in the consumer's fusion)."""
  repeated = jnp.broadcast_to(scales[..., None], (*scales.shape, block_size))
  return repeated.reshape(*scales.shape[:-1], -1)[..., :n]


def _check(shape: tuple[int, ...], block_size: int) -> None:
  if not shape:
    raise ValueError("a 0-d leaf has no last axis to split into blocks; keep it in float32")
  if not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"{block_size=} must be a positive int")


def quantize(
  x: jax.Array, signed: bool, *, block_size: int = BLOCK_SIZE, one_reduction: bool = True
) -> QuantizedMoment:
  """Block-wise quantizes a float leaf (ndim >= 1, any float dtype, computed in float32): codes of
  its shape (int8 with the ``signed`` map, the first moment; uint8 unsigned, the second) and float32
  scales per ``block_size`` elements of the last axis (their reduction: `_block_scales`;
  ``one_reduction`` False inside a Pallas kernel)."""
  return quantize_all([x], [signed], block_size=block_size, one_reduction=one_reduction)[0]


def quantize_all(
  xs: list[jax.Array],
  signed: list[bool],
  *,
  block_size: int = BLOCK_SIZE,
  one_reduction: bool = True,
) -> list[QuantizedMoment]:
  """`quantize` of each of ``xs`` (one shape), their scales from one reduction: a leaf's two
  moments in one pass over memory and no per-block flags (the XLA step's store)."""
  _check(xs[0].shape, block_size)
  return _quantized(xs, signed=tuple(signed), block_size=block_size, one_reduction=one_reduction)


# Jitted: traced once per leaf shape, not at every call (a step quantizes every 8-bit leaf, and
# the trace of the code map's arithmetic was most of the 8-bit step's; benchmarks/NOTES.md).
@functools.partial(jax.jit, static_argnames=("signed", "block_size", "one_reduction"))
def _quantized(xs: list, *, signed: tuple, block_size: int, one_reduction: bool) -> list:
  xs = [x.astype(jnp.float32) for x in xs]
  scales = _block_scales(xs, block_size, one_reduction)
  return [
    QuantizedMoment(encode(x, _per_element(s, x.shape[-1], block_size), signed=f), s)
    for x, s, f in zip(xs, scales, signed, strict=True)
  ]


def dequantize(
  codes: jax.Array, scales: jax.Array, signed: bool, *, block_size: int = BLOCK_SIZE
) -> jax.Array:
  """The float32 leaf that ``quantize`` stored as ``codes`` and ``scales``."""
  _check(codes.shape, block_size)
  expected = jnp.int8 if signed else jnp.uint8
  if codes.dtype != expected or scales.shape != scales_shape(codes.shape, block_size):
    raise ValueError(
      f"codes {codes.dtype}{codes.shape} and scales {scales.shape} do not match {signed=}, "
      f"{block_size=}: expected codes {jnp.dtype(expected)} and scales "
      f"{scales_shape(codes.shape, block_size)}"
    )
  return _decoded(codes, scales, signed=signed, block_size=block_size)


@functools.partial(jax.jit, static_argnames=("signed", "block_size"))
def _decoded(codes: jax.Array, scales: jax.Array, *, signed: bool, block_size: int) -> jax.Array:
  """`decode` of each element with its block's scale; jitted as `_quantized` is."""
  return decode(codes, _per_element(scales, codes.shape[-1], block_size), signed=signed)


def zeros(shape: tuple[int, ...], signed: bool, *, block_size: int = BLOCK_SIZE) -> QuantizedMoment:
  """The quantized zero leaf (what ``quantize`` gives for zeros): codes 0, scales 0."""
  scales = jnp.zeros(scales_shape(shape, block_size), jnp.float32)
  return QuantizedMoment(jnp.zeros(shape, jnp.int8 if signed else jnp.uint8), scales)
