r"""One leaf's LAMB step, written once: the formulas every implementation computes.

The stand-alone stages (`_adam`, `_decay`, `_trust_ratio`, `_clipping`), the
fused XLA backend (`backends/xla.py`) and the Pallas kernels (on the blocks
they load) all call these functions, with the step's `Hyperparams`. Adding a
per-element option means a field of `Hyperparams` (a flag or a scalar), its use
here, and its value in `optax_lamb._plan`; the kernels take every field
generically (numbers and flags as compile-time constants, arrays as runtime
scalars).

Notation (You et al. 2019, Algorithm 2): g gradient, p parameter, t step
(1-based), m and v the moments, u the direction before the trust ratio, r the
trust ratio of a leaf (or of a stacked slice of one):

.. math::
  g &\leftarrow c\,g \quad (c = \min(1, \mathrm{max\_norm} / \|g\|_{global})) \\
  m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
  u &= \frac{m / bc_1}{\sqrt{v / bc_2 + \epsilon_{root}} + \epsilon} + \lambda p \\
  r &= \gamma\,\mathrm{clip}\Big(\frac{\max(\|p\|, n_{min})}{\max(\|u\|, n_{min}) + \epsilon_r},
       r_{min}, r_{max}\Big), \quad r = 1 \text{ if either norm is } 0 \\
  \Delta &= -\eta\, r\, u \quad (\text{or the new params } p + \Delta)

The variants other libraries compute (``optax_lamb.compat``) are fields of
`Hyperparams` (`grad_averaging`: m gets g instead of (1 - b1) g; the decay's
`decay_placement`: in u, in g as L2, or shrinking p before the step;
`max_param_norm`, a clamp of ||p||; timm's `caution`) or values that
`optax_lamb._plan` folds into the existing ones (the clip's `norm_eps` in
`clip_factor`, the bias correction on the step size, `step_size_correction`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from optax_lamb import _norms
from optax_lamb._norms import compute_dtype


def is_constant(value) -> bool:
  """Whether a `Hyperparams` field is a compile-time constant (a Python number, flag, name or
  None) rather than a runtime scalar array."""
  return value is None or isinstance(value, (bool, int, float, str))


class Hyperparams(NamedTuple):
  """The scalars and switches of one step, for every leaf.

  Each field is a Python value (a number, a flag or None: a compile-time
  constant) or a scalar array (a schedule's value at this step, a bias
  correction, the clip factor, a hyper-parameter injected by
  ``optax.inject_hyperparams``).
  """

  b1: Any = 0.9  # decay of the first moment
  b2: Any = 0.999  # decay of the second moment
  eps: Any = 1e-6  # added to the Adam denominator, outside the square root
  eps_root: Any = 0.0  # added to the second moment, inside the square root
  bc1: Any = 1.0  # 1 - b1^t (1 without bias correction)
  bc2: Any = 1.0  # 1 - b2^t
  weight_decay: Any = 0.0  # lambda at this step (decaying leaves only); "params": s lambda
  step_size: Any = -1.0  # -learning rate at this step
  clip_factor: Any = None  # min(1, max_norm / ||g||_global); None: no clipping
  min_ratio: Any = None  # lower clamp of the ratio; None: none
  max_ratio: Any = None  # upper clamp of the ratio; None: none
  min_norm: Any = 0.0  # floor of both norms (optax's safe_norm)
  trust_coefficient: Any = 1.0  # gamma, multiplies the clamped ratio
  ratio_eps: Any = 0.0  # added to ||u|| in the ratio's denominator
  grad_averaging: Any = True  # m gets (1 - b1) g; False: m gets g (apex, timm)
  decay_placement: Any = "direction"  # where the decay acts: one of DECAY_PLACEMENTS
  max_param_norm: Any = None  # clamp of ||p|| in the ratio's numerator; None: none
  caution: Any = False  # keep u only where it agrees in sign with g (timm's caution)


# Where the weight decay of a decaying leaf acts:
#   "direction"  u + wd p, inside the trust ratio (optax, apex, DeepSpeed, timm, TF Addons)
#   "gradient"   g + wd p after the clip, before the moments: L2 (apex adam_w_mode=False)
#   "params"     p shrinks by wd p before the step, outside the ratio, whose ||p|| is then the
#                shrunk one (Keras, timm decoupled_decay); `weight_decay` is then s lambda
DECAY_PLACEMENTS = ("direction", "gradient", "params")
CAUTION_MIN_FRACTION = 1e-3  # timm: the kept part is rescaled by at most 1 / 1e-3


def bias_corrections(count, b1, b2, enabled: bool = True):
  """(1 - b1^t, 1 - b2^t), or (1, 1) with bias correction off.

  Written as optax writes it (`1 - decay**count`), so results match optax bit for bit.
  """
  if not enabled:
    one = jnp.ones((), jnp.float32)
    return one, one
  return 1 - b1**count, 1 - b2**count


def clip_factor(global_norm, max_norm, norm_eps: float = 0.0):
  """Scale that brings the global norm (plus `norm_eps`) down to `max_norm` (1 when not above).

  `max_norm` = 0 zeroes every gradient, as apex and timm do (all-zero gradients stay zero).
  DeepSpeed compares the norm plus 1e-6 (`norm_eps`) with `max_norm` and divides by that.
  """
  norm = global_norm
  if norm_eps:
    norm = norm + norm_eps
  return jnp.where(norm <= max_norm, jnp.ones_like(norm), max_norm / norm)


def clip(g, factor):
  """The gradient times the global clip factor, in g's dtype (unchanged for None)."""
  return g if factor is None else (g * factor).astype(g.dtype)


