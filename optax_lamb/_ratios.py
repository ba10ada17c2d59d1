"""The trust ratio over a tree, in one place: norm sums from a leaf's chunks, their sums over
mapped axes and stacked slices, the ratio vector and its layout; and the global clipping norm.

Squared norms are accumulated in float32 (at least). A float32 sum of squares
overflows for elements near 1e19 and underflows for elements near 1e-19; the
same sum of (x s)^2 for s = 2^-80 (`DOWN`) stays finite for every float32 x, and
for s = 2^64 (`UP`) keeps every normal x's square normal. `norm_from_sums` takes
the plain sum unless it is `suspect`, then the scaled one. The XLA step and the
stages compute the scaled sums only then (under ``lax.cond``); the Pallas
kernels, memory-bound on a GPU, sum all three in one pass (`block_sq_sums`).
A leaf sharded inside ``shard_map``/``pmap`` has its sums ``psum``'d over its
axis names before the square root, one ``psum`` per distinct name. A tree's
ratios live in one vector (a slot per leaf or stacked slice), laid out by `RatioLayout`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb import _leaf
from optax_lamb._leaf import compute_dtype
from optax_lamb._options import StepScalars

# Below this a float32 sum of squares may have lost terms to underflow (2^-100: about 8e-31).
SMALL_SQUARED_NORM = 2.0**-100
# (x DOWN)^2 <= 2^96 for every float32 x, so 2^31 of them sum to a finite float32; (x UP)^2 is
# normal for every normal x below 2^-50 (all of them, where the plain sum is that small).
DOWN, UP = 2.0**-80, 2.0**64
SCALES = (1.0, DOWN, UP)  # the three sums of one norm, in `norm_from_sums`'s order


def squares(x: jax.Array, scale: float = 1.0) -> jax.Array:
  """(x s)^2 in the compute dtype: the term of every sum of squares of the package."""
  x = x.astype(compute_dtype(x.dtype))
  return jnp.square(x * scale if scale != 1.0 else x)


def sq_norm(x: jax.Array, stacked_axes: int = 0) -> jax.Array:
  """Sum of squares over all but the first `stacked_axes` axes, in one plain reduction."""
  return jnp.sum(squares(x), axis=tuple(range(stacked_axes, jnp.ndim(x))))


def leaf_sq_sums(*xs: jax.Array, stacked_axes: int = 0, scales=(1.0,),
                 partial_count: int = 16) -> tuple[jax.Array, ...]:  # fmt: skip
  """Sums of (x s)^2 for each array x and each s of `scales` (array-major), in one pass.

  Each array is viewed as `partial_count` contiguous blocks; one reduction adds
  the blocks together element by element for every sum at once (a vectorised
  loop that evaluates the inputs' producers, e.g. the LAMB direction, once), then
  the block-sized partial sums are added up. Small leaves, and leaves whose size
  `partial_count` does not divide, take one plain reduction per sum.
  """
  shape = jnp.shape(xs[0])
  lead, size = shape[:stacked_axes], math.prod(shape[stacked_axes:])
  axes = tuple(range(stacked_axes, len(shape)))
  terms = [squares(x, s) for x in xs for s in scales]
  if partial_count == 1 or size < 64 * partial_count or size % partial_count:
    return tuple(jnp.sum(q, axis=axes) for q in terms)
  blocks = [q.reshape(lead + (partial_count, size // partial_count)) for q in terms]
  zeros = tuple(jnp.zeros((), q.dtype) for q in blocks)
  partials = jax.lax.reduce(
    tuple(blocks), zeros, lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
    (len(lead),),
  )  # fmt: skip
  return tuple(jnp.sum(q, axis=-1) for q in partials)


def scaled_sq_sums(p: jax.Array, u: jax.Array, stacked_axes: int = 0) -> tuple[jax.Array, ...]:
  """(p down, p up, u down, u up): the rare path's sums at `SCALES`' other scales, in one pass.

  In 256 blocks, not 16: XLA reserves the memory of a branch it may never run,
  and the block-sized partial sums then take 1/256 of p and u (4 sums), not 1/16.
  """
  return leaf_sq_sums(p, u, stacked_axes=stacked_axes, scales=SCALES[1:], partial_count=256)


def block_sq_sums(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, ...]:
  """A kernel block's sums of (x s)^2 at every `SCALES`, over its unmasked lanes."""
  # Masked lanes hold other=0 inputs, and u may be 0/0 there when eps = 0: zero them first.
  x = jnp.where(mask, x.astype(jnp.float32), 0.0)
  return tuple(jnp.sum(squares(x, s)) for s in SCALES)


def safe_sqrt(sq: jax.Array) -> jax.Array:
  """sqrt(sq), whose derivative stays finite where sq is 0 (the value there is 0): with a plain
  sqrt the untaken zero-norm branch would make gradients through a step NaN. A NaN sum stays
  NaN: a non-finite leaf is never read as a zero norm (the zero-norm rule's ratio 1)."""
  zero = sq == 0
  return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, jnp.ones_like(sq), sq)))


