"""Squared norms in float32 (at least), and their sums over the mapped axes a leaf is sharded on.

Every norm of the package goes through here: the global clipping norm, the
trust ratio's ||p|| and ||u|| (per leaf or stacked slice), on every
implementation. A leaf sharded inside ``shard_map``/``pmap`` sees only its
shard, so its squared norm is ``psum``'d over its axis names before the
square root; one ``psum`` per distinct axis name covers all leaves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def compute_dtype(dtype) -> jnp.dtype:
  """float32, or wider when the input is wider (float64 under jax_enable_x64)."""
  return jnp.promote_types(dtype, jnp.float32)


def to_compute_dtype(tree: Any) -> Any:
  """Every leaf in float32, or wider where it already is (see `compute_dtype`)."""
  return jax.tree.map(lambda x: x.astype(compute_dtype(x.dtype)), tree)


def sq_norm(x, stacked_axes: int = 0):
  """Sum of squares in float32 (at least), over all but the first `stacked_axes` axes.

  Accumulating in float32 keeps a float16 leaf whose norm exceeds 65504 finite.
  """
  x = x.astype(compute_dtype(x.dtype))
  return jnp.sum(jnp.square(x), axis=tuple(range(stacked_axes, x.ndim)))


def sq_norms(*xs, stacked_axes: int = 0, partial_count: int = 16):
  """`sq_norm` of several same-shaped arrays, computed in one pass over memory.

  Same values as `sq_norm` of each, up to float32 summation order: each array
  is viewed as `partial_count` contiguous blocks, one reduction adds the blocks
  together element by element for every input at once (a vectorised loop that
  also evaluates the inputs' producers, e.g. the LAMB direction, once), and the
  block-sized partial sums are then added up.
  """
  shape = jnp.shape(xs[0])
  lead, size = shape[:stacked_axes], math.prod(shape[stacked_axes:])
  if size < 64 * partial_count or size % partial_count:
    return tuple(sq_norm(x, stacked_axes) for x in xs)
  squares = tuple(
    jnp.square(x.astype(compute_dtype(x.dtype))).reshape(
      lead + (partial_count, size // partial_count)
    )
    for x in xs
  )
  zeros = tuple(jnp.zeros((), s.dtype) for s in squares)
  partials = jax.lax.reduce(
    squares, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)), (len(lead),)
  )
  return tuple(jnp.sum(s, axis=-1) for s in partials)


def psum_if(x, axis_name):
  """Sum over the named mapped axes (shard_map/pmap) when `axis_name` is given."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def psum_by_name(pieces: Sequence[jax.Array], names: Sequence[Any]) -> list[jax.Array]:
  """Each piece summed over its own axis names (None: not sharded): one psum per distinct name.

  The pieces of one name are concatenated and summed together. Pieces are only
  combined with pieces of the same name, so a replicated piece stays replicated
  (``shard_map`` checks this).
  """
  out = list(pieces)
  for name in dict.fromkeys(names):
    if name is None:
      continue
    idx = [i for i, n in enumerate(names) if n == name]
    sizes = [math.prod(jnp.shape(pieces[i])) for i in idx]
    summed = jax.lax.psum(jnp.concatenate([jnp.ravel(pieces[i]) for i in idx]), name)
    for i, a, b in zip(idx, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
      out[i] = jnp.reshape(summed[a:b], jnp.shape(pieces[i]))
  return out


def psum_slots(x: jax.Array, slot_names: Sequence[Any]) -> jax.Array:
  """`psum_by_name` over the entries of one vector, each entry with its own axis names."""
  names = list(dict.fromkeys(slot_names))
  if len(names) <= 1:
    return psum_if(x, names[0] if names else None)
  groups = [np.array([i for i, n in enumerate(slot_names) if n == name]) for name in names]
  summed = psum_by_name([x[g] for g in groups], names)
  return jnp.concatenate(summed)[np.argsort(np.concatenate(groups))]


def global_sq_norm(leaves: Sequence[Any], names: Sequence[Any]) -> jax.Array:
  """Sum of squares over all `leaves`, each psum'd over its axis names (None: not sharded).

  Leaves are summed locally per axis name first, so there is one psum per name.
  """
  totals: dict[Any, jax.Array] = {}
  for x, name in zip(leaves, names, strict=True):
    totals[name] = totals.get(name, jnp.zeros((), jnp.float32)) + sq_norm(x)
  return sum((psum_if(total, name) for name, total in totals.items()), jnp.zeros((), jnp.float32))
