"""One lamb step, planned once for every backend.

`plan_step` reads lamb's hyper-parameters and state and fixes what the step
computes: its `Hyperparams` (count, bias corrections, learning rate, weight
decay, clip factor: each a schedule's value at this step where it is one) and,
per leaf, the static `LeafPlan` (decay, adaptation, stacked axes, mapped axis
names, where its ratios sit in the state's ratio vector). A backend
(`optax_lamb.backends`) computes from the plan and the leaves' arrays only,
and `next_state` assembles the state it returns, so the state is the same on
every backend: the stage chain's state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _leaf, _norms, _schedule, _tree
from optax_lamb._state import LambStateParts, RatioLayout, ScaleByTrustRatioState


@dataclasses.dataclass(frozen=True)
class LambConfig:
  """lamb's hyper-parameters, as given to :func:`optax_lamb.lamb` (the wrappers' options aside)."""

  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  weight_decay: Any
  mask: Any
  bias_correction: bool
  trust_ratio_mask: Any
  min_trust_ratio: Any
  max_trust_ratio: Any
  max_grad_norm: Any
  stacked_axes: Any
  axis_name: Any
  mu_dtype: Any = None
  nu_dtype: Any = None
  # The variants of other libraries (optax_lamb.compat); the defaults are lamb's.
  grad_averaging: bool = True  # False: m = b1 m + g
  weight_decay_placement: str = "direction"  # one of _leaf.DECAY_PLACEMENTS
  decay_base_lr: Any = None  # "params": s = lr_t (None), or lr_t^2 / decay_base_lr
  bias_correction_placement: str = "direction"  # or "step_size": lr sqrt(bc2) / bc1
  clip_norm_eps: float = 0.0  # the clip compares ||g|| + clip_norm_eps with max_grad_norm
  max_param_norm: Any = None  # clamp of ||p|| in the trust ratio
  caution: bool = False  # timm's cautious update

  @property
  def bias_correction_in_direction(self) -> Any:
    # lamb's own value as given: scale_by_adam checks it when the chain is built
    return self.bias_correction if self.bias_correction_placement == "direction" else False

  @property
  def bias_correction_on_step_size(self) -> bool:
    return self.bias_correction and self.bias_correction_placement == "step_size"


def decay_coefficient(config: LambConfig) -> Any:
  """What the decay stage multiplies p by each step: a float, array or schedule.

  The weight decay, or with decay placement "params" the fraction p shrinks by,
  s wd with s = lr_t (Keras, timm ``decoupled_decay``) or lr_t^2 / decay_base_lr
  (timm ``corrected_weight_decay``). A schedule where either factor is one; its
  count advances with the learning rate's, so both are read at the same step.
  """
  c = config
  if c.weight_decay_placement != "params":
    return c.weight_decay

  def at(count):
    value = lambda x: x(count) if callable(x) else x
    lr = value(c.learning_rate)
    scale = lr if c.decay_base_lr is None else lr * lr / c.decay_base_lr
    return value(c.weight_decay) * scale

  scheduled = callable(c.weight_decay) or callable(c.learning_rate)
  return at if scheduled else at(None)


class LeafPlan(NamedTuple):
  """Static facts and options of one leaf (Python values, fixed at trace time)."""

  index: int  # position in the tree's leaves
  shape: tuple[int, ...]
  decay: bool  # add wd * p to the direction
  adapt: bool  # apply the trust ratio (else ratio 1)
  stacked_axes: int  # leading axes that index stacked layers, one ratio per slice
  axis_name: Any  # mapped axes the leaf is sharded over (psum its norms), or None
  ratio_offset: int  # first entry of this leaf in the ratio vector
  narrow_moments: bool  # m or v is stored in a dtype narrower than the one it is computed in

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


class LeafArrays(NamedTuple):
  """One leaf's arrays for a step: gradient (compute dtype), moments, param."""

  g: jax.Array
  m: jax.Array
  v: jax.Array
  p: jax.Array


class StepResult(NamedTuple):
  """What a backend returns, per leaf in order, and the ratio vector."""

  out: list  # the updates, or the new params with `apply`
  mu: list
  nu: list
  ratios: jax.Array


