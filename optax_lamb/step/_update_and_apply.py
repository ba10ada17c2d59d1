"""update_and_apply: one call for update + apply_updates, fused where the transformation allows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

FusedApply = Callable[[Any, Any, Any], tuple[Any, Any]]  # (grads, state, params) -> (params, state)


class FusableTransformation(optax.GradientTransformationExtraArgs):
  """An :class:`optax.GradientTransformationExtraArgs` that can also write the new params itself:
  `fused_apply` computes ``update`` followed by ``optax.apply_updates`` in one pass, for
  `update_and_apply`. To optax it is a plain transformation (``init``, ``update``); its wrappers
  (``optax.chain``, ``MultiSteps``, ...) return plain ones, which `update_and_apply` runs
  unfused."""

  fused_apply: FusedApply

  def __new__(cls, init: Any, update: Any, fused_apply: FusedApply) -> FusableTransformation:
    tx = super().__new__(cls, init, update)
    tx.fused_apply = fused_apply
    return tx


# A pytree of its two functions, the fused apply kept as static data: a namedtuple's default rule
# would rebuild it from (init, update) alone (flax's nnx.Optimizer maps its tx as a pytree).
jax.tree_util.register_pytree_node(
  FusableTransformation,
  lambda tx: ((tx.init, tx.update), tx.fused_apply),
  lambda fused_apply, children: FusableTransformation(*children, fused_apply),
)


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
) -> tuple[Any, Any]:
  """``tx.update`` followed by :func:`optax.apply_updates`, in one step.

  For :func:`optax_lamb.lamb` the new params are written directly by the last
  pass over memory (no updates tree is built, no separate apply pass); the
  transformation is a `FusableTransformation` carrying that fused apply. Any
  other transformation (and lamb inside a wrapper such as ``optax.MultiSteps``)
  falls back to ``tx.update`` + ``optax.apply_updates``, so this can be called
  unconditionally.

  Args:
    tx: a gradient transformation.
    grads: the gradients.
    opt_state: ``tx``'s state.
    params: the current params.

  Returns:
    ``(new_params, new_opt_state)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax_lamb
    >>> params = {"w": jnp.ones((3, 3))}
    >>> tx = optax_lamb.lamb(1e-3)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> params, state = optax_lamb.update_and_apply(tx, grads, state, params)
    >>> print([round(x, 4) for x in params["w"][0].tolist()], params["w"].dtype)
    [0.999, 0.999, 0.999] float32
  """
  if isinstance(tx, FusableTransformation):
    return tx.fused_apply(grads, opt_state, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state
