"""The XLA path's sums and ratios beside its two passes: small leaves' sums from zero-padded
rows (`slice_rows`, `rows_sq_sums`: XLA:CPU spends about 2 us a call on every reduction), and on
the CPU each leaf's trust ratios from its own sums (`leaf_sums`, `leaf_ratios`).

XLA:CPU compiles each distinct fusion once (benchmarks/NOTES.md, "Compile time"). A leaf's
ratio sliced from the ratio vector puts the leaf's offset, a constant, into the fusion that
reads it: every leaf's pass 2 (and, in the rescue, every leaf's scaled sums) was a kernel of
its own, about 400 kernels on BERT-base where optax.lamb compiles about 55. Here each leaf's
ratio comes from its own sums, which reach the fusion as operands; the state's vector is their
concatenation. The values are those of `_ratios.ratio_vector` on the slot vectors, slot by slot.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core import _leaf, _options, _ratios
from optax_lamb.core._options import RatioLayout, StepScalars, replicated
from optax_lamb.step._plan import LeafPlan


class SliceRows(NamedTuple):
  """Small leaves' slices as zero-padded rows, one group per padded width (`slice_rows`)."""

  groups: tuple[tuple[jax.Array, ...], ...]  # per group, per input: [rows, width]
  members: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]  # (leaf, stacked shape) per group


def slice_rows(xs: dict[int, Any], stacked_axes: dict[int, int]) -> SliceRows:
  """The slices of small leaves (leaf position: its inputs) as rows in the compute dtype,
  zero-padded to a power-of-two width, one group per width: XLA:CPU spends about 2 us a call on
  every reduction, so twenty small leaves take one per width, not one per leaf and input."""
  by_width: dict[int, list[int]] = {}
  for i, arrays in xs.items():
    length = math.prod(jnp.shape(arrays[0])[stacked_axes[i] :])
    by_width.setdefault(1 << max(length - 1, 0).bit_length(), []).append(i)
  groups, members = [], []
  for width, idx in sorted(by_width.items()):
    padded = [
      [_padded_rows(xs[i][a], stacked_axes[i], width) for i in idx] for a in range(len(xs[idx[0]]))
    ]
    groups.append(tuple(jnp.concatenate(rows) for rows in padded))
    members.append(tuple((i, tuple(jnp.shape(xs[i][0])[: stacked_axes[i]])) for i in idx))
  return SliceRows(tuple(groups), tuple(members))


def _padded_rows(x: jax.Array, k: int, width: int) -> jax.Array:
  shape = (math.prod(x.shape[:k]), math.prod(x.shape[k:]))
  rows = jnp.reshape(x.astype(_leaf.compute_dtype(x.dtype)), shape)
  return jnp.pad(rows, ((0, 0), (0, width - shape[1])))


def rows_sq_sums(
  rows: SliceRows, layout: RatioLayout, slot_scales: Sequence[jax.Array] = ()
) -> tuple[tuple[jax.Array, ...], ...]:
  """Per group, per input, the sums of (x s)^2 over each row: `s` the row's slot's entry of that
  input's `slot_scales` vector, or 1."""
  out = []
  for arrays, members in zip(rows.groups, rows.members, strict=True):
    slots = np.concatenate([np.arange(*layout.offsets[i : i + 2]) for i, _ in members])
    scales: list = [x[slots] for x in slot_scales] or [1.0] * len(arrays)
    terms = tuple(_ratios.squares(a, s) for a, s in zip(arrays, scales, strict=True))
    out.append(_ratios.small_sums(terms, 1, joint=True))
  return tuple(out)


def leaf_sums(
  layout: RatioLayout,
  names: Sequence[Any],
  lists: Sequence[Sequence[Any]],
  rows: Sequence = (),
  row_sums: Sequence[Sequence[jax.Array]] = (),
) -> list[list[jax.Array]]:
  """Per list, per leaf, its entries of `_ratios._joined`'s vector, in the leaf's stacked shape
  (psum'd over its names, in the vector's dtype); a row member's from its group's sums."""
  members = {i: (g, shape) for g, group in enumerate(rows) for i, shape in group}
  if not members:
    n = len(names)
    flat = _options.psum_by_name([x for sums in lists for x in sums], list(names) * len(lists))
    per_list = [flat[k * n : (k + 1) * n] for k in range(len(lists))]
    return [_in_one_dtype([replicated(x) for x in xs]) for xs in per_list]
  starts: dict[int, int] = {}  # a member's first row in its group
  for group in rows:
    at = 0
    for i, shape in group:
      starts[i], at = at, at + int(np.prod(shape, dtype=int))
  out = []
  for k, pieces in enumerate(lists):
    dtype = jnp.promote_types(row_sums[0][k].dtype, jnp.float32)  # as `_joined` casts them
    xs = []
    for i in range(len(names)):
      if i in members:
        g, shape = members[i]
        size = int(np.prod(shape, dtype=int))
        xs.append(jnp.reshape(row_sums[g][k][starts[i] : starts[i] + size], shape))
      else:
        xs.append(replicated(pieces[i]))
    out.append([x.astype(dtype) for x in xs])
  return out


def _in_one_dtype(xs: list[jax.Array]) -> list[jax.Array]:
  """`xs` in the dtype their concatenation takes in `_ratios._joined` (float32 at least)."""
  if not xs:
    return xs
  dtype = jnp.promote_types(jnp.result_type(*xs), jnp.float32)
  return [x.astype(dtype) for x in xs]


def leaf_ratios(
  param: Sequence[jax.Array],
  update: Sequence[jax.Array],
  s: StepScalars,
  adapted: Sequence[bool],
  scaled: tuple[Sequence[jax.Array], Sequence[jax.Array]] | None = None,
) -> tuple[jax.Array, ...]:
  """Per leaf, `_ratios.ratio_vector` of its sums (and its sums at the rescue scales). Each is a
  call of one jitted function per adaptation: traced once per leaf shape, not once per leaf."""
  of = {
    adapt: jax.jit(lambda *sums, a=adapt: _ratios.ratio_vector(_slot_sums(*sums), s, a))
    for adapt in (False, True)
  }
  out = []
  for i, (p, u, adapt) in enumerate(zip(param, update, adapted, strict=True)):
    out.append(of[adapt](p, u) if scaled is None else of[adapt](p, u, scaled[0][i], scaled[1][i]))
  return tuple(out)


def _slot_sums(p: jax.Array, u: jax.Array, *scaled: jax.Array) -> _ratios.SlotSums:
  return _ratios.SlotSums(p, u, (scaled[0], scaled[1]) if scaled else None)


def smallest_within(leaves: tuple[LeafPlan, ...], total: int, rows: bool) -> set[int]:
  """The indices of the smallest leaves whose sizes (with `rows`: as `slice_rows` pads them)
  add up to at most `total`."""
  padded = lambda leaf: (
    math.prod(leaf.shape[: leaf.stacked_axes])
    << max(math.prod(leaf.shape[leaf.stacked_axes :]) - 1, 0).bit_length()
  )  # as in `slice_rows`
  sizes = {leaf.index: padded(leaf) if rows else math.prod(leaf.shape) for leaf in leaves}
  order = sorted(sizes, key=sizes.__getitem__)
  used = itertools.accumulate(sizes[i] for i in order)
  return set(order[: sum(1 for _ in itertools.takewhile(lambda n: n <= total, used))])
