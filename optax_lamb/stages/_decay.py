"""Stage 2: decoupled weight decay, u <- u + wd * p (inside the trust-ratio norm)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb.core import _leaf, _options
from optax_lamb.core._config import PerLeafMask
from optax_lamb.faults import _check_args, _checks


def add_decayed_weights(
  weight_decay: optax.ScalarOrSchedule = 0.0,
  mask: PerLeafMask = None,
) -> optax.GradientTransformation:
  """Add ``weight_decay * params`` to the updates (the lambda p term of :func:`optax_lamb.lamb`'s u).

  ``weight_decay`` may be a schedule.

  Same as :func:`optax.add_decayed_weights`, plus schedules: a callable
  ``weight_decay`` is evaluated on a step count kept in an
  :class:`optax.ScaleByScheduleState` (a float keeps :class:`optax.EmptyState`).

  Args:
    weight_decay: a non-negative float, array, or schedule ``step -> float``.
    mask: pytree of bools (a prefix of the params, or a callable(params) returning
      one) selecting the leaves that decay, as in :func:`optax.masked`; ``None``
      decays every leaf, and so does a ``None`` entry of the pytree.

  Returns:
    An :class:`optax.GradientTransformation`.

  Example:
    >>> import jax, jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.add_decayed_weights(0.1, mask={"w": True, "b": False})
    >>> params = {"w": jnp.ones(2), "b": jnp.ones(2)}
    >>> zeros = jax.tree.map(jnp.zeros_like, params)
    >>> updates, _ = tx.update(zeros, tx.init(params), params)
    >>> print([round(x, 4) for x in updates["w"].tolist()], updates["b"].tolist())
    [0.1, 0.1] [0.0, 0.0]
  """
  _check_args.check_decay_args(weight_decay, mask)
  is_schedule = callable(weight_decay)
  weight_decay = _check_args.scalar_valued(weight_decay, "weight_decay")

  def init_fn(params) -> Any:
    del params
    if is_schedule:
      return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))
    return optax.EmptyState()

  def update_fn(updates, state, params=None) -> tuple[Any, Any]:
    if params is None:
      raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
    _checks.check_same_structure(updates, "updates", params, "params")
    wd, state = _options.value_and_next_state(weight_decay, state)
    updates = jax.tree.map(lambda u, p: _leaf.add_decay(u, p, wd), updates, params)
    return updates, state

  tx = optax.GradientTransformation(init_fn, update_fn)
  if mask is None:
    return tx
  # optax.masked calls this on the params (init) and the updates; it checks the mask
  # against them and names it (optax.masked's own error is a bare pytree mismatch).
  return optax.masked(tx, lambda tree: _checks.resolve_per_leaf(mask, tree, True, "mask", "bool"))
