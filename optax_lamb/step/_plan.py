"""One lamb step, planned once for every backend, and the state it leaves.

`plan_step` reads lamb's configuration and state and fixes what the step computes: its
`StepScalars` (bias corrections, the learning rate and weight decay at this step, the clip
factor from `_ratios.global_norm`: each a schedule's value at this step where it is one) and, per leaf,
the static `LeafPlan` (decay, adaptation, stacked axes, mapped axis names, where its ratios sit
in the state's ratio vector). A backend (`optax_lamb.backends`) computes from the plan and the
leaves' arrays only; `_transform` assembles the state it returns from them, so the state is the
same on every backend: the stage chain's state.
"""

from __future__ import annotations

import math
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax

from optax_lamb.core import _leaf, _options, _ratios
from optax_lamb.core._config import STEP_SCALAR_NAMES, LambConfig
from optax_lamb.core._options import (
  AxisNames,
  LambOptions,
  RatioLayout,
  ScaleByTrustRatioState,
  StepScalars,
)
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.faults import _checks, _decision

T = TypeVar("T")  # arrays, or what stands in their place (PartitionSpec, NamedSharding)


class LambStateParts(NamedTuple):
  """The parts of lamb's state tuple, by name (the state itself is ``tuple(parts)``, as
  ``optax.chain`` of the five stages makes it, so checkpoints hold a plain tuple)."""

  clip: Any  # optax.EmptyState
  adam: optax.ScaleByAdamState
  decay: Any  # optax.EmptyState, or the count of a weight-decay schedule (maybe masked)
  trust_ratio: ScaleByTrustRatioState
  learning_rate: Any  # optax.EmptyState, or the count of a learning-rate schedule


def decay_coefficient(config: LambConfig) -> Any:
  """What the decay stage multiplies p by each step: a number, an array or a schedule.

  The weight decay, or with decay placement "params" the fraction p shrinks by,
  s wd with s = lr_t (Keras, timm ``decoupled_decay``) or lr_t^2 / decay_base_lr
  (timm ``corrected_weight_decay``). A schedule where either factor is one; its
  count advances with the learning rate's, so both are read at the same step.
  """
  h = config.hyper
  if config.options.weight_decay_placement != "params":
    return h.weight_decay

  def at(count: Any) -> Any:
    value = lambda x: x(count) if callable(x) else x
    lr = value(h.learning_rate)
    scale = lr if h.decay_base_lr is None else lr * lr / h.decay_base_lr
    return value(h.weight_decay) * scale

  scheduled = callable(h.weight_decay) or callable(h.learning_rate)
  return at if scheduled else at(None)


def given_scalars(config: LambConfig) -> StepScalars:
  """The step's numbers that `config` gives as they are (renamed by `STEP_SCALAR_NAMES`), and
  the gate of adaptation (apex, timm: the weight decay, a number or an array); the others at
  their defaults. The XLA path, the kernels and the stage chain all take them from here."""
  h = config.hyper
  given = {scalar: getattr(h, name) for name, scalar in STEP_SCALAR_NAMES.items()}
  gate = h.weight_decay if config.options.adapt_if_decaying else None
  return StepScalars(**given, adapt_gate=gate)


class LeafPlan(NamedTuple):
  """Static facts and options of one leaf (Python values, fixed at trace time)."""

  index: int  # type: ignore[assignment]  # position in the tree's leaves (shadows tuple.index)
  shape: tuple[int, ...]
  decay: bool  # the leaf decays (where: `LambOptions.weight_decay_placement`)
  adapt: bool  # apply the trust ratio (else ratio 1)
  stacked_axes: int  # leading axes that index stacked layers, one ratio per slice
  axis_name: AxisNames  # mapped axes the leaf is sharded over (psum its norms), or None
  ratio_offset: int  # first entry of this leaf in the ratio vector
  narrow_moments: bool  # stored m, v not those u is computed from (narrow, 8-bit, finite_guard)
  # v stored as computed beside a narrow m (a float32 nu, optax's mu_dtype alone): the XLA
  # passes write it in pass 1, as float32 moments, and recompute only m in pass 2
  nu_as_computed: bool = False

  @property
  def slices(self) -> int:
    """S, the number of stacked slices (1 without stacked axes)."""
    return math.prod(self.shape[: self.stacked_axes])

  @property
  def length(self) -> int:
    """L, elements per slice."""
    return math.prod(self.shape[self.stacked_axes :])

  @property
  def size(self) -> int:
    return self.slices * self.length


class LeafArrays(NamedTuple, Generic[T]):
  """One leaf's arrays for a step: gradient (compute dtype), moments, param (or, per_device,
  their shardings)."""

  g: T
  m: T
  v: T
  p: T


class StepResult(NamedTuple, Generic[T]):
  """What a backend returns, per leaf in order, and the ratio vector (or their shardings)."""

  out: list  # the updates, or the new params with `apply`
  mu: list
  nu: list
  ratios: T


class SkipRule(NamedTuple):
  """Skipping (lamb's ``skip_nonfinite``): the skipped steps in a row so far, how many in a
  row are let through (None: none), and with ``skip_spikes`` the spike test's verdict."""

  consecutive: jax.Array
  max_errors: int | None
  verdict: Any = None  # optax_lamb.faults._decision.Verdict: a spike is skipped too


class Skipping(NamedTuple):
  """A step's skip decision: the gradients were fine (a spike aside), the skipped steps in a row."""

  ok: jax.Array
  consecutive: jax.Array


