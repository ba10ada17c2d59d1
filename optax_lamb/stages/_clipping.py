"""Global-norm gradient clipping with the norm accumulated in float32."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._config import PerLeafAxisNames
from optax_lamb.core._options import Scalar
from optax_lamb.faults import _check_args, _checks


def clip_by_global_norm(
  max_norm: float, *, axis_name: PerLeafAxisNames = None
) -> optax.GradientTransformation:
  """Scale the updates so their global norm is at most ``max_norm``: the clip line of the update.

  The update is written out once, in :func:`optax_lamb.lamb`. Like
  :func:`optax.clip_by_global_norm`, but the norm is accumulated in float32 (no
  overflow for float16 gradients; gradients near 1e20 rescaled, not zeroed), and with ``axis_name`` each leaf's sum of
  squares is ``psum``'d over the mapped axes that leaf is sharded over, for
  leaves sharded inside ``shard_map``/``pmap``. Clip after the gradients have
  been all-reduced (``pmean``/``psum_scatter``).

  Args:
    max_norm: the largest global norm allowed, > 0.
    axis_name: the mapped axes the leaves are sharded over: a name, a tuple of
      names, or per leaf a pytree prefix / callable(updates) of those with
      ``None`` for replicated leaves. ``None``: no leaf is sharded.

  Returns:
    An :class:`optax.GradientTransformation` with :class:`optax.EmptyState`.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.clip_by_global_norm(1.0)
    >>> grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([0.0, 4.0])}  # global norm 5
    >>> updates, _ = tx.update(grads, tx.init(grads))
    >>> print({k: [round(x, 4) for x in v.tolist()] for k, v in updates.items()})
    {'a': [0.6, 0.0], 'b': [0.0, 0.8]}
    >>> g16 = {"a": jnp.full(4, 60000.0, jnp.float16)}  # norm 120000: inf in float16
    >>> updates, _ = tx.update(g16, tx.init(g16))
    >>> print(updates["a"].tolist(), updates["a"].dtype)
    [0.5, 0.5, 0.5, 0.5] float16
  """
  _check_args.check_positive("max_norm", max_norm)
  _check_args.check_axis_name("axis_name", axis_name)
  return clip_stage(max_norm, axis_name)


def clip_stage(
  max_norm: Scalar, axis_name: PerLeafAxisNames, norm_eps: Scalar = 0.0
) -> optax.GradientTransformation:
  """:func:`clip_by_global_norm` with checked arguments, and the variants of `_leaf.clip_factor`.

  `max_norm` = 0 zeroes the gradients (apex, timm); `norm_eps` is added to the norm (DeepSpeed).
  """

  def update_fn(updates, state, params=None) -> tuple[Any, Any]:
    del params
    names = _checks.resolve_axis_names(axis_name, updates)
    norm = _ratios.global_norm(jax.tree.leaves(updates), names)
    factor = _leaf.clip_factor(norm, max_norm, norm_eps)
    updates = jax.tree.map(lambda g: _leaf.clip(g, factor), updates)
    return updates, state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
