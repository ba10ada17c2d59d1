"""The LAMB formulas, written once.

Every implementation (the stand-alone stages, the fused XLA path, a kernel's
reference) calls these functions, so the math lives in this module alone.
Notation (You et al. 2019, Algorithm 2): g gradient, p parameter, t step
(1-based), m and v the first and second moments, u the update direction
before the trust ratio, r the trust ratio.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def compute_dtype(dtype) -> jnp.dtype:
  """float32, or wider when the input is wider (float64 under jax_enable_x64)."""
  return jnp.promote_types(dtype, jnp.float32)


def update_moments(g, m, v, b1, b2):
  """m_t = b1 m + (1 - b1) g,  v_t = b2 v + (1 - b2) g^2 (paper lines 6-7)."""
  dtype = compute_dtype(g.dtype)
  g = g.astype(dtype)
  m = (1 - b1) * g + b1 * m.astype(dtype)
  v = (1 - b2) * jnp.square(g) + b2 * v.astype(dtype)
  return m, v


def bias_corrections(count, b1, b2, enabled: bool = True):
  """(1 - b1^t, 1 - b2^t), or (1, 1) with bias correction off.

  Written as optax writes it (`1 - decay**count`), so results match optax bit for bit.
  """
  if not enabled:
    one = jnp.ones((), jnp.float32)
    return one, one
  return 1 - b1**count, 1 - b2**count


def adam_direction(m, v, bc1, bc2, eps, eps_root):
  """u = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps), eps outside the sqrt (optax)."""
  return (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype) + eps_root) + eps)


def sq_norm(x, stacked_axes: int = 0):
  """Sum of squares in float32 (at least), over all but the first `stacked_axes` axes.

  Accumulating in float32 keeps a float16 leaf whose norm exceeds 65504 finite.
  """
  x = x.astype(compute_dtype(x.dtype))
  return jnp.sum(jnp.square(x), axis=tuple(range(stacked_axes, x.ndim)))


def trust_ratio(
  param_sq_norm,
  update_sq_norm,
  *,
  min_norm=0.0,
  trust_coefficient=1.0,
  eps=0.0,
  min_ratio=None,
  max_ratio=None,
):
  """r = trust_coefficient * clip(||p|| / (||u|| + eps), min_ratio, max_ratio).

  Norms are first floored at `min_norm` (optax's `safe_norm`). When either norm
  is zero the ratio is exactly 1, so zero-initialised leaves (biases, LayerNorm
  offsets) still move; the clamp and the coefficient then do not apply.
  """
  param_norm = jnp.maximum(jnp.sqrt(param_sq_norm), min_norm)
  update_norm = jnp.maximum(jnp.sqrt(update_sq_norm), min_norm)
  ratio = param_norm / (update_norm + eps)
  if min_ratio is not None or max_ratio is not None:
    ratio = jnp.clip(ratio, min_ratio, max_ratio)
  ratio = trust_coefficient * ratio
  zero_norm = jnp.logical_or(param_norm == 0, update_norm == 0)
  return jnp.where(zero_norm, jnp.ones_like(ratio), ratio)


def broadcast_ratio(ratio, leaf):
  """Reshape a per-slice ratio of shape leaf.shape[:k] so it multiplies `leaf`."""
  return jnp.reshape(ratio, ratio.shape + (1,) * (leaf.ndim - ratio.ndim))


def clip_factor(global_sq_norm, max_norm):
  """Scale that brings the global norm down to `max_norm` (1 when already below)."""
  norm = jnp.sqrt(global_sq_norm)
  return jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)


def psum_if(x, axis_name):
  """Sum over the named mapped axes (shard_map/pmap) when `axis_name` is given."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def sq_norms(*xs, stacked_axes: int = 0, partial_count: int = 16):
  """`sq_norm` of several same-shaped arrays, computed in one pass over memory.

  Same values as `sq_norm` of each, up to float32 summation order: each array
  is viewed as `partial_count` contiguous blocks, one reduction adds the blocks
  together element by element for every input at once (a vectorised loop that
  also evaluates the inputs' producers, e.g. the LAMB direction, once), and the
  block-sized partial sums are then added up.
  """
  shape = jnp.shape(xs[0])
  lead, size = shape[:stacked_axes], math.prod(shape[stacked_axes:])
  if size < 64 * partial_count or size % partial_count:
    return tuple(sq_norm(x, stacked_axes) for x in xs)
  squares = tuple(
    jnp.square(x.astype(compute_dtype(x.dtype))).reshape(
      lead + (partial_count, size // partial_count)
    )
    for x in xs
  )
  zeros = tuple(jnp.zeros((), s.dtype) for s in squares)
  partials = jax.lax.reduce(
    squares, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)), (len(lead),)
  )
  return tuple(jnp.sum(s, axis=-1) for s in partials)


def add_decay(u, p, weight_decay):
  """u + wd p, decoupled weight decay added to the direction, in u's dtype.

  The product is taken in the wider of the two dtypes: a bfloat16 p would round it.
  """
  return (u + weight_decay * p.astype(jnp.promote_types(u.dtype, p.dtype))).astype(u.dtype)


def scale_by_step_size(u, step_size, dtype):
  """step_size u (optax.scale_by_learning_rate, step_size = -lr) in u's dtype, then in `dtype`."""
  return (jnp.asarray(step_size, u.dtype) * u).astype(dtype)


def to_compute_dtype(tree):
  """Every leaf in float32, or wider where it already is (see `compute_dtype`)."""
  return jax.tree.map(lambda x: x.astype(compute_dtype(x.dtype)), tree)


def scale_by_ratio(u, ratio):
  """r u in float32 (at least), in u's dtype; `ratio` has the leaf's stacked shape."""
  return (u.astype(compute_dtype(u.dtype)) * broadcast_ratio(ratio, u)).astype(u.dtype)
