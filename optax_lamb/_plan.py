"""One lamb step, planned once for every backend, and the state it leaves.

`plan_step` reads lamb's configuration and state and fixes what the step computes: its
`StepScalars` (bias corrections, the learning rate and weight decay at this step, the clip
factor from `global_norm`: each a schedule's value at this step where it is one) and, per leaf,
the static `LeafPlan` (decay, adaptation, stacked axes, mapped axis names, where its ratios sit
in the state's ratio vector). A backend (`optax_lamb.backends`) computes from the plan and the
leaves' arrays only; `_transform` assembles the state it returns from them, so the state is the
same on every backend: the stage chain's state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _checks, _leaf, _options, _ratios, _skip, _spikes
from optax_lamb._options import LambConfig, LambOptions, RatioLayout, StepScalars
from optax_lamb._quantize import QuantizedMoment


class ScaleByTrustRatioState(NamedTuple):
  """The trust ratios of the last update: one float32 vector for the whole tree (one buffer, as
  a jitted call pays host time per buffer), and its layout (:func:`optax_lamb.trust_ratios`).

  Attributes:
    ratios: float32 vector, one entry per leaf (or per stacked slice), in the order
      that ``layout`` gives; ones before the first update.
    layout: the static :class:`RatioLayout` (no arrays) that maps entries to leaves.

  Example (leaves in ``jax.tree.leaves`` order: bias, then one entry per layer):
    >>> import jax, jax.numpy as jnp, optax_lamb
    >>> params = {"layers": jnp.stack([jnp.ones(3), 2 * jnp.ones(3)]), "bias": jnp.ones(3)}
    >>> tx = optax_lamb.scale_by_trust_ratio(stacked_axes={"layers": 1, "bias": 0})
    >>> _, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    >>> print([round(r, 4) for r in state.ratios.tolist()], state.ratios.dtype)
    [1.0, 1.0, 2.0] float32
  """

  ratios: jax.Array
  layout: RatioLayout

  @classmethod
  def after_step(cls, ratios: jax.Array, layout: RatioLayout) -> ScaleByTrustRatioState:
    """The state of the ratios a step applied, in float32 (as `init` makes them)."""
    return cls(ratios=ratios.astype(jnp.float32), layout=layout)


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


class LeafPlan(NamedTuple):
  """Static facts and options of one leaf (Python values, fixed at trace time)."""

  index: int  # type: ignore[assignment]  # position in the tree's leaves (shadows tuple.index)
  shape: tuple[int, ...]
  decay: bool  # the leaf decays (where: `LambOptions.weight_decay_placement`)
  adapt: bool  # apply the trust ratio (else ratio 1)
  stacked_axes: int  # leading axes that index stacked layers, one ratio per slice
  axis_name: Any  # mapped axes the leaf is sharded over (psum its norms), or None
  ratio_offset: int  # first entry of this leaf in the ratio vector
  narrow_moments: bool  # stored m, v not those u is computed from (narrow, 8-bit, finite_guard)

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
  verdict: Any = None  # optax_lamb._spikes.Verdict: a spike is skipped too


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


def step_scalars(config: LambConfig, parts: LambStateParts, grads: Any, names: list) -> tuple:
  """(the step's `StepScalars`, its count t, the decay and learning-rate states after it)."""
  o, h = config.options, config.hyper
  count = optax.safe_increment(parts.adam.count)
  bc1, bc2 = _leaf.bias_corrections(count, h.b1, h.b2, o.bias_correction_in_direction)
  wd, decay_state = _options.value_and_next_state(decay_coefficient(config), parts.decay)
  lr, lr_state = _options.value_and_next_state(h.learning_rate, parts.learning_rate)
  step_size = -1 * lr
  if o.bias_correction_on_step_size:
    step_size = step_size * _leaf.step_size_correction(*_leaf.bias_corrections(count, h.b1, h.b2))
  clip_factor = None
  if h.max_grad_norm is not None:
    norm = global_norm(jax.tree.leaves(grads), names)
    clip_factor = _leaf.clip_factor(norm, h.max_grad_norm, h.clip_norm_eps)
  scalars = StepScalars(
    b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root, bc1=bc1, bc2=bc2, weight_decay=wd,
    step_size=step_size, clip_factor=clip_factor, min_ratio=h.min_trust_ratio,
    max_ratio=h.max_trust_ratio, max_param_norm=h.max_param_norm,
    adapt_gate=h.weight_decay if o.adapt_if_decaying else None,  # a number or an array
  )  # fmt: skip
  return scalars, count, decay_state, lr_state


def plan_step(config: LambConfig, grads: Any, state: tuple, params: Any,
              rule: SkipRule | None = None) -> StepPlan:  # fmt: skip
  """The plan of one update of `state` by `grads` (in the compute dtype) at `params`.

  The caller has checked the state against ``init(params)`` (structure, shapes, layout).
  With a skip `rule`, a step whose clipped gradients are not finite or would overflow a
  second moment in its dtype is skipped (``scalars.take``), unless the rule lets it through.
  """
  per_leaf, parts = config.per_leaf, LambStateParts(*state)
  names = _checks.resolve_axis_names(per_leaf.axis_name, params)
  scalars, count, decay_state, lr_state = step_scalars(config, parts, grads, names)
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
      narrow_moments=_narrow(ms[i], gs[i].dtype) or _narrow(vs[i], gs[i].dtype) or guard,
    )
    for i, p in enumerate(ps)
  )
  skipping = None
  if rule is not None:
    ok = _checks.gradients_ok(gs, scalars.clip_factor, _leaf.overflow_limits(nu_dtype, vs), names)
    fine = ok if rule.verdict is None else _spikes.passes(ok, rule.verdict)
    consecutive, take = _skip.decide(fine, rule.consecutive, rule.max_errors)
    scalars, skipping = scalars._replace(take=take), Skipping(ok, consecutive)
  parts = parts._replace(decay=decay_state, learning_rate=lr_state)
  return StepPlan(config.options, scalars, leaves, layout, treedef, count, parts, skipping)


