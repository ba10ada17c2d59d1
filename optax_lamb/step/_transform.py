"""lamb's transformation from its configuration: the prologue every update runs, then the step.

The prologue checks the trees and the state (against ``init(params)``), divides
by the loss scale (`_loss_scale.divided`) and casts to float32; the step is the planned step
(`optax_lamb.step._plan`) on the backend the registry picks (`optax_lamb.step._registry`;
``implementation="reference"``: `optax_lamb.step._reference`), with lamb's skip, spike
rule and master weights around it (`_planned_step`), the same for every backend.
The same prologue runs before ``tx.update`` and before the fused apply of
:func:`optax_lamb.update_and_apply`, which the transformation carries as a
`FusableTransformation`'s ``fused_apply`` (only where no wrapper sits
between the prologue and the step, so the two compute the same thing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _interop
from optax_lamb.core import _leaf, _options
from optax_lamb.core._config import LambConfig
from optax_lamb.faults import _check_args, _checks, _skip, _spikes
from optax_lamb.faults._loss_scale import UnscaleGradientsState, check_grad_scale, divided
from optax_lamb.memory._mixed_precision import (
  MasterWeightsState,
  advanced,
  in_master_dtype,
  master_copy,
)
from optax_lamb.step import _plan, _reference, _registry
from optax_lamb.step._update_and_apply import FusableTransformation

Step = Callable[..., tuple[Any, Any]]  # (grads, state, params, *, apply) -> (out, state)


def _planned_step(
  config: LambConfig,
  implementation: _registry.Implementation,
  skipping: bool,
  master: bool,
  spikes: _spikes.SpikeRule | None = None,
) -> Step:
  """The planned step on the registry's backend (the reference too), and lamb's own wrappers
  around it in the state they give (`SkipNonFiniteState` outside `MasterWeightsState`): the skip
  (and spike rule) decided in the plan, before the step, which then keeps every buffer where it
  is skipped; the step run on the master weights, written in place, and the params' update taken
  towards them. Each is written here once, for every implementation and compat variant.
  `gate`, a 0-d bool array or None, closes the step as a skip does, uncounted (ONNX Runtime's
  ``do_update`` input): every buffer, the skip's counters too, kept where it is false."""

  def step(grads: Any, state: Any, params: Any, *, apply: bool, value=None, gate=None) -> tuple:
    inner = state.inner_state if skipping else state
    lamb_state, on = (inner.inner_state, inner.master) if master else (inner, params)
    if master:
      grads = in_master_dtype(grads, on)
    verdict = None
    if spikes is not None:
      clip = config.hyper.max_grad_norm is not None
      verdict = _spikes.judge(spikes, state, grads, value, config.per_leaf.axis_name, None, clip)
    rule = _plan.SkipRule(state.consecutive, None, verdict) if skipping else None
    plan = _plan.plan_step(config, grads, lamb_state, on, rule)
    if gate is not None:
      take = gate if plan.scalars.take is None else jnp.logical_and(gate, plan.scalars.take)
      plan = plan._replace(scalars=plan.scalars._replace(take=take))
    result = _registry.step(
      implementation, plan, _leaf_arrays(plan, grads, on), apply=apply and not master
    )
    out, new_inner = (
      jax.tree.unflatten(plan.treedef, result.out),
      _next_state(plan, result, lamb_state),
    )
    if master:  # out is the master's update (0 where skipped), applied as with_master_weights does
      new_master, out = advanced(on, out, params)
      new_inner = MasterWeightsState(new_master, new_inner)
      out = jax.tree.map(lambda u: _leaf.kept(u, 0, plan.scalars), out)
      out = optax.apply_updates(params, out) if apply else out
    if plan.skipping is None:
      return out, new_inner
    judged = (spikes, verdict)
    take = jnp.asarray(plan.scalars.take)  # set: the plan had a SkipRule
    counted = _skip.counted_state(state, *plan.skipping, new_inner, judged, take)
    if gate is None:
      return out, counted
    counters = [f for f in counted._fields if f != "inner_state"]  # as they were, where closed
    return out, counted._replace(
      **{f: jnp.where(gate, getattr(counted, f), getattr(state, f)) for f in counters}
    )

  return step


