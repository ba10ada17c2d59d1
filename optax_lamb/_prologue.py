"""What every lamb update does first: check the trees, divide by the loss scale, cast to float32.

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

from optax_lamb import _check_state, _check_trees, _loss_scale, _norms, _tree


def with_prologue(
  inner: optax.GradientTransformationExtraArgs,
  *,
  who: str,
  grad_scale: Any = None,
  fused_apply: Callable | None = None,
) -> optax.GradientTransformationExtraArgs:
  """`inner` behind the prologue; its state gains the loss-scale count for a scale schedule.

  Args:
    inner: the transformation that receives checked, unscaled float32 gradients.
    who: the name errors give for the optimizer.
    grad_scale: the loss scale fixed at build time (see :func:`optax_lamb.unscale_gradients`);
      a scale passed to ``update(..., grad_scale=s)`` is divided out too.
    fused_apply: ``fn(grads, state, params) -> (new_params, new_state)`` computing
      ``inner.update`` + ``optax.apply_updates``; carried when no loss scale is set.
  """
  unscaling = _loss_scale.unscale_gradients(grad_scale)
  scheduled = callable(grad_scale)

  def init_fn(params):
    if not _tree.is_params_placeholder(params):
      _check_trees.check_params(params, who)
    inner_state = inner.init(params)
    return (unscaling.init(params), inner_state) if scheduled else inner_state

  def prologue(grads, state, params):
    """(float32 grads, state, params) after the checks of the trees and of the state.

    Python numbers among the leaves become arrays here, as ``jax.jit`` makes them,
    so an eager call computes what a jitted one does.
    """
    _check_trees.check_update_args(grads, params, who)
    # The state must be what init gives for these params: checked on shapes, at trace time.
    state = _check_state.check_state(state, jax.eval_shape(init_fn, params), who)
    params = jax.tree.map(jnp.asarray, params)
    return _norms.to_compute_dtype(jax.tree.map(jnp.asarray, grads)), state, params

  def update_fn(updates, state, params=None, **extra_args):
    grads, state, params = prologue(updates, state, params)
    scale_state, inner_state = state if scheduled else (optax.EmptyState(), state)
    given = extra_args.pop("grad_scale", None)
    grads, scale_state = unscaling.update(grads, scale_state, grad_scale=given)
    updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    return updates, ((scale_state, inner_state) if scheduled else inner_state)

  if fused_apply is not None and grad_scale is None:

    def fused(grads, state, params):
      grads, state, params = prologue(grads, state, params)
      return fused_apply(grads, state, params)

    update_fn.fused_apply = fused
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
