"""Pass 1 in Triton: the new moments and the per-chunk partial sums of ||p||^2 and ||u||^2.

One program per chunk of an adapted leaf, a bucket of leaves per launch, each
computing `optax_lamb.backends.gpu.passes.pass1_chunk` on its chunk (8-bit
moments' codes and scales read and dequantized in registers, `operands`); its
jnp twin is `passes.pass1_reference`. `slice_sums` adds the partials up per
leaf or stacked slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from optax_lamb.backends.gpu import arrays, passes, tables
from optax_lamb.backends.gpu.passes import PASS1_INPUTS
from optax_lamb.backends.gpu.tables import Table
from optax_lamb.backends.pallas_triton import common, operands
from optax_lamb.backends.pallas_triton.common import BlockSizes
from optax_lamb.core import _ratios
from optax_lamb.core._options import LambOptions


def kernel(
  scalars_ref, *refs, table: Table, block: int, options: LambOptions, scalar_layout, in_def, out_def
) -> None:
  """m', v' (in place where stored unrounded) and the chunk's partial sums of ||p||^2, ||u||^2
  at every `_ratios.SCALES` (six numbers: p's three, then u's)."""
  ins = jax.tree.unflatten(in_def, refs[: in_def.num_leaves])
  moments_out, part_refs = jax.tree.unflatten(out_def, refs[in_def.num_leaves :])
  s = tables.load_scalars(scalars_ref, scalar_layout)

  def body(pid, j, c) -> None:
    ch = common.chunk(pid, c, block)
    x = {name: operands.load(ref, ch, block) for name, ref in ins[j].items()}
    stores, sums = passes.pass1_chunk(options, s, c.leaf, x, ch.mask)
    # Every input of this chunk is read above, before its alias is written.
    for name, value in stores.items():
      operands.store(moments_out[j][name], ch, block, value)
    for ref, value in zip(part_refs, sums, strict=True):
      ref[...] = value

  common.for_each_leaf(table, body)


@functools.partial(
  jax.jit, static_argnames=("table", "options", "scalar_layout", "block_sizes", "interpret")
)
def moments_and_norms(
  scalars, leaves, *, table, options, scalar_layout, block_sizes: BlockSizes, interpret
) -> tuple[list[dict], jax.Array]:
  """Pass 1 over one bucket. `leaves`: per leaf of `table`, ``{g, m, p, v}`` flat arrays.

  Returns (per leaf ``{m, v}`` for the leaves whose moments it writes, else ``{}``;
  the partial sums, ``[6, program]``: p's at each `_ratios.SCALES`, then u's).
  """
  for j, x in enumerate(leaves):
    for name in PASS1_INPUTS:
      if arrays.shape(x[name]) != x["p"].shape or x["p"].ndim != 1:
        raise ValueError(
          f"leaf {j}: {name}.shape={arrays.shape(x[name])} must equal p.shape={x['p'].shape} (1-D)"
        )
  like = leaves[0]["p"]
  partial = arrays.out_struct((tables.programs(table),), jnp.float32, like)
  moments_out = [
    {name: arrays.out_struct(x[name].shape, x[name].dtype, x[name]) for name in "mv"}
    if passes.writes_moments(c.leaf)
    else {}
    for c, x in zip(table, leaves, strict=True)
  ]
  parts = (partial,) * (2 * len(_ratios.SCALES))
  written, sums = common.launch(
    kernel,
    (scalars,),
    [{n: x[n] for n in PASS1_INPUTS} for x in leaves],
    (moments_out, parts),
    out_specs=(jax.tree.map(common.whole, moments_out), (common.one_per_program(),) * len(parts)),
    # m', v' (output paths (0, j, name)) overwrite m, v (input paths (j, name))
    overwrites=lambda path: path[1:] if path[0].idx == 0 else None,
    table=table,
    options=options,
    scalar_layout=scalar_layout,
    block_sizes=block_sizes,
    interpret=interpret,
    name="lamb_moments_and_norms",
  )
  return written, jnp.stack(sums)  # one array: the driver joins the launches in one go
