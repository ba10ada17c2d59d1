"""One lamb step, planned once for every backend.

`plan_step` reads lamb's hyper-parameters and state and fixes what the step
computes: its scalars (count, bias corrections, learning rate, weight decay,
clip factor, each a schedule's value at this step where it is one) and, per
leaf, the static options (decay, adaptation, stacked axes, mapped axis names,
where its ratios sit in the state's ratio vector). The backends
(`backends.xla`, `backends.pallas`) compute from the plan only, and
`next_state` assembles the state they return, so the state is the same on
every backend: the stage chain's state (clip, Adam, decay, trust ratio,
learning rate).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import optax

from optax_lamb import _clipping, _math, _schedule, _tree
from optax_lamb._trust_ratio import RatioLayout, ScaleByTrustRatioState


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


class LeafPlan(NamedTuple):
  """Static options of one leaf (Python values, fixed at trace time)."""

  decay: bool  # add wd * p to the direction
  adapt: bool  # apply the trust ratio (else ratio 1)
  stacked_axes: int  # leading axes that index stacked layers, one ratio per slice
  axis_name: Any  # mapped axes the leaf is sharded over (psum its norms), or None
  ratio_offset: int  # first entry of this leaf in the ratio vector


class StepPlan(NamedTuple):
  """Everything one step computes from, for every backend."""

  config: LambConfig
  count: jax.Array  # the step number t of this update (1-based)
  bc1: Any  # 1 - b1^t (or 1)
  bc2: Any  # 1 - b2^t (or 1)
  weight_decay: Any  # its value at this step
  step_size: Any  # -learning_rate at this step
  clip_factor: Any  # min(1, max_grad_norm / ||g||), or None without clipping
  leaves: tuple[LeafPlan, ...]
  layout: RatioLayout
  treedef: Any  # of the params
  stage_states: tuple  # the next (clip, decay, learning-rate) stage states


def _check_state(state: Any) -> None:
  if not (isinstance(state, tuple) and len(state) == 5 and hasattr(state[1], "mu")):
    raise ValueError(
      "lamb expects its own state, the 5-tuple (clip, ScaleByAdamState, decay, "
      f"ScaleByTrustRatioState, learning rate) that lamb(...).init returns; got {type(state)}"
    )


def plan_step(config: LambConfig, grads: Any, state: tuple, params: Any) -> StepPlan:
  """The plan of one update of `state` by `grads` (already float32) at `params`."""
  _check_state(state)
  clip_state, adam_state, decay_state, ratio_state, lr_state = state
  _tree.check_same_structure(grads, "updates", adam_state.mu, "the optimizer state (mu)")
  c = config
  count = optax.safe_increment(adam_state.count)
  bc1, bc2 = _math.bias_corrections(count, c.b1, c.b2, c.bias_correction)
  weight_decay, decay_state = _schedule.value_and_next_state(c.weight_decay, decay_state)
  learning_rate, lr_state = _schedule.value_and_next_state(c.learning_rate, lr_state)
  clip_factor = None
  if c.max_grad_norm is not None:
    sq_norm = _clipping.global_sq_norm(grads, c.axis_name)
    clip_factor = _math.clip_factor(sq_norm, c.max_grad_norm)

  treedef = jax.tree.structure(params)
  per_leaf = (
    _tree.resolve_per_leaf(c.mask, grads, True, "mask", "bool"),
    _tree.resolve_per_leaf(c.trust_ratio_mask, params, True, "trust_ratio_mask", "bool"),
    _tree.resolve_stacked_axes(c.stacked_axes, params),
  )
  decays, adapts, axes = (treedef.flatten_up_to(t) for t in per_leaf)
  names = _tree.resolve_axis_names(c.axis_name, params)
  # The prologue has checked the layout against these params (_check_trees.check_state).
  layout = ratio_state.layout
  leaves = tuple(
    LeafPlan(bool(d), bool(a), k, n, offset)
    for d, a, k, n, offset in zip(decays, adapts, axes, names, layout.offsets[:-1], strict=True)
  )
  return StepPlan(
    config=c,
    count=count,
    bc1=bc1,
    bc2=bc2,
    weight_decay=weight_decay,
    step_size=-1 * learning_rate,
    clip_factor=clip_factor,
    leaves=leaves,
    layout=layout,
    treedef=treedef,
    stage_states=(clip_state, decay_state, lr_state),
  )


def next_state(plan: StepPlan, mu: list, nu: list, ratios: jax.Array) -> tuple:
  """lamb's state after the step, from the backend's new moments (per leaf) and ratio vector."""
  clip_state, decay_state, lr_state = plan.stage_states
  unflatten = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)
  return (
    clip_state,
    optax.ScaleByAdamState(count=plan.count, mu=unflatten(mu), nu=unflatten(nu)),
    decay_state,
    ScaleByTrustRatioState(ratios=ratios, layout=plan.layout),
    lr_state,
  )
