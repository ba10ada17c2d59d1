"""Pass 2 in Triton: the update -lr r u, or the new params p - lr r u written over p.

One program per chunk, a bucket of leaves per launch, each computing
`optax_lamb.backends.gpu.passes.leaf_step` on its chunk; 8-bit moments
dequantized, updated and requantized per chunk, codes and scales written in
place (`operands`) in the same pass as the update or p. Its jnp twin is
`passes.pass2_reference`.
"""

from __future__ import annotations

import functools

import jax

from optax_lamb.backends.gpu import arrays, passes, tables
from optax_lamb.backends.gpu.tables import Table
from optax_lamb.backends.pallas_triton import common, operands
from optax_lamb.backends.pallas_triton.common import BlockSizes
from optax_lamb.core._options import LambOptions


def kernel(
  scalars_ref,
  ratios_ref,
  *refs,
  table: Table,
  block: int,
  options: LambOptions,
  scalar_layout,
  apply,
  in_def,
  out_def,
) -> None:
  """Per chunk: u again, times the trust ratio and -lr; m', v' too where computed from g."""
  ins = jax.tree.unflatten(in_def, refs[: in_def.num_leaves])
  outs = jax.tree.unflatten(out_def, refs[in_def.num_leaves :])
  s = tables.load_scalars(scalars_ref, scalar_layout)

  def body(pid, j, c) -> None:
    ch = common.chunk(pid, c, block)
    x = {name: operands.load(ref, ch, block) for name, ref in ins[j].items()}
    ratio = ratios_ref[c.leaf.ratio_offset + ch.slice] if c.leaf.adapt else None
    for name, value in passes.leaf_step(
      options, s, c.leaf, x, ratio, apply=apply, kernel=True
    ).items():
      operands.store(outs[j][name], ch, block, value)

  common.for_each_leaf(table, body)


@functools.partial(
  jax.jit,
  static_argnames=("table", "options", "scalar_layout", "apply", "block_sizes", "interpret"),
)
def updates(
  scalars,
  ratios,
  leaves,
  *,
  table,
  options,
  scalar_layout,
  apply,
  block_sizes: BlockSizes,
  interpret,
) -> list[dict]:
  """Pass 2 over one bucket. `leaves`: per leaf of `table`, its `passes.input_names` as flat
  arrays.

  Returns per leaf ``{out, m, v}`` (``{out}`` where pass 1 wrote the moments):
  the updates, or the new params with `apply`.
  """
  names = lambda c: passes.input_names(c.leaf)
  inputs = [{n: x[n] for n in names(c)} for c, x in zip(table, leaves, strict=True)]
  outputs = [
    {name: arrays.out_like(x[like]) for name, like in passes.outputs_like(c.leaf).items()}
    for c, x in zip(table, inputs, strict=True)
  ]

  def overwrites(path) -> tuple | None:
    """(j, name, *codes or scales) -> the input it overwrites; the updates only with apply."""
    j, name = path[0].idx, path[1].key
    if name == "out" and not apply:
      return None
    return (path[0], jax.tree_util.DictKey(passes.outputs_like(table[j].leaf)[name]), *path[2:])

  return common.launch(
    kernel,
    (scalars, ratios),
    inputs,
    outputs,
    overwrites=overwrites,
    table=table,
    options=options,
    scalar_layout=scalar_layout,
    apply=apply,
    block_sizes=block_sizes,
    interpret=interpret,
    name="lamb_apply" if apply else "lamb_updates",
  )
