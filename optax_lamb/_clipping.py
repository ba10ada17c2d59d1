"""Global-norm gradient clipping with the norm accumulated in float32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _checks, _math


def global_sq_norm(tree: Any, axis_name: Any = None) -> jax.Array:
  """Sum of squares over every leaf in float32; psum'd over `axis_name` (sharded leaves)."""
  total = sum((_math.sq_norm(x) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))
  return _math.psum_if(total, axis_name)


def clip_by_global_norm(max_norm: float, *, axis_name: Any = None) -> optax.GradientTransformation:
  """Scale the updates so their global norm is at most ``max_norm``.

  Like :func:`optax.clip_by_global_norm`, but the norm is accumulated in float32
  (no overflow for float16 gradients), and with ``axis_name`` the sum of squares
  is ``psum``'d over that named axis, for leaves sharded inside ``shard_map``.
  Clip after the gradients have been all-reduced.

  Args:
    max_norm: the largest global norm allowed, > 0.
    axis_name: name (or tuple of names) of the mapped axes the leaves are sharded over.

  Returns:
    An :class:`optax.GradientTransformation` with :class:`optax.EmptyState`.
  """
  _checks.check_positive("max_grad_norm", max_norm)

  def update_fn(updates, state, params=None):
    del params
    factor = _math.clip_factor(global_sq_norm(updates, axis_name), max_norm)
    updates = jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates)
    return updates, state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
