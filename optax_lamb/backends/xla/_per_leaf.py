"""Per-leaf work written so that leaves alike share one trace and one compiled kernel.

`traced_once`: a leaf's pass is a jitted function of its arrays and the step's runtime scalars,
its static facts (options, the leaf's shape and switches, the constant scalars) the cache key, so
BERT-base's 199 leaves trace about a dozen times, not 199 (jax's trace and lowering were most of
the step's compile-time excess over optax.lamb: benchmarks/NOTES.md, "Trace time"). XLA inlines
the calls before it fuses, so the program it compiles is the same.

`leaf_sums`, `leaf_ratios`: the trust ratios as one array per leaf, from each leaf's own sums:
what pass 2 multiplies by on the CPU, so that the pass-2 fusions of leaves of one shape are one
kernel to XLA:CPU.

XLA:CPU compiles each distinct fusion once (benchmarks/NOTES.md, "Compile time"). A leaf's
ratio sliced from the ratio vector puts the leaf's offset, a constant, into the fusion that
reads it: every leaf's pass 2 (and, in the rescue, every leaf's scaled sums) was a kernel of
its own, about 400 kernels on BERT-base where optax.lamb compiles about 55. Here each leaf's
ratio comes from its own sums, which reach the fusion as operands; the state's vector is their
concatenation. The values are those of `_ratios.ratio_vector` on the slot vectors, slot by slot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core import _ratios
from optax_lamb.core._options import (
  LambOptions,
  RatioLayout,
  ScalarLayout,
  StepScalars,
  replicated,
)
from optax_lamb.step._plan import LeafPlan

# A leaf's pass: (options, scalars, leaf, *arrays, **static switches) -> arrays.
LeafPass = Callable[..., Any]


def traced_once(fn: LeafPass) -> LeafPass:
  """`fn` as one jitted function whose trace leaves alike share: same options, constant
  scalars, static switches and leaf facts but for the leaf's position (index, ratio offset),
  same array shapes and dtypes. Runtime scalars and arrays are its operands."""

  @functools.partial(jax.jit, static_argnames=("options", "layout", "leaf", "static"))
  def run(runtime, arrays, *, options, layout, leaf, static):
    return fn(options, layout.join(runtime), leaf, *arrays, **dict(static))

  @functools.wraps(fn)
  def call(o: LambOptions, s: StepScalars, leaf: LeafPlan, *arrays: Any, **static: Any) -> Any:
    layout, runtime = ScalarLayout.of(s)
    anywhere = leaf._replace(index=0, ratio_offset=0)  # the position does not enter the pass
    statics = tuple(sorted(static.items()))
    return run(runtime, arrays, options=o, layout=layout, leaf=anywhere, static=statics)

  return call


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
    flat = _ratios.psum_by_name([x for sums in lists for x in sums], list(names) * len(lists))
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
