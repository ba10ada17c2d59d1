"""update_and_apply: one call for update + apply_updates, fused where the transformation allows."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import optax

# update function of a transformation -> fn(grads, state, params) -> (new_params, new_state).
_FUSED_APPLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_fused_apply(update_fn: Callable, apply_fn: Callable) -> None:
  """Declare that `apply_fn(grads, state, params)` computes update + apply_updates for `update_fn`.

  The fused XLA path of lamb registers itself here; a kernel-backed
  implementation can do the same for its own update function.
  """
  _FUSED_APPLY[update_fn] = apply_fn


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
) -> tuple[Any, Any]:
  """``tx.update`` followed by :func:`optax.apply_updates`, in one step.

  For :func:`optax_lamb.lamb` the new params are written directly by the last
  pass over memory (no updates tree is built, no separate apply pass). Any
  other transformation falls back to ``tx.update`` + ``optax.apply_updates``,
  so this can be called unconditionally.

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
  """
  fused = _FUSED_APPLY.get(tx.update)
  if fused is not None:
    return fused(grads, opt_state, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state
