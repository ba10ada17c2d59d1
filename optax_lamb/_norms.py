"""Squared norms in float32 (at least), and their sums over the mapped axes a leaf is sharded on.

A float32 sum of squares overflows for elements near 1e19 and underflows (to 0,
or a denormal) for elements near 1e-19. The same sum of (x s)^2 for s = 2^-80
(`DOWN`) stays finite for every float32 x, and for s = 2^64 (`UP`) keeps every
normal x's square normal; `norm_from_sums` takes the plain sum unless it came
out infinite or below `SMALL_SQUARED_NORM`, and then the scaled one. The fused
XLA step and the stage chain sum plainly and compute the scaled sums (one pass,
like the plain ones) only under ``lax.cond`` when a plain sum is suspect; the
Pallas kernels, memory-bound on a GPU, accumulate all three in the same pass.

Every norm of the package goes through here: the global clipping norm, the
trust ratio's ||p|| and ||u|| (per leaf or stacked slice), on every
implementation. A leaf sharded inside ``shard_map``/``pmap`` sees only its
shard, so its squared norm is ``psum``'d over its axis names before the
square root; one ``psum`` per distinct axis name covers all leaves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Below this a float32 sum of squares may have lost terms to underflow (2^-100: about 8e-31).
SMALL_SQUARED_NORM = 2.0**-100
# (x DOWN)^2 <= 2^96 for every float32 x, so 2^31 of them sum to a finite float32; (x UP)^2 is
# normal for every normal x below 2^-50 (all of them, where the plain sum is that small).
DOWN, UP = 2.0**-80, 2.0**64
SCALES = (1.0, DOWN, UP)  # the three sums of one norm, in `norm_from_sums`'s order


def compute_dtype(dtype) -> jnp.dtype:
  """float32, or wider when the input is wider (float64 under jax_enable_x64)."""
  return jnp.promote_types(dtype, jnp.float32)


def to_compute_dtype(tree: Any) -> Any:
  """Every leaf in float32, or wider where it already is (see `compute_dtype`)."""
  return jax.tree.map(lambda x: x.astype(compute_dtype(x.dtype)), tree)


def sq_norm(x, stacked_axes: int = 0):
  """Sum of squares in float32 (at least), over all but the first `stacked_axes` axes.

  Accumulating in float32 keeps a float16 leaf whose norm exceeds 65504 finite.
  """
  x = x.astype(compute_dtype(x.dtype))
  return jnp.sum(jnp.square(x), axis=tuple(range(stacked_axes, x.ndim)))


def sq_norms(*xs, stacked_axes: int = 0, scales=(1.0,), partial_count: int = 16):
  """Sums of (x s)^2 for each array x and each s of `scales`, in one pass over memory.

  A flat tuple, array-major (x0 s0, x0 s1, ..., x1 s0, ...). Same values as
  `sq_norm` of each x s, up to float32 summation order: each array is viewed as
  `partial_count` contiguous blocks, one reduction adds the blocks together
  element by element for every sum at once (a vectorised loop that also
  evaluates the inputs' producers, e.g. the LAMB direction, once), and the
  block-sized partial sums are then added up.
  """
  shape = jnp.shape(xs[0])
  lead, size = shape[:stacked_axes], math.prod(shape[stacked_axes:])
  wide = [x.astype(compute_dtype(x.dtype)) for x in xs]
  scaled = [x * s if s != 1.0 else x for x in wide for s in scales]
  if size < 64 * partial_count or size % partial_count:
    return tuple(sq_norm(x, stacked_axes) for x in scaled)
  squares = [jnp.square(x).reshape(lead + (partial_count, size // partial_count)) for x in scaled]
  zeros = tuple(jnp.zeros((), q.dtype) for q in squares)
  partials = jax.lax.reduce(
    tuple(squares),
    zeros,
    lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
    (len(lead),),
  )
  return tuple(jnp.sum(q, axis=-1) for q in partials)


def scaled_sq_sums(p, u, stacked_axes: int = 0):
  """(p down, p up, u down, u up): the rare path's sums at `SCALES`' other scales, in one pass.

  In 256 blocks, not 16: XLA reserves the memory of a branch it may never run,
  and the block-sized partial sums then take 1/256 of p and u (4 sums), not 1/16.
  """
  return sq_norms(p, u, stacked_axes=stacked_axes, scales=SCALES[1:], partial_count=256)


def safe_sqrt(sq):
  """sqrt(sq), whose derivative stays finite where sq is 0 (the value there is 0).

  Callers take another branch where a norm is 0; with a plain sqrt the untaken
  branch's infinite derivative would still make gradients through the step NaN
  (jax.grad of a loss through a step on a zero-initialised leaf).
  """
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, jnp.ones_like(sq))), 0)


def suspect(sq) -> jax.Array:
  """Where a plain float32 sum of squares may be wrong: infinite, or small enough to have lost
  terms to underflow."""
  return jnp.logical_or(sq < SMALL_SQUARED_NORM, jnp.isinf(sq))


def norm_from_sums(plain, down, up):
  """||x|| from its sums of squares at `SCALES`: the plain one where it is right (`suspect`
  says where not), else the scaled one that is; finite derivatives throughout."""
  scaled = jnp.where(jnp.isinf(plain), safe_sqrt(down) / DOWN, safe_sqrt(up) / UP)
  return jnp.where(suspect(plain), scaled, safe_sqrt(plain))


def scaled_norm(x, stacked_axes: int = 0, axis_name=None):
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


def psum_if(x, axis_name):
  """Sum over the named mapped axes (shard_map/pmap) when `axis_name` is given."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def psum_by_name(pieces: Sequence[jax.Array], names: Sequence[Any]) -> list[jax.Array]:
  """Each piece summed over its own axis names (None: not sharded): one psum per distinct name.

  The pieces of one name are concatenated and summed together. Pieces are only
  combined with pieces of the same name, so a replicated piece stays replicated
  (``shard_map`` checks this).
  """
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


def global_sq_norm(leaves: Sequence[Any], names: Sequence[Any]) -> jax.Array:
  """Sum of squares over all `leaves`, each psum'd over its axis names (None: not sharded).

  Leaves are summed locally per axis name first, so there is one psum per name.
  """
  totals: dict[Any, jax.Array] = {}
  for x, name in zip(leaves, names, strict=True):
    totals[name] = totals.get(name, jnp.zeros((), jnp.float32)) + sq_norm(x)
  return sum((psum_if(total, name) for name, total in totals.items()), jnp.zeros((), jnp.float32))


def global_norm(leaves: Sequence[Any], names: Sequence[Any]) -> jax.Array:
  """The norm of all `leaves` together (each psum'd over its axis names), right for every finite
  input: the plain sum of squares, rescaled only where it overflowed (gradients near 1e19).

  The rescue divides by max|x| (`scaled_norm`): the `DOWN`-scaled sums give the
  same norm, but in this conditional they changed how XLA:CPU fuses the common
  path around it (an update one ulp apart with and without donation)."""
  sq = global_sq_norm(leaves, names)

  def rescaled():
    norms = [scaled_norm(x, 0, name) for x, name in zip(leaves, names, strict=True)]
    peak = functools.reduce(jnp.maximum, norms, jnp.zeros((), jnp.float32))
    safe_peak = jnp.where(peak > 0, peak, 1)
    return safe_peak * safe_sqrt(sum(jnp.square(n / safe_peak) for n in norms))

  return jax.lax.cond(jnp.isinf(sq), rescaled, lambda: safe_sqrt(sq))


def norms_from_sums(param_sq_norms, update_sq_norms, scaled_sums, relevant):
  """(||p||, ||u||) per slot from their plain sums of squares, exact where those over- or
  underflowed: ``scaled_sums`` are (p down, p up, u down, u up) at the other `SCALES`, or a
  function returning them, then called (under ``lax.cond``) only when a ``relevant`` slot's plain
  sum is `suspect`, so the common path never computes them."""

  def exact(sums):
    p_down, p_up, u_down, u_up = sums
    return (
      norm_from_sums(param_sq_norms, p_down, p_up),
      norm_from_sums(update_sq_norms, u_down, u_up),
    )

  if not callable(scaled_sums):
    return exact(scaled_sums)
  flagged = jnp.logical_or(suspect(param_sq_norms), suspect(update_sq_norms))
  plain = (safe_sqrt(param_sq_norms), safe_sqrt(update_sq_norms))
  rare = jnp.any(jnp.logical_and(flagged, relevant))
  return jax.lax.cond(rare, lambda: exact(scaled_sums()), lambda: plain)