def update_moments(g, m, v, b1, b2, grad_averaging=True):
  """m_t = b1 m + (1 - b1) g,  v_t = b2 v + (1 - b2) g^2 (paper lines 6-7), in the compute dtype.

  Without `grad_averaging` m_t = b1 m + g (apex's and timm's switch); v is unchanged.
  """
  dtype = compute_dtype(g.dtype)
  g = g.astype(dtype)
  m = ((1 - b1) * g if grad_averaging else g) + b1 * m.astype(dtype)
  v = (1 - b2) * jnp.square(g) + b2 * v.astype(dtype)
  return m, v


def moment_gradient(g, p, h: Hyperparams, *, decay: bool):
  """The gradient the moments see: clipped, plus wd p where the leaf decays as L2 ("gradient")."""
  g = clip(g, h.clip_factor)
  return add_decay(g, p, h.weight_decay) if decay and h.decay_placement == "gradient" else g


def moments(g, m, v, h: Hyperparams, *, p=None, decay: bool = False):
  """(m', v') in the compute dtype from the gradient (`moment_gradient`) and the stored moments."""
  g = moment_gradient(g, p, h, decay=decay)
  return update_moments(g, m, v, h.b1, h.b2, h.grad_averaging)


def adam_direction(m, v, h: Hyperparams):
  """u = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps), eps outside the sqrt (optax)."""
  bc1, bc2 = (jnp.asarray(b).astype(m.dtype) for b in (h.bc1, h.bc2))
  return (m / bc1) / (jnp.sqrt(v / bc2 + h.eps_root) + h.eps)


def add_decay(u, p, weight_decay):
  """u + wd p, decoupled weight decay added to the direction, in u's dtype.

  The product is taken in the wider of the two dtypes: a bfloat16 p would round it.
  """
  return (u + weight_decay * p.astype(jnp.promote_types(u.dtype, p.dtype))).astype(u.dtype)


def caution_fraction(u, g, stacked_axes: int = 0, axis_name=None):
  """max(mean([u g > 0]), 1e-3) per leaf (or stacked slice), float32: caution's rescaling.

  `u` is the Adam direction, `g` the gradient the moments saw (`moment_gradient`);
  a leaf sharded over `axis_name` counts its elements on every shard.
  """
  keep = (u * g > 0).astype(jnp.float32)
  axes = tuple(range(stacked_axes, keep.ndim))
  kept = _norms.psum_if(jnp.sum(keep, axis=axes), axis_name)
  count = _norms.psum_if(jnp.asarray(math.prod(keep.shape[stacked_axes:]), jnp.float32), axis_name)
  return jnp.maximum(kept / count, CAUTION_MIN_FRACTION)


def cautious(u, g, fraction):
  """u where it agrees in sign with g, zero elsewhere, over the kept `fraction` (timm's caution)."""
  keep = (u * g > 0).astype(u.dtype)
  return u * (keep / broadcast_ratio(fraction, u).astype(u.dtype))


def direction(m, v, p, h: Hyperparams, *, decay: bool, dtype=None, g=None, kept=None):
  """The Adam direction (in `dtype`, default the moments'), plus wd p where the leaf decays in it.

  With ``h.caution`` it is first masked by `cautious`, which needs the moments'
  gradient `g` and the leaf's `caution_fraction` `kept`.
  """
  u = adam_direction(m, v, h)
  if h.caution:
    u = cautious(u, g, kept)
  u = u if dtype is None else u.astype(dtype)
  return add_decay(u, p, h.weight_decay) if decay and h.decay_placement == "direction" else u


def param_decay(p, h: Hyperparams):
  """wd p in the compute dtype: what p shrinks by before the step (decay placement "params")."""
  return h.weight_decay * p.astype(compute_dtype(p.dtype))


def ratio_params(p, h: Hyperparams, *, decay: bool):
  """The params whose norm the trust ratio takes: p, or the shrunk p - wd p ("params")."""
  if decay and h.decay_placement == "params":
    return p.astype(compute_dtype(p.dtype)) - param_decay(p, h)
  return p