class StepPlan(NamedTuple):
  """Everything one step computes from, for every backend."""

  hyper: _leaf.Hyperparams
  count: jax.Array  # the step number t of this update (1-based)
  leaves: tuple[LeafPlan, ...]
  layout: RatioLayout
  treedef: Any  # of the params
  parts: LambStateParts  # the state the step starts from

  def ratios_from_slots(self, param_sums, update_sums) -> jax.Array:
    """The ratio vector from the slots' sums of squares at every `_norms.SCALES` (a triple of
    vectors for p and one for u; the Pallas backend's), each psum'd over its leaf's axes."""
    names = self.layout.per_slot([leaf.axis_name if leaf.adapt else None for leaf in self.leaves])
    adapted = self.layout.per_slot([leaf.adapt for leaf in self.leaves])
    p_plain, p_down, p_up, u_plain, u_down, u_up = (
      _norms.psum_slots(x, names) for x in (*param_sums, *update_sums)
    )
    return _leaf.trust_ratios(p_plain, u_plain, self.hyper, adapted, (p_down, p_up, u_down, u_up))

  def ratios_from_leaves(
    self, param_sq_norms: list, update_sq_norms: list, scaled_sums
  ) -> jax.Array:
    """The ratio vector from per-leaf plain squared norms (zeros for leaves that do not adapt);
    ``scaled_sums()`` per leaf, only where a plain sum is suspect (`_leaf.trust_ratios`)."""
    return _leaf.trust_ratios_of_leaves(
      param_sq_norms,
      update_sq_norms,
      self.hyper,
      [leaf.axis_name if leaf.adapt else None for leaf in self.leaves],
      self.layout,
      [leaf.adapt for leaf in self.leaves],
      scaled_sums,
    )


def _narrow(stored, grad) -> bool:
  """Whether a moment stored in `stored` loses precision against the one computed from `grad`."""
  return jnp.dtype(stored) != _norms.compute_dtype(grad)


def plan_step(config: LambConfig, grads: Any, state: tuple, params: Any) -> StepPlan:
  """The plan of one update of `state` by `grads` (in the compute dtype) at `params`.

  The prologue has checked the state against ``init(params)`` (structure, shapes, layout).
  """
  c, parts = config, LambStateParts.of(state)
  adam = parts.adam
  count = optax.safe_increment(adam.count)
  bc1, bc2 = _leaf.bias_corrections(count, c.b1, c.b2, c.bias_correction_in_direction)
  weight_decay, decay_state = _schedule.value_and_next_state(decay_coefficient(c), parts.decay)
  learning_rate, lr_state = _schedule.value_and_next_state(c.learning_rate, parts.learning_rate)
  step_size = -1 * learning_rate
  if c.bias_correction_on_step_size:
    step_size = step_size * _leaf.step_size_correction(*_leaf.bias_corrections(count, c.b1, c.b2))
  names = _tree.resolve_axis_names(c.axis_name, params)
  clip_factor = None
  if c.max_grad_norm is not None:
    norm = _norms.global_norm(jax.tree.leaves(grads), names)
    clip_factor = _leaf.clip_factor(norm, c.max_grad_norm, c.clip_norm_eps)
  hyper = _leaf.Hyperparams(
    b1=c.b1,
    b2=c.b2,
    eps=c.eps,
    eps_root=c.eps_root,
    bc1=bc1,
    bc2=bc2,
    weight_decay=weight_decay,
    step_size=step_size,
    clip_factor=clip_factor,
    min_ratio=c.min_trust_ratio,
    max_ratio=c.max_trust_ratio,
    grad_averaging=c.grad_averaging,
    decay_placement=c.weight_decay_placement,
    max_param_norm=c.max_param_norm,
    caution=c.caution,
  )

  treedef = jax.tree.structure(params)
  per_leaf = (
    _tree.resolve_per_leaf(c.mask, grads, True, "mask", "bool"),
    _tree.resolve_per_leaf(c.trust_ratio_mask, params, True, "trust_ratio_mask", "bool"),
    _tree.resolve_stacked_axes(c.stacked_axes, params),
  )
  decays, adapts, axes = (treedef.flatten_up_to(t) for t in per_leaf)
  gs, ms, vs, ps = (treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, params))
  layout = parts.trust_ratio.layout
  leaves = tuple(
    LeafPlan(
      index=i,
      shape=tuple(jnp.shape(p)),
      decay=bool(decays[i]),
      adapt=bool(adapts[i]),
      stacked_axes=axes[i],
      axis_name=names[i],
      ratio_offset=layout.offsets[i],
      narrow_moments=_narrow(ms[i].dtype, gs[i].dtype) or _narrow(vs[i].dtype, gs[i].dtype),
    )
    for i, p in enumerate(ps)
  )
  parts = parts._replace(decay=decay_state, learning_rate=lr_state)
  return StepPlan(hyper, count, leaves, layout, treedef, parts)


def leaf_arrays(plan: StepPlan, grads: Any, params: Any) -> list[LeafArrays]:
  """The step's arrays, one `LeafArrays` per leaf in the plan's order."""
  adam = plan.parts.adam
  columns = [plan.treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, params)]
  return [LeafArrays(*arrays) for arrays in zip(*columns, strict=True)]


def next_state(plan: StepPlan, result: StepResult) -> tuple:
  """lamb's state after the step, from the backend's new moments and ratio vector."""
  unflatten = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)
  adam = optax.ScaleByAdamState(count=plan.count, mu=unflatten(result.mu), nu=unflatten(result.nu))
  ratio_state = ScaleByTrustRatioState.after_step(result.ratios, plan.layout)
  return plan.parts._replace(adam=adam, trust_ratio=ratio_state).as_state()