class StepPlan(NamedTuple):
  """Everything one step computes from, for every backend: ``(options, scalars, leaves)``."""

  options: LambOptions
  scalars: StepScalars
  leaves: tuple[LeafPlan, ...]
  layout: RatioLayout
  treedef: Any  # of the params
  count: Any = None  # the step number t of this update (1-based)
  parts: LambStateParts | None = None  # the state the step starts from
  skipping: Skipping | None = None  # with a SkipRule: the decision (also in scalars.take)

  @property
  def adapted_slots(self) -> list[bool]:
    return self.layout.per_slot([leaf.adapt for leaf in self.leaves])

  @property
  def slot_names(self) -> list[Any]:
    """Per ratio slot, the axis names its sums are psum'd over (None where it does not adapt)."""
    return self.layout.per_slot([leaf.axis_name if leaf.adapt else None for leaf in self.leaves])

  @property
  def leaf_names(self) -> list[Any]:
    """Per leaf, the axis names its sums are psum'd over (None where it does not adapt)."""
    return [leaf.axis_name if leaf.adapt else None for leaf in self.leaves]


def _narrow(stored: Any, grad: Any) -> bool:
  """Whether a `stored` moment loses precision against `grad`'s compute dtype (8-bit: always)."""
  return isinstance(stored, QuantizedMoment) or jnp.dtype(stored.dtype) != _leaf.compute_dtype(grad)


def _moment_switches(m: Any, v: Any, grad: Any, guard: bool) -> dict[str, bool]:
  """A leaf's `LeafPlan.narrow_moments` and `nu_as_computed` from its stored moments."""
  narrow_m, narrow_v = _narrow(m, grad) or guard, _narrow(v, grad) or guard
  return {
    "narrow_moments": narrow_m or narrow_v,
    "nu_as_computed": narrow_m and not narrow_v and not isinstance(m, QuantizedMoment),
  }


def step_scalars(config: LambConfig, parts: LambStateParts, grads: Any, names: list) -> tuple:
  """(the step's `StepScalars`, its count t, the decay and learning-rate states after it, the
  clipping's global norm or None)."""
  o, h = config.options, config.hyper
  count = optax.safe_increment(parts.adam.count)
  bc1, bc2 = _leaf.bias_corrections(count, h.b1, h.b2, o.bias_correction_in_direction)
  wd, decay_state = _options.value_and_next_state(decay_coefficient(config), parts.decay)
  lr, lr_state = _options.value_and_next_state(h.learning_rate, parts.learning_rate)
  step_size = -1 * lr
  if o.bias_correction_on_step_size:
    step_size = step_size * _leaf.step_size_correction(*_leaf.bias_corrections(count, h.b1, h.b2))
  clip_factor = norm = None
  if h.max_grad_norm is not None:
    norm = _ratios.global_norm(jax.tree.leaves(grads), names)
    clip_factor = _leaf.clip_factor(norm, h.max_grad_norm, h.clip_norm_eps)
  scalars = given_scalars(config)._replace(
    bc1=bc1, bc2=bc2, weight_decay=wd, step_size=step_size, clip_factor=clip_factor
  )
  return scalars, count, decay_state, lr_state, norm


def plan_step(
  config: LambConfig, grads: Any, state: tuple, params: Any, rule: SkipRule | None = None
) -> StepPlan:
  """The plan of one update of `state` by `grads` (in the compute dtype) at `params`.

  The caller has checked the state against ``init(params)`` (structure, shapes, layout).
  With a skip `rule`, a step whose clipped gradients are not finite or would overflow a
  second moment in its dtype is skipped (``scalars.take``), unless the rule lets it through.
  """
  per_leaf, parts = config.per_leaf, LambStateParts(*state)
  names = _checks.resolve_axis_names(per_leaf.axis_name, params)
  scalars, count, decay_state, lr_state, clip_norm = step_scalars(config, parts, grads, names)
  treedef: Any = jax.tree.structure(params)
  resolved = (
    _checks.resolve_per_leaf(per_leaf.mask, grads, True, "mask", "bool"),
    _checks.resolve_per_leaf(per_leaf.trust_ratio_mask, params, True, "trust_ratio_mask", "bool"),
    _checks.resolve_stacked_axes(per_leaf.stacked_axes, params),
  )
  decays, adapts, axes = (treedef.flatten_up_to(t) for t in resolved)
  adam = parts.adam
  gs, ms, vs, ps = (treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, params))
  layout = parts.trust_ratio.layout
  guard, nu_dtype = config.options.finite_guard, config.options.nu_dtype
  leaves = tuple(
    LeafPlan(
      index=i,
      shape=tuple(jnp.shape(p)),
      decay=bool(decays[i]),
      adapt=bool(adapts[i]),
      stacked_axes=axes[i],
      axis_name=names[i],
      ratio_offset=layout.offsets[i],
      **_moment_switches(ms[i], vs[i], gs[i].dtype, guard),
    )
    for i, p in enumerate(ps)
  )
  skipping = None
  if rule is not None:
    limits, h = _leaf.overflow_limits(nu_dtype, vs), config.hyper
    # The clipping norm decides where clipping keeps every finite gradient under its limit.
    keeps = _checks.clip_keeps_below(h.max_grad_norm, h.clip_norm_eps, limits)
    ok = _checks.gradients_ok(
      gs, scalars.clip_factor, limits, names, clipped_by=clip_norm if keeps else None
    )
    fine = ok if rule.verdict is None else _decision.passes(ok, rule.verdict)
    consecutive, take = _decision.decide(fine, rule.consecutive, rule.max_errors)
    scalars, skipping = scalars._replace(take=take), Skipping(ok, consecutive)
  parts = parts._replace(decay=decay_state, learning_rate=lr_state)
  return StepPlan(config.options, scalars, leaves, layout, treedef, count, parts, skipping)
