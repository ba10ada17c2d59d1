"""ONNX Runtime training's ``LambOptimizer`` op, exactly (its per-element non-finite rules too)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lamb.compat import _common
from optax_lamb.core import _leaf, _options, _ratios
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args, _checks
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build
from optax_lamb.step._update_and_apply import FusableTransformation


def onnxruntime_lamb(
  lr: optax.ScalarOrSchedule = 1e-3,
  alpha: float = 0.9,
  beta: float = 0.999,
  lambda_coef: float = 0.0,
  epsilon: float = 1e-6,
  max_norm_clip: float | None = 1.0,
  ratio_min: float = -math.inf,
  ratio_max: float = math.inf,
  do_bias_correction: bool = True,
  loss_scale: optax.ScalarOrSchedule | None = None,
  *,
  weight_decay_mask: PerLeafMask = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""ONNX Runtime training's ``LambOptimizer`` (com.microsoft domain), its CUDA kernels' results.

  Source: microsoft/onnxruntime, ``orttraining/orttraining/training_ops/cuda/optimizer/``
  ``lamb.h``, ``lamb.cc`` (``LambOptimizer::ComputeInternal``) and ``lamb_impl.cu``
  (``_LambComputeDirectionRule``, ``_LambUpdateRule``), ``common.cuh``
  (``_ComputeGradScale``), the op schema in ``orttraining/core/graph/training_op_defs.cc`` and
  the Python ``LambConfig`` (``orttraining/python/training/optim/config.py``); the commits are
  named in ``tests/compat/references/onnxruntime.py``, its float64 transcription. Per step,
  with G the global norm of all (unscaled) gradients and t the step (ORT's ``update_count``):

  .. math::
    g &\leftarrow g / s, \text{ then } g \leftarrow g\, c / G \text{ when } G > c
      \quad (s = \mathrm{loss\_scale},\ c = \mathrm{max\_norm\_clip}) \\
    m' &= \alpha m + (1 - \alpha) g, \qquad v' = \beta v + (1 - \beta) g^2 \\
    d &= \lambda w + \frac{m' / bc_1}{\sqrt{v' / bc_2} + \epsilon}
      \quad (bc = 1 - \alpha^t, 1 - \beta^t \text{ with do\_bias\_correction, else } 1) \\
    &\text{per element: } d \text{ finite: } (d, m', v'); \text{ else } (0, m, v) \\
    r &= \max(r_{min}, \min(r_{max}, \|w\| / \|d\|)) \quad (1 \text{ if either norm is } 0) \\
    &\text{per element: } w - \eta r d \text{ finite: the new } w; \text{ else } w \text{ kept
      (update 0)}

  Every weight adapts (no trust-ratio exclusion). What the per-element rules mean: a
  non-finite gradient element leaves its weight and moments as they were while the
  rest of the tensor steps (``optax_lamb.lamb`` has no per-element rule:
  ``skip_nonfinite`` skips whole steps), and a NaN weight makes its tensor's ratio
  NaN, so that tensor stops moving (its new weights are all discarded). A d is
  non-finite wherever w is (ORT computes lambda w even with lambda 0).

  ORT's inputs per call: ``eta`` is ``lr`` (a number, an array or an optax schedule
  of the step count); ``loss_scale`` is given here, or per call as
  ``update(..., grad_scale=s)``; the gradient norm is computed here (ORT's trainer
  feeds the global norm of all gradients; ``max_norm_clip=None`` is ORT without
  that input: no clip); ``do_update`` is ``update(..., do_update=flag)``: a false
  flag (a bool, or a 0-d boolean or number array: zero is false) leaves everything as it
  was, step count included, and gives zero updates; another value (a str, a non-scalar)
  raises before anything runs.

  Decisions: ``lambda`` is a Python keyword, spelled ``lambda_coef`` as ORT's own
  Python ``LambConfig`` spells it; a per-weight lambda is ``weight_decay_mask``
  (False: lambda 0 on that weight). The defaults are the op schema's (do_bias_correction
  1) and, for ``lr``, the Python ``LambConfig``'s. ORT refuses ``max_norm_clip=0`` and a
  ``do_bias_correction`` outside {0, 1} (RuntimeError, as here); it accepts a negative
  ``max_norm_clip`` (every gradient's sign flipped), a negative ``ratio_max``, alpha or
  beta outside [0, 1) and ``epsilon=0``, which are refused here with a ValueError (the
  core's limits). ``ratio_min > ratio_max`` gives r = ratio_min, as in ORT. The norms
  are exact where a float32 sum of squares would over- or underflow (ORT's are not).
  The Pallas kernels do not implement the per-element rules: with
  ``implementation="pallas"`` the step runs on XLA, with a warning saying so.
  Memory: unlike lamb's, this step keeps parameter-sized temporaries on XLA (measured
  on XLA:CPU for a donated step: about 3 copies of the params, 4 with the clip): the
  moments are recomputed where they are written, because an element's old moments are
  kept until its direction is known, and the clip is applied to the gradients before
  the step.

  Args:
    lr: eta, the learning rate: a float >= 0 or an optax schedule.
    alpha: decay of the first moment, in [0, 1).
    beta: decay of the second moment, in [0, 1).
    lambda_coef: ORT's ``lambda``, the weight decay added to d, a number >= 0.
    epsilon: added to sqrt(v' / bc2), a number > 0.
    max_norm_clip: c, a number > 0 (``inf``: no clip) or None (no gradient norm input).
    ratio_min: lower bound of the trust ratio (``-inf``: none).
    ratio_max: upper bound of the trust ratio (``inf``: none), >= 0.
    do_bias_correction: 1 (True) or 0 (False): divide the moments by 1 - alpha^t, 1 - beta^t.
      ORT's spelling (an int) or a bool, a NumPy or jax 0-d integer or boolean array; a
      concrete value picks one step, fixed when built. A traced one (``optax.inject_hyperparams``
      keeps an int, not a bool, in its state, traced under ``jax.jit``) is read as a number at
      each step: nonzero corrects (``lax.cond`` between the two steps, both compiled; its value
      cannot be checked for {0, 1} there). A bool stays static under ``inject_hyperparams``.
    loss_scale: ORT's loss scale input: the gradients are divided by it (a number > 0, an
      array or a schedule; lamb's ``grad_scale``, which cannot be given as well).
    weight_decay_mask: True where a weight has ``lambda_coef``, False where its lambda is 0
      (a pytree prefix of bools or a callable(params), like :func:`optax_lamb.lamb`'s ``mask``).
    stacked_axes: as in :func:`optax_lamb.lamb`: one trust ratio per stacked layer.
    axis_name: as in :func:`optax_lamb.lamb`: the mapped axes the leaves are sharded over.
    implementation: as in :func:`optax_lamb.lamb`: ``"auto"``, ``"xla"``, ``"reference"``;
      the Pallas kernels fall back to XLA (see above).
    skip_nonfinite: as in :func:`optax_lamb.lamb`: skip a step with non-finite gradients.
    grad_scale: as in :func:`optax_lamb.lamb`: the loss scale (``loss_scale``'s other name).
    master_weights: as in :func:`optax_lamb.lamb`: float32 masters of low-precision params.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state, whose update
    also takes ``do_update``.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> params = {"w": jnp.array([1.0, 2.0]), "b": jnp.zeros(2)}
    >>> tx = optax_lamb.compat.onnxruntime_lamb(lr=0.1, implementation="xla")
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([0.5, jnp.nan]), "b": jnp.array([1.0, -1.0])}
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates["w"] != 0)  # the NaN element's update is 0, the other one steps
    [ True False]
    >>> print(state[1].mu["w"] != 0)  # and its moment keeps its old value, 0
    [ True False]
    >>> skipped, _ = tx.update(grads, state, params, do_update=False)
    >>> print(skipped["b"])
    [0. 0.]
  """
  _check_args.check_in_unit_interval("alpha", alpha)
  _check_args.check_in_unit_interval("beta", beta)
  _check_args.check_non_negative("lambda_coef", lambda_coef)
  _check_args.check_positive("epsilon", epsilon)  # 0 is refused by the core (0 / 0 where g = 0)
  bias_correction = _bias_correction(do_bias_correction)
  _common.check_mask("weight_decay_mask", weight_decay_mask)
  clip = _max_norm_clip(max_norm_clip)
  min_ratio, max_ratio = _ratio_bounds(ratio_min, ratio_max)
  if loss_scale is not None:
    _check_args.check_positive("loss_scale", loss_scale, schedule=True)
    if grad_scale is not None:
      raise ValueError(
        f"the loss scale is given twice: loss_scale={loss_scale!r} and grad_scale={grad_scale!r}"
        " (the same input, ORT's loss_scale); give one"
      )
  options = _common.lamb_options(locals())
  options["grad_scale"] = grad_scale if loss_scale is None else loss_scale
  make = lambda bias_correction: build(
    gate="do_update",
    **_common.build_args(
      learning_rate=lr,
      learning_rate_name="lr",
      b1=alpha,
      b2=beta,
      eps=epsilon,
      weight_decay=lambda_coef,
      mask=_common.named_mask("weight_decay_mask", weight_decay_mask),
      bias_correction=bias_correction,
      min_trust_ratio=min_ratio,
      max_trust_ratio=max_ratio,
      finite_guard=True,  # per-element rules, in `_leaf` on every backend (skip: whole steps)
      grad_transform=_global_clip(clip, axis_name),
      lamb_options=options,
    ),
  )
  if isinstance(bias_correction, bool):
    return _with_do_update(make(bias_correction))
  return _with_do_update(_switched(bias_correction, make(True), make(False)))


