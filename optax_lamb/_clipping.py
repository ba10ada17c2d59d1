"""Global-norm gradient clipping with the norm accumulated in float32."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_lamb import _check_args, _checks, _leaf, _ratios


def clip_by_global_norm(max_norm: float, *, axis_name: Any = None) -> optax.GradientTransformation:
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
  """
  _check_args.check_positive("max_norm", max_norm)
  _check_args.check_axis_name("axis_name", axis_name)
  return clip_stage(max_norm, axis_name)


def clip_stage(max_norm: Any, axis_name: Any, norm_eps: Any = 0.0) -> optax.GradientTransformation:
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