def trust_ratio(param_norm, update_norm, h: Hyperparams):
  """r = gamma clip(max(||p||, n) / (max(||u||, n) + eps_r), r_min, r_max), elementwise.

  In the norms' dtype (float32, or float64 for float64 params). Either norm zero:
  r = 1 exactly (zero-initialised biases still move), with finite derivatives.
  """
  param_norm = jnp.maximum(param_norm, h.min_norm)
  if h.max_param_norm is not None:  # torch_optimizer's clamp_value (0: every ratio is 1)
    param_norm = jnp.minimum(param_norm, h.max_param_norm)
  update_norm = jnp.maximum(update_norm, h.min_norm)
  zero_norm = jnp.logical_or(param_norm == 0, update_norm == 0)
  ratio = param_norm / jnp.where(zero_norm, 1, update_norm + h.ratio_eps)
  if h.min_ratio is not None or h.max_ratio is not None:
    ratio = jnp.clip(ratio, h.min_ratio, h.max_ratio)
  ratio = h.trust_coefficient * ratio
  dtype = compute_dtype(jnp.result_type(param_norm, update_norm))
  return jnp.where(zero_norm, jnp.ones_like(ratio), ratio).astype(dtype)


def trust_ratios(param_sq_norms, update_sq_norms, h: Hyperparams, adapted, scaled_sums):
  """The ratio vector from the plain squared-norm vectors (one slot per leaf or stacked slice).

  Every sum must already be summed over its slot's mapped axes; slots of leaves
  without layer adaptation get ratio 1. ``scaled_sums``: the slots' sums of
  squares at the other `_norms.SCALES`, or a function returning them, for
  `_norms.norms_from_sums`, which keeps the norms exact where a plain sum over- or
  underflowed.
  """
  adapted = np.asarray(adapted, bool)
  norms = _norms.norms_from_sums(param_sq_norms, update_sq_norms, scaled_sums, adapted)
  ratio = trust_ratio(*norms, h)
  return jnp.where(adapted, ratio, jnp.ones_like(ratio))


def trust_ratios_of_leaves(
  param_sq_norms: list, update_sq_norms: list, h: Hyperparams, names: list, layout, adapted: list,
  scaled_sums,
):  # fmt: skip
  """The ratio vector from per-leaf squared norms (stacked shapes) and per-leaf axis names.

  One psum per distinct axis name for both norms, before the leaves are joined
  into the slot vectors (so replicated leaves' ratios stay replicated).
  ``scaled_sums()`` gives the per-leaf lists (p down, p up, u down, u up), called
  only when a plain sum is suspect (see `trust_ratios`).
  """
  n = len(param_sq_norms)
  summed = _norms.psum_by_name([*param_sq_norms, *update_sq_norms], [*names, *names])
  p_sq, u_sq = layout.join(summed[:n]), layout.join(summed[n:])

  def slot_sums():
    flat = _norms.psum_by_name([x for part in scaled_sums() for x in part], list(names) * 4)
    return tuple(layout.join(flat[i * n : (i + 1) * n]) for i in range(4))

  return trust_ratios(p_sq, u_sq, h, layout.per_slot(adapted), slot_sums)


def broadcast_ratio(ratio, leaf):
  """Reshape a per-slice ratio of shape leaf.shape[:k] so it multiplies `leaf` (a scalar as is)."""
  if jnp.ndim(ratio) == 0:
    return ratio
  return jnp.reshape(ratio, jnp.shape(ratio) + (1,) * (jnp.ndim(leaf) - jnp.ndim(ratio)))


def scale_by_ratio(u, ratio):
  """r u in float32 (at least), in u's dtype; `ratio` has the leaf's stacked shape."""
  return (u.astype(compute_dtype(u.dtype)) * broadcast_ratio(ratio, u)).astype(u.dtype)


def scale_by_step_size(u, step_size, dtype):
  """step_size u (optax.scale_by_learning_rate, step_size = -lr) in u's dtype, then in `dtype`."""
  return (jnp.asarray(step_size, u.dtype) * u).astype(dtype)


def step_size_correction(bc1, bc2):
  """sqrt(bc2) / bc1: the bias correction on the step size (DeepSpeed, torch_optimizer's debias).

  It multiplies -lr outside the trust ratio and its clamps, and u then holds the
  uncorrected moments.
  """
  return jnp.sqrt(bc2) / bc1


def update(u, p, ratio, h: Hyperparams, *, apply: bool, decay: bool = False):
  """-lr r u in p's dtype (the update), or p - lr r u with `apply`; `ratio` None: not adapted.

  Where the leaf decays with placement "params", the update also shrinks p by wd p.
  """
  if ratio is not None:
    u = scale_by_ratio(u, ratio)
  u = scale_by_step_size(u, h.step_size, p.dtype)
  if decay and h.decay_placement == "params":
    u = (u.astype(compute_dtype(p.dtype)) - param_decay(p, h)).astype(p.dtype)
  return jnp.asarray(p + u).astype(p.dtype) if apply else u
