"""Between the passes: each ratio slot's squared norms from pass 1's per-chunk partial sums.

One launch for the whole tree, one program per ratio slot (a leaf, or a stacked
slice of one), adding up the slot's partials in a fixed order: deterministic,
no atomics. The trust ratios then come from `_leaf.trust_ratios` in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from optax_lamb.backends.pallas import common
from optax_lamb.backends.pallas.common import BlockSizes, Table


def slot_ranges(tables: list[Table], slot_count: int) -> tuple[list[int], list[int]]:
  """(start, count) of each ratio slot's partial sums in the launches' concatenated partials.

  Slots of leaves in no table (not adapted, or empty) get count 0.
  """
  starts, counts, base = [0] * slot_count, [0] * slot_count, 0
  for table in tables:
    for c in table:
      for s in range(c.leaf.slices):
        starts[c.leaf.ratio_offset + s] = base + c.first + s * c.chunks
        counts[c.leaf.ratio_offset + s] = c.chunks
    base += common.programs(table)
  return starts, counts


def kernel(starts_ref, counts_ref, p_part_ref, u_part_ref, p_sq_ref, u_sq_ref, *, size: int):
  """Slot i: the sums of its `counts[i]` partials from `starts[i]`, `size` at a time."""
  slot = pl.program_id(0)
  start, count = starts_ref[slot], counts_ref[slot]
  lanes = jnp.arange(size, dtype=jnp.int32)

  def add(i, acc):
    offset = i * size
    mask = offset + lanes < count
    return (
      acc[0] + common.load(p_part_ref, start + offset, mask, size),
      acc[1] + common.load(u_part_ref, start + offset, mask, size),
    )

  zeros = jnp.zeros((size,), jnp.float32)
  acc_p, acc_u = jax.lax.fori_loop(0, (count + size - 1) // size, add, (zeros, zeros))
  p_sq_ref[...] = jnp.sum(acc_p)
  u_sq_ref[...] = jnp.sum(acc_u)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def slice_sums(starts, counts, p_part, u_part, *, block_sizes: BlockSizes, interpret: bool):
  """(||p||^2, ||u||^2) per ratio slot from the concatenated partial sums of pass 1."""
  out = common.out_struct(starts.shape, jnp.float32, p_part)
  return common.call(
    functools.partial(kernel, size=block_sizes.sum_block),
    (starts, counts, p_part, u_part),
    block_sizes=block_sizes,
    interpret=interpret,
    grid=(starts.shape[0],),
    in_specs=[common.whole(x) for x in (starts, counts, p_part, u_part)],
    out_specs=[common.one_per_program()] * 2,
    out_shape=[out, out],
    name="lamb_slice_sums",
  )


def slot_operands(starts: list[int], counts: list[int]) -> tuple[jax.Array, jax.Array]:
  """The kernel's (starts, counts) operands: constants of the step."""
  return jnp.asarray(np.asarray(starts, np.int32)), jnp.asarray(np.asarray(counts, np.int32))


def reference(starts, counts, p_part, u_part):
  """(||p||^2, ||u||^2) per slot, from the partial sums."""
  sums = lambda part: jnp.stack(
    [jnp.sum(part[a : a + n]) for a, n in zip(starts, counts, strict=True)]
  )
  return sums(p_part), sums(u_part)
