r"""One leaf's LAMB step, element by element, written once: the formulas every implementation computes.

The stand-alone stages (`_adam`, `_decay`, `_trust_ratio`, `_clipping`), the
fused XLA backend (`backends/xla/`) and the Pallas kernels (on the blocks
they load) all call these functions with the step's `LambOptions` (switches)
and `StepScalars` (numbers). Reductions over a leaf or a tree (norms, the trust
ratios, caution's kept fraction) are `optax_lamb.core._ratios`'. Adding a
per-element option means a field of `LambOptions` or `StepScalars`, its use
here, and its value in `optax_lamb.step._plan`.

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
`LambOptions` (`grad_averaging`: m gets g instead of (1 - b1) g; the decay's
`weight_decay_placement`; timm's `caution`) or of `StepScalars` (`max_param_norm`,
a clamp of ||p||), or values that `optax_lamb.step._plan` folds into the existing ones
(the clip's norm eps in `clip_factor`, the bias correction on the step size).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb import _interop
from optax_lamb.core import _moment_storage
from optax_lamb.core._options import LambOptions, Scalar, StepScalars

CAUTION_MIN_FRACTION = 1e-3  # timm: the kept part is rescaled by at most 1 / 1e-3


def compute_dtype(dtype: Any) -> jnp.dtype:
  """float32, or wider when the input is wider (float64 under jax_enable_x64)."""
  return jnp.promote_types(dtype, jnp.float32)


def to_compute_dtype(tree: Any) -> Any:
  """Every leaf in float32, or wider where it already is (see `compute_dtype`)."""
  return jax.tree.map(lambda x: x.astype(compute_dtype(x.dtype)), tree)


def unscale(g: jax.Array, grad_scale: Scalar) -> jax.Array:
  """g / s in float32 (at least): a loss-scaled float16 gradient underflows in float16 once
  unscaled."""
  dtype = compute_dtype(g.dtype)
  return g.astype(dtype) / jnp.asarray(grad_scale).astype(dtype)


def bias_corrections(count: jax.Array, b1: Scalar, b2: Scalar, enabled: bool = True) -> tuple:
  """(1 - b1^t, 1 - b2^t), or (1, 1) with bias correction off.

  Written as optax writes it (`1 - decay**count`), so results match optax bit for bit.
  """
  if not enabled:
    one = jnp.ones((), jnp.float32)
    return one, one
  return 1 - b1**count, 1 - b2**count


def step_size_correction(bc1: Any, bc2: Any) -> jax.Array:
  """sqrt(bc2) / bc1: the bias correction on the step size (DeepSpeed, torch_optimizer's debias).

  It multiplies -lr outside the trust ratio and its clamps, and u then holds the
  uncorrected moments.
  """
  return jnp.sqrt(bc2) / bc1


def clip_factor(global_norm: jax.Array, max_norm: Scalar, norm_eps: Scalar = 0.0) -> jax.Array:
  """Scale that brings the global norm (plus `norm_eps`) down to `max_norm` (1 when not above).

  `max_norm` = 0 zeroes every gradient, as apex and timm do (all-zero gradients stay zero).
  DeepSpeed compares the norm plus 1e-6 (`norm_eps`) with `max_norm` and divides by that.
  """
  norm = global_norm
  if not (isinstance(norm_eps, (int, float)) and norm_eps == 0):
    norm = norm + norm_eps
  return jnp.where(norm <= max_norm, jnp.ones_like(norm), max_norm / norm)


def clip(g: jax.Array, factor: Any) -> jax.Array:
  """The gradient times the global clip factor, in g's dtype (unchanged for None)."""
  return g if factor is None else (g * factor).astype(g.dtype)


def update_moments(g, m, v, b1: Scalar, b2: Scalar, grad_averaging: bool = True) -> tuple:
  """m_t = b1 m + (1 - b1) g,  v_t = b2 v + (1 - b2) g^2 (paper lines 6-7), in the compute dtype.

  Without `grad_averaging` m_t = b1 m + g (apex's and timm's switch); v is unchanged.
  A moment stored 8-bit quantized (`optax_lamb.core._moment_storage`) is dequantized first.
  """
  dtype = compute_dtype(g.dtype)
  g = g.astype(dtype)
  m, v = (loaded(x, dtype) for x in (m, v))
  m = ((1 - b1) * g if grad_averaging else g) + b1 * m
  v = (1 - b2) * jnp.square(g) + b2 * v
  return m, v


def loaded(stored: Any, dtype: Any) -> jax.Array:
  """A stored moment in `dtype`: cast, or dequantized where it is stored quantized."""
  if isinstance(stored, _moment_storage.QuantizedMoment):
    return _moment_storage.load(stored, dtype)
  return stored.astype(dtype)


def _decays_in(o: LambOptions, decay: bool, placement: str) -> bool:
  return decay and o.weight_decay_placement == placement


def moment_gradient(g, p, o: LambOptions, s: StepScalars, *, decay: bool) -> jax.Array:
  """The gradient the moments see: clipped, plus wd p where the leaf decays as L2 ("gradient")."""
  g = clip(g, s.clip_factor)
  return add_decay(g, p, s.weight_decay) if _decays_in(o, decay, "gradient") else g


def moments(
  g, m, v, o: LambOptions, s: StepScalars, *, p=None, decay: bool = False, v_is_new: bool = False
) -> tuple:
  """(m', v') in the compute dtype from the gradient (`moment_gradient`) and the stored moments;
  `v_is_new`: v is v' already (computed and stored exactly, a float32 nu beside a narrow mu)."""
  g = moment_gradient(g, p, o, s, decay=decay)
  m, v_t = update_moments(g, m, v, s.b1, s.b2, o.grad_averaging)
  return m, (v if v_is_new else v_t)


def adam_direction(m, v, s: StepScalars) -> jax.Array:
  """u = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps), eps outside the sqrt (optax)."""
  bc1, bc2 = (jnp.asarray(b).astype(m.dtype) for b in (s.bc1, s.bc2))
  return (m / bc1) / (jnp.sqrt(v / bc2 + s.eps_root) + s.eps)


def add_decay(u, p, weight_decay: Scalar) -> jax.Array:
  """u + wd p, decoupled weight decay added to the direction, in u's dtype.

  The product is taken in the wider of the two dtypes: a bfloat16 p would round it.
  """
  return (u + weight_decay * p.astype(jnp.promote_types(u.dtype, p.dtype))).astype(u.dtype)


def agrees(u, g) -> jax.Array:
  """1 where u and g have the same sign (and neither is 0), else 0: caution's kept elements."""
  return (u * g > 0).astype(u.dtype)


def cautious(u, g, fraction) -> jax.Array:
  """u where it agrees in sign with g, zero elsewhere, over the kept `fraction` (timm's caution)."""
  return u * (agrees(u, g) / broadcast_ratio(fraction, u).astype(u.dtype))


def direction(
  m, v, p, o: LambOptions, s: StepScalars, *, decay: bool, dtype=None, g=None, kept=None
) -> jax.Array:
  """The Adam direction (in `dtype`, default the moments'), plus wd p where the leaf decays in it.

  With ``o.caution`` it is first masked by `cautious`, which needs the moments'
  gradient `g` and the leaf's kept fraction `kept` (`optax_lamb.core._ratios.caution_fraction`).
  """
  u = adam_direction(m, v, s)
  if o.caution:
    u = cautious(u, g, kept)
  u = u if dtype is None else u.astype(dtype)
  u = add_decay(u, p, s.weight_decay) if _decays_in(o, decay, "direction") else u
  return jnp.where(finite_direction(u, p), u, jnp.zeros_like(u)) if o.finite_guard else u


def finite_direction(u, p) -> jax.Array:
  """Where the direction is finite, p included (``o.finite_guard``, ONNX Runtime: its u is
  lambda p + ..., with lambda 0 too, so a non-finite p makes u non-finite)."""
  return jnp.logical_and(jnp.isfinite(u), jnp.isfinite(p))


def stored_moments(
  m_c, v_c, m, v, p, o: LambOptions, s: StepScalars, *, decay: bool, v_is_new: bool = False
) -> tuple:
  """The new moments `m_c`, `v_c` (compute dtype) as stored in the old ones' (`m`, `v`) dtypes;
  with ``o.finite_guard``, the old values where the direction they give is not finite;
  `v_is_new` (no guard): v_c is stored already (`moments`)."""
  if v_is_new:
    return stored(m_c, m, s), v_c
  if o.finite_guard:
    u = adam_direction(m_c, v_c, s)
    u = add_decay(u, p, s.weight_decay) if _decays_in(o, decay, "direction") else u
    finite = finite_direction(u, p)
    m_c = jnp.where(finite, m_c, m.astype(m_c.dtype))
    v_c = jnp.where(finite, v_c, v.astype(v_c.dtype))
  quantized = _moment_storage.QuantizedMoment
  if isinstance(m, quantized) and isinstance(v, quantized):  # both in one pass
    return tuple(_moment_storage.store_all([m_c, v_c], [m, v], s.take))
  return stored(m_c, m, s), stored(v_c, v, s)


def param_decay(p, s: StepScalars) -> jax.Array:
  """wd p in the compute dtype: what p shrinks by before the step (decay placement "params")."""
  return s.weight_decay * p.astype(compute_dtype(p.dtype))


def ratio_params(p, o: LambOptions, s: StepScalars, *, decay: bool) -> jax.Array:
  """The params whose norm the trust ratio takes: p, or the shrunk p - wd p ("params")."""
  if _decays_in(o, decay, "params"):
    return p.astype(compute_dtype(p.dtype)) - param_decay(p, s)
  return p


def trust_ratio(param_norm, update_norm, s: StepScalars) -> jax.Array:
  """r = gamma clip(max(||p||, n) / (max(||u||, n) + eps_r), r_min, r_max), elementwise.

  In the norms' dtype (float32, or float64 for float64 params). Either norm zero:
  r = 1 exactly (zero-initialised biases still move), with finite derivatives.
  """
  param_norm = jnp.maximum(param_norm, s.min_norm)
  if s.max_param_norm is not None:  # torch_optimizer's clamp_value (0: every ratio is 1)
    param_norm = jnp.minimum(param_norm, s.max_param_norm)
  update_norm = jnp.maximum(update_norm, s.min_norm)
  zero_norm = jnp.logical_or(param_norm == 0, update_norm == 0)
  ratio = param_norm / jnp.where(zero_norm, 1, update_norm + s.ratio_eps)
  if s.min_ratio is not None or s.max_ratio is not None:
    ratio = jnp.clip(ratio, s.min_ratio, s.max_ratio)
  ratio = s.trust_coefficient * ratio
  dtype = compute_dtype(jnp.result_type(param_norm, update_norm))
  return jnp.where(zero_norm, jnp.ones_like(ratio), ratio).astype(dtype)


def broadcast_ratio(ratio, leaf) -> jax.Array:
  """Reshape a per-slice ratio of shape leaf.shape[:k] so it multiplies `leaf` (a scalar as is)."""
  if jnp.ndim(ratio) == 0:
    return ratio
  return jnp.reshape(ratio, jnp.shape(ratio) + (1,) * (jnp.ndim(leaf) - jnp.ndim(ratio)))


def scale_by_ratio(u, ratio) -> jax.Array:
  """r u in float32 (at least), in u's dtype; `ratio` has the leaf's stacked shape."""
  return (u.astype(compute_dtype(u.dtype)) * broadcast_ratio(ratio, u)).astype(u.dtype)


def scale_by_step_size(u, step_size: Scalar, dtype) -> jax.Array:
  """step_size u (optax.scale_by_learning_rate, step_size = -lr) in u's dtype, then in `dtype`."""
  return (jnp.asarray(step_size, u.dtype) * u).astype(dtype)


def kept(new: jax.Array, old: Any, s: StepScalars) -> jax.Array:
  """`new`, or `old` where the step is skipped (``s.take`` 0): selected where it is written, so a
  skipped step leaves every buffer bit-identical at no memory cost."""
  if s.take is None:
    return new
  if isinstance(old, (int, float)):
    old = _interop.full_like_in_memory(new, old)
  return jnp.where(jnp.asarray(s.take) != 0, new, old)


def stored(moment: jax.Array, old: Any, s: StepScalars, *, one_reduction: bool = True) -> Any:
  """A moment computed in the compute dtype, as stored in `old`'s dtype (kept where skipped);
  quantized where `old` is (its codes and scales kept, bit-identical, where skipped; in a Pallas
  kernel with `one_reduction` False: `_moment_storage.store`)."""
  if isinstance(old, _moment_storage.QuantizedMoment):
    return _moment_storage.store(moment, old, s.take, one_reduction=one_reduction)
  return kept(moment.astype(old.dtype), old, s)


def update(
  u, p, ratio, o: LambOptions, s: StepScalars, *, apply: bool, decay: bool = False
) -> jax.Array:
  """-lr r u in p's dtype (the update), or p - lr r u with `apply`; `ratio` None: not adapted.

  Where the leaf decays with placement "params", the update also shrinks p by wd p. A
  skipped step gives a zero update (p itself with `apply`).
  """
  if ratio is not None:
    u = scale_by_ratio(u, ratio)
  if not apply:  # zeroed before the step size: the caller's p + lr u stays one fused multiply-add
    u = kept(u, 0, s)
  u = scale_by_step_size(u, s.step_size, p.dtype)
  if _decays_in(o, decay, "params"):
    shrink = param_decay(p, s) if apply else kept(param_decay(p, s), 0, s)
    u = (u.astype(compute_dtype(p.dtype)) - shrink).astype(p.dtype)
  if o.finite_guard:  # ONNX Runtime: a new param that is not finite is discarded
    new = jnp.asarray(p + u).astype(p.dtype)
    finite = jnp.isfinite(new)
    if apply:
      return kept(jnp.where(finite, new, p), p, s)
    return jnp.where(finite, u, jnp.zeros_like(u))
  return kept(jnp.asarray(p + u).astype(p.dtype), p, s) if apply else u


def overflow_limits(nu_dtype: np.dtype | None, nus: list) -> list[float]:
  """Per leaf, the largest |g| (after clipping) whose square fits its second moment's dtype
  (float32 for 8-bit moments: their scales, and the leaves too small to quantize)."""
  if nu_dtype is not None and jnp.dtype(nu_dtype) == jnp.uint8:
    nu_dtype = jnp.float32
  return [overflow_threshold(nu_dtype or v.dtype) for v in nus]


def overflow_threshold(dtype: Any) -> float:
  """The largest |g| whose square, and so every second moment averaged from it, is finite when
  stored in `dtype`: sqrt of its largest value (1.8e19 for float32 and bfloat16, 255.9 for
  float16)."""
  return math.sqrt(float(jnp.finfo(jnp.dtype(dtype)).max))