def gradients_ok(config: LambConfig, master_weights: bool) -> _skip.GradsOk:
  """lamb's own skip rule as a function of (grads, params), for the wrapper around the chain of
  stages or the master weights: what `plan_step` decides with a `SkipRule` (the moments in
  the params' dtype, or the master's with `master_weights`)."""

  def ok(grads: Any, params: Any) -> jax.Array:
    names = _checks.resolve_axis_names(config.per_leaf.axis_name, params)
    leaves = [_leaf.to_compute_dtype(g) for g in jax.tree.leaves(grads)]
    factor = None
    if config.hyper.max_grad_norm is not None:
      norm = global_norm(leaves, names)
      factor = _leaf.clip_factor(norm, config.hyper.max_grad_norm, config.hyper.clip_norm_eps)
    dtype = lambda p: _leaf.compute_dtype(p.dtype) if master_weights else p.dtype
    nus = [jax.ShapeDtypeStruct(jnp.shape(p), dtype(p)) for p in jax.tree.leaves(params)]
    limits = _leaf.overflow_limits(config.options.nu_dtype, nus)
    return _checks.gradients_ok(leaves, factor, limits, names)

  return ok


def global_norm(leaves: Sequence[jax.Array], names: Sequence[Any]) -> jax.Array:
  """The norm of all `leaves` (each psum'd over its axis names, one psum per name), right for
  every finite input. CPU: the plain sum, or where it overflowed (computed only then) the sum at
  `_ratios.DOWN` (small leaves on one device: `_ratios.small_sums`); elsewhere the sums at
  `_ratios.SCALES` in one reduction per leaf, no conditional (`_ratios.norm_from_sums`)."""
  joint = [name is None and _ratios.one_device() for name in names]

  def total(scale: float) -> jax.Array:
    by_name: dict[Any, jax.Array] = {}  # the leaves of each axis name: one psum
    for x, name, j in zip(leaves, names, joint, strict=True):
      s: Any = scale
      if scale != 1.0:  # in the conditional's branch, where x is already a buffer: free
        # A scale of each leaf's own: XLA:CPU shares one broadcast of a constant among leaves of
        # one shape and stores it, a leaf-sized temporary (benchmarks/NOTES.md, 2026-11-28).
        s, x = jax.lax.optimization_barrier((jnp.asarray(scale, jnp.float32), x))
      sq = _ratios.sq_norm(x, joint=j, scale=s)
      by_name[name] = by_name.get(name, jnp.zeros((), jnp.float32)) + sq
    return sum((_ratios.psum_if(t, n) for n, t in by_name.items()), jnp.zeros((), jnp.float32))

  def on_cpu() -> jax.Array:
    sq = total(1.0)
    rescued = lambda: _ratios.safe_sqrt(total(_ratios.DOWN)) / _ratios.DOWN
    return jax.lax.cond(jnp.isinf(sq), rescued, lambda: _ratios.safe_sqrt(sq))

  def on_accelerator() -> jax.Array:
    by_name: dict[Any, jax.Array] = {}
    scales, zeros = _ratios.opaque_scales(), jnp.zeros(3, jnp.float32)
    for x, name in zip(leaves, names, strict=True):
      by_name[name] = by_name.get(name, zeros) + jnp.stack(_ratios.leaf_sq_sums(x, scales=scales))
    plain, down, up = sum((_ratios.psum_if(t, n) for n, t in by_name.items()), zeros)
    return _ratios.norm_from_sums(plain, _ratios.chosen_scaled(plain, down, up))

  return jax.lax.platform_dependent(**_ratios.per_platform(on_cpu, on_accelerator))
