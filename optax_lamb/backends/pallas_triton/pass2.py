"""Pass 2: the update -lr r u, or the new params p - lr r u written over p.

One program per chunk, a bucket of leaves per launch. It recomputes u from p
and the new moments with pass 1's expressions (bit-identical values), or,
for a leaf pass 1 did not store unrounded moments for (narrow moment dtypes,
or no adaptation, where pass 1 skips the leaf), from g and the old moments,
writing the new moments itself: 8-bit ones dequantized, updated and
requantized per chunk, codes and scales written in place (`operands`) in the
same pass as the update or p. Its jnp twin, `reference`, is also the
driver's XLA pass 2 for large leaves in ``tx.update``, which XLA fuses with the
caller's ``optax.apply_updates``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from optax_lamb.backends.pallas_triton import common, operands
from optax_lamb.backends.pallas_triton.common import BlockSizes, Table
from optax_lamb.core import _leaf
from optax_lamb.core._options import LambOptions, StepScalars
from optax_lamb.step._plan import LeafPlan


def from_grads(leaf: LeafPlan) -> bool:
  """Whether pass 2 computes this leaf's moments from g (pass 1 did not write them)."""
  return leaf.narrow_moments or not leaf.adapt


def input_names(leaf: LeafPlan) -> tuple[str, ...]:
  return ("g", "m", "p", "v") if from_grads(leaf) else ("m", "p", "v")


def _outputs_like(leaf: LeafPlan) -> dict[str, str]:
  """Output name -> the input it has the shape and dtype of (and overwrites, in place)."""
  return {"out": "p", "m": "m", "v": "v"} if from_grads(leaf) else {"out": "p"}


def _leaf_step(
  o: LambOptions,
  s: StepScalars,
  leaf: LeafPlan,
  x: dict,
  ratio,
  *,
  apply: bool,
  kernel: bool = False,
) -> dict:
  """The outputs of one leaf (or one chunk of it), from its named inputs; 8-bit moments
  requantized by a plain max in a `kernel` (`_leaf.stored`: the same codes and scales)."""
  out = {}
  m, v = x["m"], x["v"]
  if from_grads(leaf):
    m, v = _leaf.moments(x["g"], m, v, o, s, p=x["p"], decay=leaf.decay)
    out["m"], out["v"] = (
      _leaf.stored(new, x[name], s, one_reduction=not kernel) for name, new in (("m", m), ("v", v))
    )
  u = _leaf.direction(m, v, x["p"], o, s, decay=leaf.decay)
  ratio = ratio if leaf.adapt else None
  out["out"] = _leaf.update(u, x["p"], ratio, o, s, apply=apply, decay=leaf.decay)
  return out


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
  s = common.load_scalars(scalars_ref, scalar_layout)

  def body(pid, j, c) -> None:
    ch = common.chunk(pid, c, block)
    x = {name: operands.load(ref, ch, block) for name, ref in ins[j].items()}
    ratio = ratios_ref[c.leaf.ratio_offset + ch.slice] if c.leaf.adapt else None
    for name, value in _leaf_step(options, s, c.leaf, x, ratio, apply=apply, kernel=True).items():
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
  """Pass 2 over one bucket. `leaves`: per leaf of `table`, its `input_names` as flat arrays.

  Returns per leaf ``{out, m, v}`` (``{out}`` where pass 1 wrote the moments):
  the updates, or the new params with `apply`.
  """
  inputs = [{n: x[n] for n in input_names(c.leaf)} for c, x in zip(table, leaves, strict=True)]
  outputs = [
    {name: operands.out_like(x[like]) for name, like in _outputs_like(c.leaf).items()}
    for c, x in zip(table, inputs, strict=True)
  ]

  def overwrites(path) -> tuple | None:
    """(j, name, *codes or scales) -> the input it overwrites; the updates only with apply."""
    j, name = path[0].idx, path[1].key
    if name == "out" and not apply:
      return None
    return (path[0], jax.tree_util.DictKey(_outputs_like(table[j].leaf)[name]), *path[2:])

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


def reference(
  o: LambOptions, s: StepScalars, leaf: LeafPlan, x: dict, ratios, *, apply: bool
) -> dict:
  """Pass 2 for one leaf of any shape (flat, or as stacked), in jnp: its outputs by name.

  `x` holds the leaf's `input_names`; `ratios` is the step's whole ratio vector.
  """
  shape = jnp.shape(x["p"])
  # One row per stacked slice (a bitcast in XLA), so each row takes its slice's ratio; an 8-bit
  # moment's rows hold whole blocks (`operands`).
  rows = {name: operands.reshape(a, (leaf.slices, leaf.length)) for name, a in x.items()}
  ratio = ratios[leaf.ratio_offset : leaf.ratio_offset + leaf.slices, None]
  out = _leaf_step(o, s, leaf, rows, ratio, apply=apply)
  out["out"] = out["out"].astype(x["p"].dtype)  # the moments are stored in their dtypes
  return {name: operands.reshape(a, shape) for name, a in out.items()}
