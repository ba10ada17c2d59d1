"""A leaf's two squared norms (||p||^2, ||u||^2) from a loop over chunks of its rows: how the XLA
path sums a leaf with 8-bit moments on XLA:CPU (`XlaBackend.chunked_sums`).

XLA:CPU evaluates the producer of an add reduction in the reduction's own loop, unvectorised
when that producer decodes 8-bit moments (benchmarks/NOTES.md, "8-bit moments on the CPU step"):
one 4096x4096 leaf's pass 1 took 325 of the step's 500 ms. A loop over chunks of rows (the last
axis whole, so that every chunk holds whole quantization blocks) decodes each chunk into
buffers (vectorised) and sums from them: that pass took about 85 ms, BERT-base's 8-bit step
2.63 -> 1.53 s (2-core AMD EPYC). The sums are the same terms in another order.

Temporaries: about 20 bytes a chunk element (the chunk's slices and decoded moments), so a
chunk is at most 1/LEAF_FRACTION of its leaf (0.6 bytes a leaf element, the columns layout's
0.5) and CHUNK_ELEMENTS: BERT-base's step 0.125x -> 0.029x the params' bytes. Not for a sharded
leaf (a slice across a sharded axis would gather it), nor with caution (u needs the leaf's kept
fraction first).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._options import LambOptions, StepScalars

CHUNK_ELEMENTS = 1 << 16  # one 4096x4096 leaf, 8-bit: 2^14 to 2^18 timed alike
LEAF_FRACTION = 32  # BERT-base, 8-bit: 1/64 1.97 s (0.009x), 1/32 1.45 s (0.029x)


def applies(shape: tuple[int, ...], stacked_axes: int) -> bool:
  """Whether a leaf's slices have rows to chunk: two axes or more (the last one kept whole)."""
  return len(shape) - stacked_axes >= 2 and math.prod(shape) > 0


def norm_sums(
  x: Any,
  o: LambOptions,
  s: StepScalars,
  *,
  decay: bool,
  stacked_axes: int,
  chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[jax.Array, jax.Array]:
  """Per slice, the sums of squares of the ratio's params and of u (`_leaf.direction` from the
  new moments), for ``x`` a leaf's arrays (gradient, stored moments, param: `LeafArrays`), each
  viewed as (stacked axes, rows, its last axis) and read ``chunk_elements`` at a time."""
  k = stacked_axes
  shape = x.g.shape
  lead, rows = shape[:k], math.prod(shape[k:-1])
  x = jax.tree.map(lambda a: jnp.reshape(a, (*lead, rows, a.shape[-1])), x)
  per_row = max(1, math.prod(lead) * shape[-1])
  target = min(chunk_elements, math.prod(shape) // LEAF_FRACTION)
  chunk = max(1, min(rows, target // per_row))
  full, tail = divmod(rows, chunk)

  def sums(xs: Any) -> tuple[jax.Array, jax.Array]:
    m, v = _leaf.moments(xs.g, xs.m, xs.v, o, s, p=xs.p, decay=decay)
    u = _leaf.direction(m, v, xs.p, o, s, decay=decay, dtype=xs.g.dtype)
    p = _leaf.ratio_params(xs.p, o, s, decay=decay)
    square_sum = lambda a: jnp.sum(_ratios.squares(a), axis=(k, k + 1))
    return square_sum(p), square_sum(u)

  piece = lambda start, size: jax.tree.map(
    lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=k), x
  )
  # the sums' dtypes, as `_ratios.squares` gives them: p's and u's (g's) compute dtypes
  zeros = tuple(jnp.zeros(lead, _leaf.compute_dtype(a.dtype)) for a in (x.p, x.g))
  acc = jax.lax.fori_loop(0, full, lambda i, acc: _add(acc, sums(piece(i * chunk, chunk))), zeros)
  p_sq, u_sq = _add(acc, sums(piece(full * chunk, tail))) if tail else acc
  return p_sq, u_sq


def _add(a: tuple, b: tuple) -> tuple:
  return tuple(x + y for x, y in zip(a, b, strict=True))