def suspect(sq: jax.Array) -> jax.Array:
  """Where a plain float32 sum of squares may be wrong: infinite, or small enough to have lost
  terms to underflow."""
  return jnp.logical_or(sq < SMALL_SQUARED_NORM, jnp.isinf(sq))


def norm_from_sums(plain: jax.Array, down: jax.Array, up: jax.Array) -> jax.Array:
  """||x|| from its sums of squares at `SCALES`: the plain one where it is right (`suspect`
  says where not), else the scaled one that is; finite derivatives throughout. A NaN x has a
  NaN plain sum; a scaled one NaN alone comes from XLA:CPU (jax 0.10.2) folding (x s)^2 into
  x^2 s^2 (0 inf) for a one-element leaf, which then takes the plain sum's norm."""
  scaled = jnp.where(jnp.isinf(plain), safe_sqrt(down) / DOWN, safe_sqrt(up) / UP)
  scaled = jnp.where(jnp.isnan(scaled), safe_sqrt(plain), scaled)
  return jnp.where(suspect(plain), scaled, safe_sqrt(plain))


def needs_rescue(param_sq: jax.Array, update_sq: jax.Array, adapted: Sequence[bool]) -> jax.Array:
  """Whether an adapted slot's plain sum is `suspect`: then the step takes the scaled sums."""
  flagged = jnp.logical_or(suspect(param_sq), suspect(update_sq))
  return jnp.any(jnp.logical_and(flagged, np.asarray(adapted, bool)))


