"""Views of an array that jax's sharding rules accept where its type shards it (a mesh of
`Explicit` axes, under ``jax.set_mesh``): there jax refuses, at trace time, a reshape or a slice
that does not keep each device's piece whole (``ShardingTypeError``). On an `Auto` mesh and on one
device the types shard nothing (`shards` all 1) and the callers keep their plain views. And the
blocks a leaf's norm sums view it in (`block_count`), which keep a first-axis shard's blocks whole.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def shards(x: jax.Array) -> tuple[int, ...]:
  """Per axis of x, the number of pieces its type splits it into (1: whole)."""
  sharding = jax.typeof(x).sharding
  spec = tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
  return tuple(math.prod(sharding.mesh.shape[n] for n in names(e)) for e in spec)


def is_sharded(x: jax.Array) -> bool:
  return any(n > 1 for n in shards(x))


def first_axis_blocks(
  x: jax.Array, stacked_axes: int, target: int, columns: bool
) -> tuple[tuple[int, ...] | None, bool]:
  """A view of x's slices (all but the first `stacked_axes` axes) in about `target` blocks of
  their first axis (b blocks of d0 / b rows: contiguous, as a flat view's b blocks), b a multiple
  of that axis's pieces so that each device keeps whole blocks, and the layout (`columns` or
  not) whose joint reduction reduces no sharded axis: XLA's partitioner would gather its input.
  Rows where the blocks' axis is split, columns where another is; (None, _) where both are or
  no b > 1 fits (then a plain sum per term, which the partitioner splits)."""
  k, shape, split = stacked_axes, jnp.shape(x), shards(x)
  inside = any(n > 1 for n in split[k + 1 :])
  fits = [b for b in range(2, shape[k] + 1) if shape[k] % b == 0 and b % split[k] == 0]
  if not fits or (split[k] > 1 and inside):
    return None, columns
  b = min(fits, key=lambda b: (abs(b - target), -b))
  layout = False if split[k] > 1 else True if inside else columns
  return shape[:k] + (b, shape[k] // b) + shape[k + 1 :], layout


def an_element(x: jax.Array) -> jax.Array:
  """x's first element; on sharded axes, the max over them of the elements first on the others
  (a reduction over a few elements: jax refuses a slice of a sharded axis)."""
  split = shards(x)
  if all(n == 1 for n in split):
    return jnp.ravel(x)[0]
  return jnp.max(x[tuple(slice(None) if n > 1 else 0 for n in split)])


def last_axis_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """x (whole blocks of its last axis) viewed as (..., blocks, block_size). A last axis split
  inside blocks keeps its split on the blocks' elements: each device then holds a piece of every
  block (XLA moves them, an all-to-all, as its partitioner does on an `Auto` mesh)."""
  view = (*x.shape[:-1], x.shape[-1] // block_size, block_size)
  if view[-2] % shards(x)[-1] == 0:
    return x.reshape(view)
  spec = tuple(jax.typeof(x).sharding.spec)
  out = jax.sharding.PartitionSpec(*spec[:-1], None, spec[-1])
  return jax.lax.reshape(x, view, out_sharding=out)


def block_count(length: int, target: int) -> int | None:
  """A number of blocks near `target` that divides `length` into blocks of even length, or None:
  a power of two if one does (a leaf sharded on its first axis keeps whole blocks per device).
  Uneven blocks (a tail) would give the inputs' producer two consumers: XLA:CPU would store it."""
  even = lambda b: length % b == 0 and length // b % 2 == 0
  powers = [1 << k for k in range(target.bit_length() - 2, target.bit_length() + 1)]
  fits = [b for b in powers if even(b)] or [
    b for b in range(target // 2, 2 * target + 1) if even(b)
  ]
  return min(fits, key=lambda b: (abs(b - target), -b)) if fits else None
