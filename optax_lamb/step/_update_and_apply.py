"""update_and_apply: one call for update + apply_updates, fused where the transformation allows."""

from __future__ import annotations

from typing import Any

import optax


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
) -> tuple[Any, Any]:
  """``tx.update`` followed by :func:`optax.apply_updates`, in one step.

  For :func:`optax_lamb.lamb` the new params are written directly by the last
  pass over memory (no updates tree is built, no separate apply pass); the
  transformation carries that fused apply as ``tx.update.fused_apply``. Any
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
  fused = getattr(tx.update, "fused_apply", None)
  if fused is not None:
    return fused(grads, opt_state, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state
