"""Pass 1: the new moments and the per-chunk partial sums of ||p||^2 and ||u||^2.

One program per chunk of an adapted leaf, a bucket of leaves per launch. It
reads p, g, m, v; writes m', v' in place where the moments are stored
unrounded (else pass 2 recomputes them from g and the old moments: narrow
dtypes, and 8-bit moments, whose codes and scales it reads and dequantizes
in registers, `operands`); and
writes per chunk the partial sums of each squared norm at every
`_ratios.SCALES` (plain, and scaled for where the plain one over- or
underflows: extra arithmetic, no extra bytes), which `slice_sums` adds up per
leaf or stacked slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from optax_lamb.backends.pallas_triton import common, operands
from optax_lamb.backends.pallas_triton.common import BlockSizes, LeafChunks, Table
from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._options import LambOptions

_INPUTS = ("g", "m", "p", "v")


def _writes_moments(c: LeafChunks) -> bool:
  return not c.leaf.narrow_moments


def kernel(
  scalars_ref, *refs, table: Table, block: int, options: LambOptions, scalar_layout, in_def, out_def
) -> None:
  """m', v' (in place where stored unrounded) and the chunk's partial sums of ||p||^2, ||u||^2
  at every `_ratios.SCALES` (six numbers: p's three, then u's)."""
  ins = jax.tree.unflatten(in_def, refs[: in_def.num_leaves])
  moments_out, part_refs = jax.tree.unflatten(out_def, refs[in_def.num_leaves :])
  o, s = options, common.load_scalars(scalars_ref, scalar_layout)

  def body(pid, j, c) -> None:
    ch = common.chunk(pid, c, block)
    x = {name: operands.load(ref, ch, block) for name, ref in ins[j].items()}
    m, v = _leaf.moments(x["g"], x["m"], x["v"], o, s, p=x["p"], decay=c.leaf.decay)
    # Every input of this chunk is read above, before its alias is written.
    for name, value in (("m", m), ("v", v)):
      if name in moments_out[j]:
        operands.store(moments_out[j][name], ch, block, _leaf.stored(value, x[name], s))
    u = _leaf.direction(m, v, x["p"], o, s, decay=c.leaf.decay)
    p = _leaf.ratio_params(x["p"], o, s, decay=c.leaf.decay)
    sums = (*common.block_sq_sums(p, ch.mask), *common.block_sq_sums(u, ch.mask))
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
    for name in _INPUTS:
      if operands.shape(x[name]) != x["p"].shape or x["p"].ndim != 1:
        raise ValueError(
          f"leaf {j}: {name}.shape={operands.shape(x[name])} must equal p.shape={x['p'].shape} "
          "(1-D)"
        )
  like = leaves[0]["p"]
  partial = common.out_struct((common.programs(table),), jnp.float32, like)
  moments_out = [
    {name: common.out_struct(x[name].shape, x[name].dtype, x[name]) for name in "mv"}
    if _writes_moments(c)
    else {}
    for c, x in zip(table, leaves, strict=True)
  ]
  parts = (partial,) * (2 * len(_ratios.SCALES))
  written, sums = common.launch(
    kernel,
    (scalars,),
    [{n: x[n] for n in _INPUTS} for x in leaves],
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


def reference(
  o: LambOptions, s, x, c: LeafChunks, block: int
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
  """What pass 1 computes for one flat leaf `x` ({g, m, p, v}): (m', v', the six partials)."""
  m_new, v_new = _leaf.moments(x["g"], x["m"], x["v"], o, s, p=x["p"], decay=c.leaf.decay)
  u = _leaf.direction(m_new, v_new, x["p"], o, s, decay=c.leaf.decay)

  def partials(y) -> tuple[jax.Array, ...]:
    y = y.astype(jnp.float32).reshape(c.leaf.slices, c.leaf.length)
    y = jnp.pad(y, ((0, 0), (0, c.chunks * block - c.leaf.length)))
    return tuple(
      jnp.sum(_ratios.squares(y, scale).reshape(c.programs, block), axis=1)
      for scale in _ratios.SCALES
    )

  p = _leaf.ratio_params(x["p"], o, s, decay=c.leaf.decay)
  moments = (_leaf.stored(m_new, x["m"], s), _leaf.stored(v_new, x["v"], s))
  return moments, jnp.stack((*partials(p), *partials(u)))