def build(
  config: LambConfig,
  *,
  implementation: _registry.Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
  grad_transform: Callable[[Any, Any], Any] | None = None,
  skip_spikes: _spikes.SpikeRule | None = None,
  gate: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The transformation of `config` (as `_check_args.lamb_config` builds it, checked), on
  `implementation`, behind the wrappers asked for (their arguments checked here).

  `grad_transform(grads, params) -> grads`, if given, is applied to the unscaled
  float32 gradients before the step, on every implementation (``optax_lamb.compat``:
  Keras' per-variable ``clipnorm`` and ``clipvalue``). `gate`, if given, names the keyword of
  ``update`` whose 0-d bool array closes the step where false (`_planned_step`'s `gate`).
  """
  _registry.check_implementation(implementation)
  _check_args.check_bool("skip_nonfinite", skip_nonfinite)
  _check_args.check_bool("master_weights", master_weights)
  _spikes.check_rule("skip_spikes", skip_spikes)
  if skip_spikes is not None and not skip_nonfinite:
    raise ValueError(
      "skip_spikes needs skip_nonfinite=True (the spike rule is part of the skip), got "
      f"skip_nonfinite=False, skip_spikes={skip_spikes!r}"
    )
  check_grad_scale(grad_scale)
  lamb_step = _planned_step(config, implementation, skip_nonfinite, master_weights, skip_spikes)

  def step(grads: Any, state: Any, params: Any, *, apply: bool, value=None, closed=None) -> tuple:
    if grad_transform is not None:
      grads = grad_transform(grads, params)
    return lamb_step(grads, state, params, apply=apply, value=value, gate=closed)

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple:
    closed = None if gate is None else extra_args.get(gate)
    return step(updates, state, params, apply=False, value=extra_args.get("value"), closed=closed)

  init = _init(_reference.init(config), master_weights, (skip_nonfinite, skip_spikes))
  tx = optax.GradientTransformationExtraArgs(init, update_fn)
  # update_and_apply writes the new params in the last pass; the reference stays the plain
  # update + apply_updates, as the stages compose.
  fused_apply = (
    (lambda g, s, p: step(g, s, p, apply=True)) if implementation != "reference" else None
  )
  scale = _check_args.scalar_valued(grad_scale, "grad_scale")
  return with_prologue(tx, who="lamb", grad_scale=scale, fused_apply=fused_apply, gate=gate)


def _init(chain_init: Callable, master: bool, skipping: tuple) -> Callable:
  """The init of the planned step's state: the chain of stages', inside lamb's own wrappers'
  states (`skipping`: whether the step skips, and its spike rule or None)."""

  def init(params: Any) -> Any:
    if not master:
      state = chain_init(params)
    else:
      copy = master_copy(params)
      state = MasterWeightsState(copy, chain_init(copy))
    if not skipping[0]:
      return state
    return _skip.initial_state(state) if skipping[1] is None else _spikes.initial_state(state)

  return init


def with_prologue(
  inner: optax.GradientTransformationExtraArgs,
  *,
  who: str,
  grad_scale: optax.ScalarOrSchedule | None = None,
  fused_apply: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None,
  gate: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """`inner` behind the prologue; its state gains the loss-scale count for a scale schedule.

  Args:
    inner: the transformation that receives checked, unscaled float32 gradients.
    who: the name errors give for the optimizer.
    grad_scale: the loss scale fixed at build time (see :func:`optax_lamb.unscale_gradients`);
      a scale passed to ``update(..., grad_scale=s)`` is divided out too (the optimizer is
      the reader of that argument: :func:`optax_lamb.unscale_gradients` leaves it alone
      unless built with ``from_update=True``).
    fused_apply: ``fn(grads, state, params) -> (new_params, new_state)`` computing
      ``inner.update`` + ``optax.apply_updates``; carried when no loss scale is set.
    gate: the keyword of ``update`` (its value a 0-d bool array) that closes the step where
      false: the loss-scale schedule's count is then kept too.
  """
  scheduled = callable(grad_scale)

  def init_fn(params: Any) -> Any:
    if not _interop.is_params_placeholder(params):
      _checks.check_params(params, who)
    inner_state = inner.init(params)
    if not scheduled:
      return inner_state
    return UnscaleGradientsState(count=jnp.zeros([], jnp.int32)), inner_state

  def prologue(grads: Any, state: Any, params: Any) -> tuple[Any, Any, Any]:
    """(float32 grads, state, params) after the checks of the trees and of the state.

    Python numbers among the leaves become arrays here, as ``jax.jit`` makes them,
    so an eager call computes what a jitted one does.
    """
    _checks.check_update_args(grads, params, who)
    # The state must be what init gives for these params: checked on shapes, at trace time.
    expected = jax.eval_shape(init_fn, params)
    _checks.check_state(state, expected, who)
    state = _options.with_layouts_of(expected, state)
    params = jax.tree.map(jnp.asarray, params)
    return _leaf.to_compute_dtype(jax.tree.map(jnp.asarray, grads)), state, params

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    grads, state, params = prologue(updates, state, params)
    scale_state, inner_state = state if scheduled else (optax.EmptyState(), state)
    given = extra_args.pop("grad_scale", None)  # not handed on: divided out here, once
    old_scale_state = scale_state
    if grad_scale is not None or given is not None:  # no loss scale: nothing to divide
      grads, scale_state = divided(grads, grad_scale, given, scale_state)
    closed = extra_args.get(gate) if gate is not None else None
    if closed is not None:  # a closed step keeps the schedule's count too (`build`'s gate)
      keep = lambda new, old: jnp.where(closed, new, old)
      scale_state = jax.tree.map(keep, scale_state, old_scale_state)
    updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    return updates, ((scale_state, inner_state) if scheduled else inner_state)

  if fused_apply is not None and grad_scale is None:

    def fused(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
      grads, state, params = prologue(grads, state, params)
      return fused_apply(grads, state, params)

    return FusableTransformation(init_fn, update_fn, fused)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _leaf_arrays(plan: _plan.StepPlan, grads: Any, params: Any) -> list[_plan.LeafArrays]:
  """The step's arrays, one `LeafArrays` per leaf in the plan's order."""
  assert plan.parts is not None  # a planned step (a per-device plan has no state)
  adam = plan.parts.adam
  columns = [plan.treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, params)]
  return [_plan.LeafArrays(*arrays) for arrays in zip(*columns, strict=True)]


def _next_state(plan: _plan.StepPlan, result: _plan.StepResult, state: tuple) -> tuple:
  """lamb's state after the step from `state`, from the backend's new moments and ratio vector
  (which a skipped step already kept); the counts and ratios kept where it was skipped."""
  unflatten = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)
  adam = optax.ScaleByAdamState(count=plan.count, mu=unflatten(result.mu), nu=unflatten(result.nu))
  ratio_state = _options.ScaleByTrustRatioState.after_step(result.ratios, plan.layout)
  assert plan.parts is not None
  new = plan.parts._replace(adam=adam, trust_ratio=ratio_state)
  if plan.scalars.take is not None:
    old = _plan.LambStateParts(*state)
    new = new._replace(
      adam=adam._replace(count=_leaf.kept(adam.count, old.adam.count, plan.scalars)),
      **{
        part: jax.tree.map(
          lambda n, o: _leaf.kept(n, o, plan.scalars), getattr(new, part), getattr(old, part)
        )
        for part in ("decay", "trust_ratio", "learning_rate")
      },
    )
  return tuple(new)
