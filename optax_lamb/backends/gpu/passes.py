"""What each pass computes, once for every kernel set: per chunk inside a kernel, and as jnp twins.

* pass 1 (adapted leaves): m', v' (written in place where the moments are stored
  unrounded) and the chunk's partial sums of ||p||^2 and ||u||^2 at every
  `_ratios.SCALES` (plain, and scaled for where the plain one over- or
  underflows: extra arithmetic, no extra bytes);
* the slice sums: each ratio slot's sums of its chunks' partials;
* pass 2: the update -lr r u, or the new params p - lr r u, recomputing u from
  p and the new moments with pass 1's expressions (bit-identical values), or,
  for a leaf pass 1 did not store unrounded moments for (narrow moment dtypes,
  or no adaptation, where pass 1 skips the leaf), from g and the old moments,
  writing the new moments itself.

A kernel set loads a chunk's named operands, calls `pass1_chunk` or `leaf_step`
on them and stores what they return; the `*_reference` twins compute the same
in jnp over whole leaves (the kernels' tests compare against them, and
`pass2_reference` is the driver's XLA pass 2 for large leaves in ``tx.update``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optax_lamb.backends.gpu import arrays
from optax_lamb.backends.gpu.tables import LeafChunks
from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._options import LambOptions, StepScalars
from optax_lamb.step._plan import LeafArrays, LeafPlan

PASS1_INPUTS = ("g", "m", "p", "v")


def pass1_inputs(x: LeafArrays, flat) -> dict:
  """Pass 1's named inputs of one leaf, each through `flat`."""
  return {"g": flat(x.g), "m": flat(x.m), "p": flat(x.p), "v": flat(x.v)}


def writes_moments(leaf: LeafPlan) -> bool:
  """Whether pass 1 writes this leaf's new moments (stored unrounded)."""
  return not leaf.narrow_moments


def from_grads(leaf: LeafPlan) -> bool:
  """Whether pass 2 computes this leaf's moments from g (pass 1 did not write them)."""
  return leaf.narrow_moments or not leaf.adapt


def input_names(leaf: LeafPlan) -> tuple[str, ...]:
  return ("g", "m", "p", "v") if from_grads(leaf) else ("m", "p", "v")


def outputs_like(leaf: LeafPlan) -> dict[str, str]:
  """Pass 2's output name -> the input it has the shape and dtype of (and overwrites in place)."""
  return {"out": "p", "m": "m", "v": "v"} if from_grads(leaf) else {"out": "p"}


def block_sq_sums(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, ...]:
  """A block's sums of (x s)^2 (`_ratios.squares`) at every `_ratios.SCALES`, over its unmasked
  lanes: the kernels sum all three in the pass (memory-bound on a GPU: no extra bytes)."""
  # Masked lanes hold zero inputs, and u may be 0/0 there when eps = 0: zero them first.
  x = jnp.where(mask, x.astype(jnp.float32), 0.0)
  return tuple(jnp.sum(_ratios.squares(x, s)) for s in _ratios.SCALES)


def pass1_chunk(o: LambOptions, s: StepScalars, leaf: LeafPlan, x: dict, mask) -> tuple:
  """Pass 1 on one chunk's loaded values `x` ({g, m, p, v}): ({name: moment to store}, the six
  partial sums: p's at each `_ratios.SCALES`, then u's)."""
  m, v = _leaf.moments(x["g"], x["m"], x["v"], o, s, p=x["p"], decay=leaf.decay)
  stores = {}
  if writes_moments(leaf):
    stores = {"m": _leaf.stored(m, x["m"], s), "v": _leaf.stored(v, x["v"], s)}
  u = _leaf.direction(m, v, x["p"], o, s, decay=leaf.decay)
  p = _leaf.ratio_params(x["p"], o, s, decay=leaf.decay)
  return stores, (*block_sq_sums(p, mask), *block_sq_sums(u, mask))


def leaf_step(
  o: LambOptions,
  s: StepScalars,
  leaf: LeafPlan,
  x: dict,
  ratio,
  *,
  apply: bool,
  kernel: bool = False,
) -> dict:
  """Pass 2's outputs of one leaf (or one chunk of it), from its named inputs; 8-bit moments
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


def pass1_reference(
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


def slice_sums_reference(starts, counts, partials) -> tuple[jax.Array, ...]:
  """Per ratio slot, the sum of each row of `partials` over the slot's range (static slices: a
  fixed order of summation, no atomics)."""
  sums = lambda part: jnp.stack(
    [jnp.sum(part[a : a + n]) for a, n in zip(starts, counts, strict=True)]
  )
  return tuple(sums(part) for part in partials)


def pass2_reference(
  o: LambOptions, s: StepScalars, leaf: LeafPlan, x: dict, ratios, *, apply: bool
) -> dict:
  """Pass 2 for one leaf of any shape (flat, or as stacked), in jnp: its outputs by name.

  `x` holds the leaf's `input_names`; `ratios` is the step's whole ratio vector.
  """
  shape = jnp.shape(x["p"])
  # One row per stacked slice (a bitcast in XLA), so each row takes its slice's ratio; an 8-bit
  # moment's rows hold whole blocks.
  rows = {name: arrays.reshape(a, (leaf.slices, leaf.length)) for name, a in x.items()}
  ratio = ratios[leaf.ratio_offset : leaf.ratio_offset + leaf.slices, None]
  out = leaf_step(o, s, leaf, rows, ratio, apply=apply)
  out["out"] = out["out"].astype(x["p"].dtype)  # the moments are stored in their dtypes
  return {name: arrays.reshape(a, shape) for name, a in out.items()}
