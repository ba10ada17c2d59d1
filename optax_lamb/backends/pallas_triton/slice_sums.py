"""Between the passes: each ratio slot's sums of squares from pass 1's per-chunk partial sums.

One launch for the whole tree, one program per ratio slot (a leaf, or a stacked
slice of one), adding up the slot's partials in a fixed order: deterministic,
no atomics. Each of pass 1's partial vectors (||p||^2 and ||u||^2 at every
`_ratios.SCALES`) is summed alike; the trust ratios then come from
`_ratios.ratio_vector` in XLA. The slots' ranges are the driver's
(`optax_lamb.backends.gpu.tables.slot_ranges`); the jnp twin is
`optax_lamb.backends.gpu.passes.slice_sums_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from optax_lamb.backends.gpu import arrays
from optax_lamb.backends.pallas_triton import common
from optax_lamb.backends.pallas_triton.common import BlockSizes


def kernel(starts_ref, counts_ref, *refs, size: int) -> None:
  """Slot i: the sums of its `counts[i]` partials from `starts[i]`, `size` at a time, for each
  partial vector (the first half of `refs`) into its output (the second half)."""
  part_refs, out_refs = refs[: len(refs) // 2], refs[len(refs) // 2 :]
  slot = pl.program_id(0)
  start, count = starts_ref[slot], counts_ref[slot]
  lanes = jnp.arange(size, dtype=jnp.int32)

  def add(i, acc) -> tuple[jax.Array, ...]:
    offset = i * size
    mask = offset + lanes < count
    return tuple(
      a + common.load(ref, start + offset, mask, size)
      for a, ref in zip(acc, part_refs, strict=True)
    )

  zeros = tuple(jnp.zeros((size,), jnp.float32) for _ in part_refs)
  sums = jax.lax.fori_loop(0, (count + size - 1) // size, add, zeros)
  for ref, acc in zip(out_refs, sums, strict=True):
    ref[...] = jnp.sum(acc)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def slice_sums(
  starts, counts, partials, *, block_sizes: BlockSizes, interpret: bool
) -> tuple[jax.Array, ...]:
  """Per ratio slot, the sums of each row of `partials` (pass 1's, the launches concatenated)."""
  parts = tuple(partials)
  out = arrays.out_struct(starts.shape, jnp.float32, partials)
  return tuple(
    common.call(
      functools.partial(kernel, size=block_sizes.sum_block),
      (starts, counts, *parts),
      block_sizes=block_sizes,
      interpret=interpret,
      grid=(starts.shape[0],),
      in_specs=[common.whole(x) for x in (starts, counts, *parts)],
      out_specs=[common.one_per_program()] * len(parts),
      out_shape=[out] * len(parts),
      name="lamb_slice_sums",
    )
  )