def _bias_correction(flag: Any) -> bool | jax.Array:
  """ORT's do_bias_correction attribute: 0 or 1 (an int, a bool, a 0-d integer or boolean array)
  as a bool; a traced one (``optax.inject_hyperparams`` keeps an int in its state, traced under
  ``jax.jit``) as the predicate of `_switched`, nonzero meaning 1 (its value is unknown here)."""
  dtype = _checks.dtype_of(flag)
  if np.ndim(flag) == 0 and (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    if isinstance(flag, jax.core.Tracer):
      return flag != 0
    if int(flag) in (0, 1):
      return bool(flag)
  raise RuntimeError(
    "do_bias_correction must be either 0 or 1 (an int, a bool or a 0-d integer or boolean array), "
    f"got do_bias_correction={flag!r}"
  )


def _switched(
  on: jax.Array, corrected: Any, uncorrected: Any
) -> optax.GradientTransformationExtraArgs:
  """`corrected`'s step where the traced flag `on` is true, else `uncorrected`'s (one state
  layout: bias correction only changes the step's formula), chosen at run time by ``lax.cond``."""

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
    step = lambda tx: lambda: tx.update(updates, state, params, **extra_args)
    return jax.lax.cond(on, step(corrected), step(uncorrected))

  return optax.GradientTransformationExtraArgs(corrected.init, update_fn)


def _max_norm_clip(max_norm_clip: Any) -> Any:
  """c as `_global_clip` takes it: None (no clip), a number > 0, or an array (read each step)."""
  if max_norm_clip is None:
    return None
  value = _check_args.number("max_norm_clip", max_norm_clip, "a number > 0 or None (no clip)")
  if value is None:
    return max_norm_clip
  if value == 0:
    raise RuntimeError("max_norm_clip must NOT be 0 (ONNX Runtime's kernel refuses it).")
  if not value > 0:
    raise ValueError(
      "max_norm_clip must be a number > 0 or None (ONNX Runtime accepts a negative value, which "
      f"flips every gradient's sign; refused here), got max_norm_clip={max_norm_clip!r}"
    )
  return None if value == math.inf else value


def _ratio_bounds(ratio_min: Any, ratio_max: Any) -> tuple[Any, Any]:
  """ORT's max(ratio_min, min(ratio_max, r)) as lamb's clamps of r >= 0 (`_common.ratio_clamps`)."""
  low = _check_args.number("ratio_min", ratio_min)
  high = _check_args.number("ratio_max", ratio_max)
  if low is not None and not -math.inf <= low < math.inf:
    raise ValueError(f"ratio_min must be a number below inf, got ratio_min={ratio_min!r}")
  if high is not None and not 0.0 <= high:
    raise ValueError(
      "ratio_max must be a number >= 0 (ONNX Runtime accepts a negative bound, which would step "
      f"against the direction; refused here), got ratio_max={ratio_max!r}"
    )
  return _common.ratio_clamps(ratio_max, high, ratio_min, low)


def _global_clip(clip: Any, axis_name: Any) -> Any:
  """`build`'s grad_transform for ORT's clip, or None without one: g c / G where G > c, G the
  global norm of the unscaled gradients (a NaN G clips nothing, an infinite one zeroes every
  finite gradient, as ``_ComputeGradScale`` does with the scaled norm). Not the planned step's
  clip (``max_grad_norm``), which it legitimately differs from there: lamb's clip factor of a
  NaN norm is NaN."""
  if clip is None:
    return None

  def transform(grads: Any, params: Any) -> Any:
    treedef: Any
    leaves, treedef = jax.tree.flatten(grads)
    names = _checks.resolve_axis_names(axis_name, params)
    norm = _ratios.global_norm(leaves, names)

    def nonfinite() -> jax.Array:  # ORT's sum of squares: inf with an inf element, NaN with a NaN
      sums = [jnp.sum(jnp.where(jnp.isfinite(g), 0, jnp.square(g))) for g in leaves]
      return sum(_options.psum_by_name(sums, names), jnp.zeros((), norm.dtype))

    # The norm is NaN for any non-finite element (its rescue divides inf by inf): then ORT's.
    # Off the CPU computed always and selected (a conditional: a host round trip on a GPU).
    on_cpu = lambda: jax.lax.cond(jnp.isnan(norm), nonfinite, lambda: norm)
    on_accelerator = lambda: jnp.where(jnp.isnan(norm), nonfinite(), norm)
    norm = jax.lax.platform_dependent(**_ratios.per_platform(on_cpu, on_accelerator))
    factor = jnp.where(norm > clip, clip / norm, jnp.ones_like(norm))
    return treedef.unflatten([_leaf.clip(g, factor) for g in leaves])

  return transform


def _with_do_update(tx: optax.GradientTransformationExtraArgs) -> Any:
  """`tx` whose update takes ORT's ``do_update`` input: where it is false, zero updates and the
  state as it was. A Python bool is decided here; an array is handed to the planned step as its
  gate (`build`'s ``gate="do_update"``), which keeps each buffer where it is written, as a skipped
  step keeps it (the skip's take, written once), without counting a skip."""

  def update_fn(
    updates: Any, state: Any, params: Any = None, *, do_update: Any = None, **extra_args: Any
  ) -> tuple[Any, Any]:
    if do_update is None or (isinstance(do_update, (bool, np.bool_)) and do_update):
      return tx.update(updates, state, params, **extra_args)
    if isinstance(do_update, (bool, np.bool_)):  # False: nothing runs
      return jax.tree.map(jnp.zeros_like, updates if params is None else params), state
    _check_do_update(do_update)
    gate = jnp.asarray(do_update) != 0
    return tx.update(updates, state, params, do_update=gate, **extra_args)

  if isinstance(tx, FusableTransformation):  # update_and_apply passes no do_update
    return FusableTransformation(tx.init, update_fn, tx.fused_apply)
  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def _check_do_update(do_update: Any) -> None:
  """ORT's do_update input: a bool or a 0-d boolean or number array (nonzero: step)."""
  dtype = _checks.dtype_of(do_update)
  if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)) or jnp.issubdtype(
    dtype, jnp.complexfloating
  ):
    raise TypeError(
      "do_update must be a bool or a 0-d boolean or number array (nonzero: the step runs), got "
      f"do_update={do_update!r}"
    )
  if np.ndim(do_update) != 0:
    raise ValueError(
      f"do_update must be a bool or a 0-d array, got do_update={do_update!r} of shape "
      f"{np.shape(do_update)}"
    )
