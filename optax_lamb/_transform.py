"""lamb's transformation from its configuration: the prologue every update runs, then the step.

The prologue checks the trees and the state (against ``init(params)``), divides
by the loss scale and casts to float32; the step is the chain of stages
(``implementation="reference"``, `optax_lamb._reference`) or a planned step
(`optax_lamb._plan`) on the backend the registry picks (`optax_lamb._registry`).
The same prologue runs before ``tx.update`` and before the fused apply of
:func:`optax_lamb.update_and_apply`, which the transformation carries as the
``fused_apply`` attribute of its update function (only where no wrapper sits
between the prologue and the step, so the two compute the same thing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _check_args, _checks, _interop, _leaf, _options, _plan, _reference, _registry
from optax_lamb._loss_scale import (
  UnscaleGradientsState,
  check_grad_scale,
  divides_by_grad_scale,
  given_scale,
)
from optax_lamb._mixed_precision import with_master_weights
from optax_lamb._options import LambConfig
from optax_lamb._skip import skip_nonfinite as skipping

Step = Callable[..., tuple[Any, Any]]  # (grads, state, params, *, apply) -> (out, state)


def _fused_step(config: LambConfig, implementation: _registry.Implementation) -> Step:
  def step(grads: Any, state: tuple, params: Any, *, apply: bool) -> tuple[Any, tuple]:
    plan = _plan.plan_step(config, grads, state, params)
    leaves = _plan.leaf_arrays(plan, grads, params)
    result = _registry.step(implementation, plan, leaves, apply=apply)
    return jax.tree.unflatten(plan.treedef, result.out), _plan.next_state(plan, result)

  return step


def build(
  config: LambConfig,
  *,
  implementation: _registry.Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
  grad_transform: Callable[[Any, Any], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The transformation of a checked `config`, on `implementation`, behind the wrappers asked for.

  `grad_transform(grads, params) -> grads`, if given, is applied to the unscaled
  float32 gradients before the step, on every implementation (``optax_lamb.compat``:
  Keras' per-variable ``clipnorm`` and ``clipvalue``).
  """
  _registry.check_implementation(implementation)
  config = _check_args.check_config(config)
  _check_args.check_bool("skip_nonfinite", skip_nonfinite)
  _check_args.check_bool("master_weights", master_weights)
  check_grad_scale(grad_scale)
  hyper = config.hyper._replace(
    learning_rate=_options.scalar_valued(config.hyper.learning_rate, "learning_rate"),
    weight_decay=_options.scalar_valued(config.hyper.weight_decay, "weight_decay"),
  )
  config = config._replace(hyper=hyper)
  chain = _reference.chain(config)
  if implementation == "reference":
    lamb_step: Step = lambda g, s, p, *, apply: _reference.step(chain, g, s, p, apply=apply)
  else:
    lamb_step = _fused_step(config, implementation)

  def step(grads: Any, state: Any, params: Any, *, apply: bool) -> tuple[Any, Any]:
    if grad_transform is not None:
      grads = grad_transform(grads, params)
    return lamb_step(grads, state, params, apply=apply)

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    del extra_args
    return step(updates, state, params, apply=False)

  tx = optax.GradientTransformationExtraArgs(chain.init, update_fn)
  if master_weights:
    tx = with_master_weights(tx)
  if skip_nonfinite:
    tx = skipping(tx, axis_name=config.per_leaf.axis_name)
  # update_and_apply writes the new params in the last pass; with a wrapper in between it
  # falls back to update + apply_updates.
  fused = None if master_weights or skip_nonfinite else lambda g, s, p: step(g, s, p, apply=True)
  scale = _options.scalar_valued(grad_scale, "grad_scale")
  return with_prologue(tx, who="lamb", grad_scale=scale, fused_apply=fused)


def with_prologue(
  inner: optax.GradientTransformationExtraArgs,
  *,
  who: str,
  grad_scale: optax.ScalarOrSchedule | None = None,
  fused_apply: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """`inner` behind the prologue; its state gains the loss-scale count for a scale schedule.

  Args:
    inner: the transformation that receives checked, unscaled float32 gradients.
    who: the name errors give for the optimizer.
    grad_scale: the loss scale fixed at build time (see :func:`optax_lamb.unscale_gradients`);
      a scale passed to ``update(..., grad_scale=s)`` is divided out too, unless a stage
      before this one in an enclosing ``optax.chain`` divided by it (`given_scale`).
    fused_apply: ``fn(grads, state, params) -> (new_params, new_state)`` computing
      ``inner.update`` + ``optax.apply_updates``; carried when no loss scale is set.
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
    _checks.check_state(state, jax.eval_shape(init_fn, params), who)
    params = jax.tree.map(jnp.asarray, params)
    return _leaf.to_compute_dtype(jax.tree.map(jnp.asarray, grads)), state, params

  def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    grads, state, params = prologue(updates, state, params)
    scale_state, inner_state = state if scheduled else (optax.EmptyState(), state)
    given = extra_args.pop("grad_scale", None)  # not handed on: divided out here, once
    if given is not None:
      given = given_scale(given)
    scale, scale_state = _options.grad_scale_at_step(grad_scale, given, scale_state)
    if scale is not None:
      grads = jax.tree.map(lambda g: _leaf.unscale(g, scale), grads)
    updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    return updates, ((scale_state, inner_state) if scheduled else inner_state)

  if fused_apply is not None and grad_scale is None:

    def fused(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
      grads, state, params = prologue(grads, state, params)
      return fused_apply(grads, state, params)

    update_fn.fused_apply = fused  # type: ignore[attr-defined]
  return optax.GradientTransformationExtraArgs(init_fn, divides_by_grad_scale(update_fn))