def psum_if(x: jax.Array, axis_name: Any) -> jax.Array:
  """Sum over the named mapped axes (shard_map/pmap) when `axis_name` is given."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def psum_by_name(pieces: Sequence[jax.Array], names: Sequence[Any]) -> list[jax.Array]:
  """Each piece summed over its own axis names (None: not sharded): one psum per distinct name,
  over the pieces of that name concatenated (a replicated piece stays replicated)."""
  out = list(pieces)
  for name in dict.fromkeys(names):
    if name is None:
      continue
    idx = [i for i, n in enumerate(names) if n == name]
    sizes = [math.prod(jnp.shape(pieces[i])) for i in idx]
    summed = jax.lax.psum(jnp.concatenate([jnp.ravel(pieces[i]) for i in idx]), name)
    for i, a, b in zip(idx, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
      out[i] = jnp.reshape(summed[a:b], jnp.shape(pieces[i]))
  return out


def psum_slots(x: jax.Array, slot_names: Sequence[Any]) -> jax.Array:
  """`psum_by_name` over the entries of one vector, each entry with its own axis names."""
  names = list(dict.fromkeys(slot_names))
  if len(names) <= 1:
    return psum_if(x, names[0] if names else None)
  groups = [np.array([i for i, n in enumerate(slot_names) if n == name]) for name in names]
  summed = psum_by_name([x[g] for g in groups], names)
  return jnp.concatenate(summed)[np.argsort(np.concatenate(groups))]


def global_norm(leaves: Sequence[jax.Array], names: Sequence[Any]) -> jax.Array:
  """The norm of all `leaves` together (each psum'd over its axis names; one psum per name),
  right for every finite input: the plain sum, rescaled only where it overflowed.

  The rescue divides by max|x| (`scaled_norm`): the `DOWN`-scaled sums give the
  same norm, but in this conditional they changed how XLA:CPU fuses the common
  path around it (an update one ulp apart with and without donation)."""
  totals: dict[Any, jax.Array] = {}
  for x, name in zip(leaves, names, strict=True):
    totals[name] = totals.get(name, jnp.zeros((), jnp.float32)) + sq_norm(x)
  sq = sum((psum_if(t, name) for name, t in totals.items()), jnp.zeros((), jnp.float32))

  def rescaled() -> jax.Array:
    norms = [scaled_norm(x, 0, name) for x, name in zip(leaves, names, strict=True)]
    peak = functools.reduce(jnp.maximum, norms, jnp.zeros((), jnp.float32))
    safe_peak = jnp.where(peak > 0, peak, 1)
    return safe_peak * safe_sqrt(sum((jnp.square(n / safe_peak) for n in norms), jnp.zeros(())))

  return jax.lax.cond(jnp.isinf(sq), rescaled, lambda: safe_sqrt(sq))


def scaled_norm(x: jax.Array, stacked_axes: int = 0, axis_name: Any = None) -> jax.Array:
  """||x|| over all but the first `stacked_axes` axes, right for every finite x (no overflow,
  no underflow): max|x| sqrt(sum((x / max|x|)^2)), the max and sum taken over `axis_name` too."""
  x = x.astype(compute_dtype(x.dtype))
  axes = tuple(range(stacked_axes, x.ndim))
  peak = jnp.max(jnp.abs(x), axis=axes, initial=0.0)
  if axis_name is not None:
    peak = jax.lax.pmax(peak, axis_name)
  safe_peak = jnp.where(peak > 0, peak, jnp.ones_like(peak))
  scaled = x / jnp.reshape(safe_peak, safe_peak.shape + (1,) * len(axes))
  return safe_peak * safe_sqrt(psum_if(jnp.sum(jnp.square(scaled), axis=axes), axis_name))


def caution_fraction(u, g, stacked_axes: int = 0, axis_name: Any = None) -> jax.Array:
  """max(mean([u g > 0]), 1e-3) per leaf (or stacked slice), float32: caution's rescaling, `u`
  the Adam direction, `g` the moments' gradient, counted on every shard of `axis_name`."""
  keep = _leaf.agrees(u, g).astype(jnp.float32)
  axes = tuple(range(stacked_axes, keep.ndim))
  kept = psum_if(jnp.sum(keep, axis=axes), axis_name)
  count = psum_if(jnp.asarray(math.prod(keep.shape[stacked_axes:]), jnp.float32), axis_name)
  return jnp.maximum(kept / count, _leaf.CAUTION_MIN_FRACTION)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RatioLayout:
  """Where each leaf's trust ratios sit in the state's ratio vector. Static: no arrays.

  Leaf ``i`` (in ``jax.tree.leaves`` order of the params) owns the entries
  ``offsets[i]:offsets[i + 1]``, reshaped to ``shapes[i]``: ``()`` for a plain
  leaf, the leading stacked axes of a stacked one.
  """

  treedef: Any  # of the params
  shapes: tuple[tuple[int, ...], ...]

  def __hash__(self) -> int:  # every jitted call hashes its arguments' static data: once here
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.treedef, self.shapes))

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    return tuple(itertools.accumulate((math.prod(s) for s in self.shapes), initial=0))

  @property
  def size(self) -> int:
    return self.offsets[-1]

  def join(self, ratios: Sequence[jax.Array]) -> jax.Array:
    """One replicated vector from the per-leaf pieces (in leaf order), in float32 or wider
    (float64 pieces stay so: the state stores them in float32, `ScaleByTrustRatioState`)."""
    if not ratios:  # a tree emptied by optax.masked
      return jnp.ones((0,), jnp.float32)
    dtype = jnp.promote_types(jnp.result_type(*ratios), jnp.float32)
    return jnp.concatenate([jnp.reshape(_replicated(r), (-1,)).astype(dtype) for r in ratios])

  def pieces(self, vector: jax.Array) -> list[jax.Array]:
    """The per-leaf ratios (in leaf order, stacked shapes); leading batch axes (pmap, vmap) kept."""
    batch = jnp.shape(vector)[:-1]
    return [
      jnp.reshape(vector[..., a:b], batch + shape)
      for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes, strict=True)
    ]

  def split(self, vector: jax.Array) -> Any:
    """The per-leaf pytree of ratios; leading batch axes of `vector` (pmap, vmap) are kept."""
    return jax.tree.unflatten(self.treedef, self.pieces(vector))

  def per_slot(self, per_leaf: Sequence[Any]) -> list[Any]:
    """A per-leaf list of values repeated for each of the leaf's slots (static, Python values)."""
    return [
      v for v, shape in zip(per_leaf, self.shapes, strict=True) for _ in range(math.prod(shape))
    ]


