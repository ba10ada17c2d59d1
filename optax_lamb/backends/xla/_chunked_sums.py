"""A leaf's two squared norms (||p||^2, ||u||^2) from a loop over chunks of its rows: how the XLA
path sums a leaf with 8-bit moments on XLA:CPU (`XlaBackend.chunked_sums`).

XLA:CPU evaluates the producer of an add reduction in the reduction's own loop, unvectorised
when that producer decodes 8-bit moments (benchmarks/NOTES.md, "8-bit moments on the CPU step"):
one 4096x4096 leaf's pass 1 took 325 of the step's 500 ms. A loop over chunks of rows (the last
axis whole, so that every chunk holds whole quantization blocks) decodes each chunk into
buffers (vectorised) and sums from them: that pass took about 85 ms, BERT-base's 8-bit step
2.63 -> 1.53 s (2-core AMD EPYC). The sums are the same terms in another order. Where a plain
sum over- or underflows, the loop runs again at the rescue scale (`plain_then_rescued`), so the
CPU's rescue branch holds no second copy of the leaf's decoding (NOTES.md, 2026-12-03).

Temporaries: about 20 bytes a chunk element (the chunk's slices and decoded moments), so a
chunk is at most 1/LEAF_FRACTION of its leaf (0.6 bytes a leaf element, the columns layout's
0.5) and CHUNK_ELEMENTS: BERT-base's step 0.125x -> 0.029x the params' bytes. Not for a sharded
leaf (a slice across a sharded axis would gather it), nor with caution (u needs the leaf's kept
fraction first).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._options import LambOptions, ScalarLayout, StepScalars

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
) -> tuple[jax.Array, ...]:
  """Per slice, the sums of squares of the ratio's params and of u (`_leaf.direction` from the
  new moments), for ``x`` a leaf's arrays (gradient, stored moments, param: `LeafArrays`), each
  viewed as (stacked axes, rows, its last axis) and read ``chunk_elements`` at a time; then the
  same sums at `_ratios.rescue_scale` of them, from a second run of the loop only where a plain
  one is `_ratios.suspect` (else the plain ones): (p's, u's, p's rescued, u's rescued)."""
  k = stacked_axes
  shape = x.g.shape
  lead, rows = shape[:k], math.prod(shape[k:-1])
  x = jax.tree.map(lambda a: jnp.reshape(a, (*lead, rows, a.shape[-1])), x)
  per_row = max(1, math.prod(lead) * shape[-1])
  target = min(chunk_elements, math.prod(shape) // LEAF_FRACTION)
  chunk = max(1, min(rows, target // per_row))
  full, tail = divmod(rows, chunk)
  layout, runtime = ScalarLayout.of(s)

  def sums_at(arrays: tuple, p_scale: jax.Array, u_scale: jax.Array) -> tuple:
    x, s = arrays[0], layout.join(arrays[1])

    def sums(xs: Any) -> tuple[jax.Array, jax.Array]:
      m, v = _leaf.moments(xs.g, xs.m, xs.v, o, s, p=xs.p, decay=decay)
      u = _leaf.direction(m, v, xs.p, o, s, decay=decay, dtype=xs.g.dtype)
      p = _leaf.ratio_params(xs.p, o, s, decay=decay)
      square_sum = lambda a, scale: jnp.sum(_ratios.squares(a, scale), axis=(k, k + 1))
      return square_sum(p, p_scale), square_sum(u, u_scale)

    piece = lambda start, size: jax.tree.map(
      lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=k), x
    )
    zeros = (jnp.zeros_like(p_scale), jnp.zeros_like(u_scale))
    add_chunk = lambda i, acc: _add(acc, sums(piece(i * chunk, chunk)))
    acc = jax.lax.fori_loop(0, full, add_chunk, zeros)
    return _add(acc, sums(piece(full * chunk, tail))) if tail else acc

  # the sums' dtypes, as `_ratios.squares` gives them: p's and u's (g's) compute dtypes
  ones = tuple(jnp.ones(lead, _leaf.compute_dtype(a.dtype)) for a in (x.p, x.g))
  return plain_then_rescued(sums_at, (x, runtime), ones)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def plain_then_rescued(sums_at: Callable, arrays: tuple, ones: tuple) -> tuple[jax.Array, ...]:
  """``sums_at(arrays, 1, 1)`` (p's and u's sums), then the same at `_ratios.rescue_scale` of
  them where either is `_ratios.suspect` (else the plain ones again), from one loop whose body is
  `sums_at` at a run-time scale: XLA compiles it once. Derivatives: outside the loop (reverse
  mode cannot transpose one), at the scales it used."""
  plain, rescued, _ = _runs(sums_at, arrays, ones)
  return (*plain, *rescued)


def _runs(sums_at: Callable, arrays: tuple, ones: tuple) -> tuple:
  """(the plain sums, the last run's, that run's scales)."""
  rescue = lambda sums: tuple(_ratios.rescue_scale(q) for q in sums)
  scales = lambda run, plain: tuple(
    jnp.where(run == 0, one, scale) for one, scale in zip(ones, rescue(plain), strict=True)
  )
  suspect = lambda sums: jnp.any(jnp.logical_or(*map(_ratios.suspect, sums)))
  again = lambda c: jnp.logical_or(c[0] == 0, jnp.logical_and(c[0] == 1, suspect(c[1])))

  def body(c: tuple) -> tuple:
    run, plain, _ = c
    new = sums_at(arrays, *scales(run, plain))
    return run + 1, tuple(jnp.where(run == 0, b, a) for a, b in zip(plain, new, strict=True)), new

  zeros = tuple(jnp.zeros_like(one) for one in ones)
  runs, plain, last = jax.lax.while_loop(again, body, (jnp.int32(0), zeros, zeros))
  return plain, last, scales(runs - 1, plain)


@plain_then_rescued.defjvp
def _plain_then_rescued_jvp(sums_at: Callable, primals: tuple, tangents: tuple) -> tuple:
  arrays, ones = primals
  plain, rescued, scales = _runs(sums_at, arrays, ones)
  at = lambda scale: jax.jvp(lambda a: sums_at(a, *scale), (arrays,), (tangents[0],))[1]
  return (*plain, *rescued), (*at(ones), *at(scales))


def _add(a: tuple, b: tuple) -> tuple:
  return tuple(x + y for x, y in zip(a, b, strict=True))