def _replicated(x: jax.Array) -> jax.Array:
  """`x` replicated where its type says it is sharded (a mesh of Explicit axes: a stacked leaf's
  ratios, and ``concatenate`` takes operands of one sharding only; the gather is ratio-sized)."""
  sharding = jax.typeof(x).sharding
  if any(entry is not None for entry in getattr(sharding, "spec", ())):
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.reshard(x, replicated)
  return x


class SlotSums(NamedTuple):
  """Per ratio slot, psum'd: ||p||^2 and ||u||^2, and maybe at the other `SCALES` (p down, p up,
  u down, u up)."""

  param: jax.Array
  update: jax.Array
  scaled: tuple[jax.Array, ...] | None = None


def slot_sums(layout: RatioLayout, names: Sequence[Any], param_sq: Sequence[jax.Array],
              update_sq: Sequence[jax.Array]) -> SlotSums:  # fmt: skip
  """The slot vectors from per-leaf plain sums (stacked shapes), each summed over its leaf's
  `names` (one psum per distinct name, before the leaves are joined: replicated leaves stay so)."""
  n = len(param_sq)
  summed = psum_by_name([*param_sq, *update_sq], [*names, *names])
  return SlotSums(layout.join(summed[:n]), layout.join(summed[n:]))


def with_scaled_sums(sums: SlotSums, layout: RatioLayout, names: Sequence[Any],
                     scaled: Sequence[Sequence[jax.Array]]) -> SlotSums:  # fmt: skip
  """`sums` with the scaled ones: per-leaf lists (p down, p up, u down, u up), summed alike."""
  n = len(names)
  flat = psum_by_name([x for part in scaled for x in part], list(names) * len(scaled))
  return sums._replace(scaled=tuple(layout.join(flat[i * n : (i + 1) * n]) for i in range(4)))


def ratio_vector(sums: SlotSums, s: StepScalars, adapted: Sequence[bool]) -> jax.Array:
  """The trust ratio of each slot (1 where it does not adapt, or where `s.adapt_gate` is 0) from
  its sums; with `sums.scaled`, exact norms where a plain sum over- or underflowed."""
  if sums.scaled is None:
    norms = (safe_sqrt(sums.param), safe_sqrt(sums.update))
  else:
    p_down, p_up, u_down, u_up = sums.scaled
    norms = (norm_from_sums(sums.param, p_down, p_up), norm_from_sums(sums.update, u_down, u_up))
  ratio = _leaf.trust_ratio(*norms, s)
  gate = True if s.adapt_gate is None else s.adapt_gate != 0  # apex, timm: wd 0, no ratio
  return jnp.where(jnp.logical_and(np.asarray(adapted, bool), gate), ratio, jnp.ones_like(ratio))
