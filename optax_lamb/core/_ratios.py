"""The trust ratio over a tree, in one place: norm sums from a leaf's chunks, their sums over
mapped axes and stacked slices, the ratio vector and its layout (the clipping norm: `_plan`).

Squared norms are accumulated in float32 (at least). A float32 sum of squares overflows for elements
near 1e19 and underflows for elements near 1e-19; the same sum of (x s)^2 for s = 2^-80 (`DOWN`)
stays finite for every float32 x, and for s = 2^64 (`UP`) keeps every normal x's square normal.
`norm_from_sums` takes the plain sum unless it is `suspect`, then the scaled one: on the CPU
computed only then (``lax.cond``; the global norm: a loop's second run); elsewhere, as by the
Pallas kernels, all in one pass (control flow costs a GPU a host round trip: `per_platform`). A
leaf sharded in ``shard_map``/``pmap`` has its sums ``psum``'d over its axis names, one ``psum``
per name. A tree's ratios live in one vector (a slot per leaf or stacked slice): `RatioLayout`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core import _leaf, _options, _sharded_views
from optax_lamb.core._leaf import compute_dtype
from optax_lamb.core._options import AxisNames, RatioLayout, StepScalars, replicated

# Below this a float32 sum of squares may have lost terms to underflow (2^-100: about 8e-31).
SMALL_SQUARED_NORM = 2.0**-100
# (x DOWN)^2 <= 2^96 for every float32 x, so 2^31 of them sum to a finite float32; (x UP)^2 is
# normal for every normal x below 2^-50 (all of them, where the plain sum is that small).
DOWN, UP = 2.0**-80, 2.0**64
SCALES = (1.0, DOWN, UP)  # the three sums of one norm, in `norm_from_sums`'s order


def opaque_scales() -> tuple:
  """`SCALES` with DOWN and UP behind an optimization barrier: XLA (XLA:CPU, jax 0.10.2) folds
  (x s)^2 for a constant s into x^2 s^2, 0 inf where x^2 overflows (a one-element leaf)."""
  down, up = jax.lax.optimization_barrier((jnp.float32(DOWN), jnp.float32(UP)))
  return 1.0, down, up


def squares(x: jax.Array, scale: Any = 1.0) -> jax.Array:
  """(x s)^2 in the compute dtype: the term of every sum of squares of the package; `scale` a
  number or an array that broadcasts against x's leading (stacked) axes."""
  x = x.astype(compute_dtype(x.dtype))
  if isinstance(scale, float) and scale == 1.0:
    return jnp.square(x)
  return jnp.square(x * _leaf.broadcast_ratio(jnp.asarray(scale, x.dtype), x))


def sq_norm(
  x: jax.Array, stacked_axes: int = 0, joint: bool = False, scale: Any = 1.0
) -> jax.Array:
  """Sum of (x s)^2 over all but the first `stacked_axes` axes, in one plain reduction (a small
  slice with `joint`: `small_sums`)."""
  return _reduced((squares(x, scale),), stacked_axes, 1, False, joint)[0]


# A leaf's sums of squares in blocks (benchmarks/NOTES.md, "Memory"): "rows" sums each block along
# its row (PARTIALS floats of temporaries: accelerators); "columns" adds the blocks element-wise into
# one accumulator per sum (2/PARTIALS of the leaf, vectorised by XLA:CPU: rows 1.3-1.5x slower);
# "auto": columns in the program lowered for a CPU, rows in the others (`per_platform`).
NormBlocks = Literal["auto", "rows", "columns"]
NORM_BLOCKS: NormBlocks = "auto"
PARTIALS = 16
BLOCKED_FROM = 16 * 1024  # elements: a smaller leaf takes one plain sum per term
# Tests only: "cpu" or "accelerator" runs that branch of `per_platform` wherever the step runs.
PLATFORM_BRANCH: Literal["lowered", "cpu", "accelerator"] = "lowered"


def per_platform(cpu: Callable, accelerator: Callable) -> dict[str, Callable]:
  """`jax.lax.platform_dependent`'s branches (call it with ``**per_platform(...)``): `cpu` in the
  program lowered for a CPU, `accelerator` elsewhere; one trace serves both. For what XLA:CPU needs
  and an accelerator must not run: a conditional or loop, whose predicate XLA:GPU reads on the host."""
  if PLATFORM_BRANCH != "lowered":  # both keys one function: jax runs it wherever
    cpu = accelerator = cpu if PLATFORM_BRANCH == "cpu" else accelerator
  return {"cpu": cpu, "default": accelerator}


def one_device() -> bool:
  """Whether the trace has one device and no mesh: nothing to partition (`small_sums`' joint)."""
  return jax.device_count() == 1 and jax.sharding.get_abstract_mesh().empty


def column_blocks(platform: str | None = None) -> bool:
  """Whether large leaves' sums take the "columns" layout (see NORM_BLOCKS) in the program for
  `platform` ("cpu", "cuda", ...; None: the default backend's)."""
  if NORM_BLOCKS == "auto":
    return (platform or jax.default_backend()) == "cpu"
  return NORM_BLOCKS == "columns"


def _add(a: tuple, b: tuple) -> tuple:
  return tuple(x + y for x, y in zip(a, b, strict=True))


def leaf_sq_sums(
  *xs: jax.Array,
  stacked_axes: int = 0,
  scales=(1.0,),
  partial_count: int = PARTIALS,
  joint: bool = False,
  columns: bool | None = None,
) -> tuple[jax.Array, ...]:
  """Sums of (x s)^2 for each array x and each s of `scales` (array-major), in one pass.

  Each slice (all but the first `stacked_axes` axes) is viewed as about `partial_count` blocks
  (`_sharded_views.block_count`); one reduction sums each block for every sum at once (a loop
  that evaluates the inputs' producers, e.g. the LAMB direction, once), then the partial sums
  are added up. Slices too short or that no such blocks divide take one reduction for all sums;
  `partial_count` 1, no blocks. A small leaf: a plain reduction per sum, or with `joint` one for
  all (`small_sums`). The layout: `column_blocks` of the platform lowered for (`columns` None)
  or `columns`."""
  terms = tuple(squares(x, s) for x in xs for s in scales)
  blocked = partial_count > 1 and math.prod(jnp.shape(xs[0])) >= max(
    16 * partial_count, BLOCKED_FROM
  )
  if columns is not None or not blocked or column_blocks("cpu") == column_blocks("cuda"):
    by = column_blocks("cpu") if columns is None else columns
    return _reduced(terms, stacked_axes, partial_count, by, joint)
  layout = lambda by: lambda *t: _reduced(t, stacked_axes, partial_count, by, joint)
  return jax.lax.platform_dependent(*terms, **per_platform(layout(True), layout(False)))


def small_sums(terms: tuple, stacked_axes: int, joint: bool) -> tuple:
  """`_small_sums`, differentiable."""
  return _reduced(tuple(terms), stacked_axes, 1, False, joint)


def _small_sums(terms: tuple, stacked_axes: int, joint: bool) -> tuple:
  """The terms' sums without blocks. Not `joint`: one reduction per term, which XLA's
  partitioner splits over devices. `joint`: one for all (a lone term: its two halves), a loop
  over the terms' producers: XLA:CPU rewrites a lone sum over a small leaf into partial sums
  whose input it stores (the leaf's size in temporaries); the partitioner would gather it. Only
  for slices under BLOCKED_FROM elements (a long one's lone sum is left to XLA as it is)."""
  shape = jnp.shape(terms[0])
  n = math.prod(shape[stacked_axes:])
  if not joint or n >= BLOCKED_FROM:
    return tuple(jnp.sum(q, axis=tuple(range(stacked_axes, jnp.ndim(q)))) for q in terms)
  flat = tuple(jnp.reshape(q, shape[:stacked_axes] + (n,)) for q in terms)
  if len(terms) == 1 and n > 1:
    half, (q,) = n // 2, flat
    a, b = _small_sums((q[..., :half], q[..., half : 2 * half]), stacked_axes, joint)
    return (a + b + jnp.sum(q[..., 2 * half :], axis=-1),)
  zeros = tuple(jnp.zeros((), q.dtype) for q in flat)
  return tuple(jax.lax.reduce(flat, zeros, _add, (stacked_axes,)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _reduced(
  terms: tuple, stacked_axes: int, partial_count: int, columns: bool, joint: bool
) -> tuple:
  """The terms' sums in one reduction, in blocks where they fit (a lone sum's input XLA:CPU would
  store, see `small_sums`); `partial_count` 1 or a leaf under BLOCKED_FROM elements: `small_sums`.
  A large leaf sharded over a reduced axis gathers its blocks (docs/memory.md)."""
  shape = jnp.shape(terms[0])
  lead, length = shape[:stacked_axes], math.prod(shape[stacked_axes:])
  if partial_count == 1 or math.prod(shape) < max(16 * partial_count, BLOCKED_FROM):
    return _small_sums(terms, stacked_axes, joint)
  axes = tuple(range(stacked_axes, len(shape)))
  zeros = tuple(jnp.zeros((), q.dtype) for q in terms)
  big = length >= max(16 * partial_count, BLOCKED_FROM)
  blocks = _sharded_views.block_count(length, partial_count) if big else None
  view = None if blocks is None else lead + (blocks, length // blocks)
  if view is not None and _sharded_views.is_sharded(terms[0]):  # jax refuses that reshape there
    view, columns = _sharded_views.first_axis_blocks(terms[0], stacked_axes, partial_count, columns)
    if view is None:  # a plain sum each, which XLA's partitioner splits over a sharded axis
      return tuple(jnp.sum(q, axis=axes) for q in terms)
  if view is None:
    return tuple(jax.lax.reduce(terms, zeros, _add, axes))
  rows = tuple(jnp.reshape(q, view) for q in terms)
  summed = (len(lead),) if columns else tuple(range(len(lead) + 1, len(view)))
  partials = jax.lax.reduce(rows, zeros, _add, summed)
  return tuple(jnp.sum(q, axis=tuple(range(len(lead), jnp.ndim(q)))) for q in partials)


@_reduced.defjvp
def _reduced_jvp(
  stacked_axes: int, partial_count: int, columns: bool, joint: bool, primals: tuple, tangents: tuple
) -> tuple:
  """Linear: the tangents' plain sums (transposable, unlike the blocked reduction)."""
  (terms,), (dterms,) = primals, tangents
  axes = tuple(range(stacked_axes, jnp.ndim(terms[0])))
  tangent_sums = tuple(jnp.sum(dq, axis=axes) for dq in dterms)
  return _reduced(terms, stacked_axes, partial_count, columns, joint), tangent_sums


def rescue_scale(plain: jax.Array) -> jax.Array:
  """The scale of the sum replacing a `suspect` plain one: `DOWN` where it overflowed, else `UP`."""
  return jnp.where(jnp.isinf(plain), DOWN, UP).astype(plain.dtype)


def scaled_sq_sums(
  p: jax.Array,
  u: jax.Array,
  p_scale: jax.Array,
  u_scale: jax.Array,
  stacked_axes: int = 0,
  joint: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """The rare path's sums of (p s_p)^2 and (u s_u)^2 (s: `rescue_scale`, per slice), in one
  reduction, in rows (it almost never runs: no accumulators reserved beside the main ones)."""
  terms = [squares(p, p_scale), squares(u, u_scale)]
  return _reduced(tuple(terms), stacked_axes, PARTIALS, False, joint)


@jax.custom_jvp
def safe_sqrt(sq: jax.Array) -> jax.Array:
  """sqrt(sq) with a finite derivative at 0 (a plain sqrt's untaken zero-norm branch makes
  gradients through a step NaN), the guard in the derivative only: XLA compiles a lone sqrt
  per leaf, not four operations. A NaN sum stays NaN: never read as a zero norm (ratio 1)."""
  return jnp.sqrt(sq)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals: tuple, tangents: tuple) -> tuple:
  (sq,), (d_sq,) = primals, tangents
  zero = sq == 0
  slope = jnp.where(zero, 0, 0.5 / jnp.sqrt(jnp.where(zero, jnp.ones_like(sq), sq)))
  return jnp.sqrt(sq), slope * d_sq


def suspect(sq: jax.Array) -> jax.Array:
  """Where a plain float32 sum of squares may be wrong: infinite, or small (terms underflowed)."""
  return jnp.logical_or(sq < SMALL_SQUARED_NORM, jnp.isinf(sq))


def chosen_sum(plain: jax.Array, scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The sum a norm is taken from and its scale: where `plain` is `suspect`, the `scaled` sum and
  `rescue_scale(plain)`, else `plain` and 1. A scaled sum NaN alone (XLA:CPU, jax 0.10.2, folds
  (x s)^2 into x^2 s^2, 0 inf, for a one-element leaf) leaves the plain sum."""
  rescued = jnp.logical_and(suspect(plain), jnp.logical_not(jnp.isnan(scaled)))
  scale = jnp.where(rescued, rescue_scale(plain), jnp.ones_like(plain))
  return jnp.where(rescued, scaled, plain), scale


def scaled_norm(total: jax.Array, scale: jax.Array) -> jax.Array:
  """||x|| from the sum of (x scale)^2 (scale 1 divides exactly); finite derivatives."""
  return safe_sqrt(total) / scale


def norm_from_sums(plain: jax.Array, scaled: jax.Array) -> jax.Array:
  """||x|| from its plain sum of squares, or where `suspect` its sum at `rescue_scale(plain)`."""
  return scaled_norm(*chosen_sum(plain, scaled))


def needs_rescue(param_sq: jax.Array, update_sq: jax.Array, adapted: Sequence[bool]) -> jax.Array:
  """Whether an adapted slot's plain sum is `suspect`: then the step takes the scaled sums."""
  flagged = jnp.logical_or(suspect(param_sq), suspect(update_sq))
  return jnp.any(jnp.logical_and(flagged, np.asarray(adapted, bool)))


def caution_fraction(
  u, g, stacked_axes: int = 0, axis_name: AxisNames = None, joint: bool = False
) -> jax.Array:
  """max(mean([u g > 0]), 1e-3) per leaf (or stacked slice), float32: caution's rescaling, `u`
  the Adam direction, `g` the moments' gradient, counted on every shard of `axis_name`."""
  keep = _leaf.agrees(u, g).astype(jnp.float32)
  # Kept and dropped counted in one reduction (a lone sum: an XLA:CPU library that reads u).
  sums = _reduced((keep, 1 - keep), stacked_axes, PARTIALS, False, joint)
  kept, count = (_options.psum_if(x, axis_name) for x in (sums[0], sums[0] + sums[1]))
  return jnp.maximum(kept / count, _leaf.CAUTION_MIN_FRACTION)


class SlotSums(NamedTuple):
  """Per ratio slot, psum'd: ||p||^2 and ||u||^2, and maybe their sums at `rescue_scale`."""

  param: jax.Array
  update: jax.Array
  scaled: tuple[jax.Array, ...] | None = None


def _joined(
  layout: RatioLayout,
  names: Sequence[Any],
  lists: Sequence[Sequence[Any]],
  rows: Sequence,
  row_sums: Sequence[Sequence[jax.Array]],
) -> list[Any]:
  """Each list of per-leaf sums (stacked shapes) as a slot vector, each piece psum'd over its
  leaf's `names` (one psum per name: replicated leaves stay so). Without names, `rows` (per group,
  its leaves' (index, stacked shape)) and their `row_sums` (per group, per list) stand for those
  leaves' pieces (None)."""
  members = [m for group in rows for m in group]
  if not members:
    n = len(names)
    flat = _options.psum_by_name([x for sums in lists for x in sums], list(names) * len(lists))
    return [layout.join(flat[i * n : (i + 1) * n]) for i in range(len(lists))]
  # No psum: each vector is one concatenation, reordered (one gather), not a piece per leaf.
  others = [i for i in range(len(names)) if i not in {j for j, _ in members}]
  order = [i for i, _ in members] + others
  where = np.argsort(np.concatenate([np.arange(*layout.offsets[i : i + 2]) for i in order]))
  out = []
  for k, pieces in enumerate(lists):
    parts = [group[k] for group in row_sums] + [jnp.ravel(replicated(pieces[i])) for i in others]
    joined = jnp.concatenate(parts).astype(jnp.promote_types(parts[0].dtype, jnp.float32))
    out.append(joined[where])
  return out


def slot_sums(
  layout: RatioLayout, names: Sequence, sq: Sequence, rows: Sequence = (), row_sums: Sequence = ()
) -> SlotSums:
  """The slot vectors from per-leaf sums, `sq` (p's, u's; `rows`, `row_sums`: `_joined`)."""
  return SlotSums(*_joined(layout, names, sq, rows, row_sums))


def chosen_scaled(plain: jax.Array, down: jax.Array, up: jax.Array) -> jax.Array:
  """Of a sum's values at `DOWN` and `UP`, the one at `rescue_scale(plain)`."""
  return jnp.where(jnp.isinf(plain), down, up)


def with_fixed_scale_sums(sums: SlotSums, layout: RatioLayout, names: Sequence[Any],
                          p_down: Sequence, u_down: Sequence, p_up: Sequence, u_up: Sequence,
                          rows: Sequence = (), row_sums: Sequence = ()) -> SlotSums:  # fmt: skip
  """`sums` with the sums at `rescue_scale` chosen per slot (`chosen_scaled`) from each leaf's
  sums at `DOWN` and at `UP` (stacked shapes; `row_sums`: per group, its rows' four in this
  order), summed alike: what an accelerator computes beside the plain sums, no conditional."""
  joined = _joined(layout, names, [p_down, u_down, p_up, u_up], rows, row_sums)
  pd, ud, pu, uu = joined
  return sums._replace(
    scaled=(chosen_scaled(sums.param, pd, pu), chosen_scaled(sums.update, ud, uu))
  )


def ratio_vector(sums: SlotSums, s: StepScalars, adapted: Sequence[bool] | bool) -> jax.Array:
  """The trust ratio of each slot (1 where it does not adapt, or where `s.adapt_gate` is 0) from
  its sums; with `sums.scaled`, exact norms where a plain sum over- or underflowed."""
  if sums.scaled is None:
    norms = (safe_sqrt(sums.param), safe_sqrt(sums.update))
  else:
    p_scaled, u_scaled = sums.scaled
    norms = (norm_from_sums(sums.param, p_scaled), norm_from_sums(sums.update, u_scaled))
  ratio = _leaf.trust_ratio(*norms, s)
  gate = True if s.adapt_gate is None else s.adapt_gate != 0  # apex, timm: wd 0, no ratio
  return jnp.where(jnp.logical_and(np.asarray(adapted, bool), gate), ratio, jnp.ones_like(ratio))


def global_norm(leaves: Sequence[jax.Array], names: Sequence[Any]) -> jax.Array:
  """The norm of all `leaves` (each psum'd over its axis names, one psum per name), right for
  every finite input: on the CPU `norm_in_a_loop` (small leaves on one device: `small_sums`; a
  leaf's sum jitted, traced per shape), elsewhere `one_pass_global_norm` (no loop)."""
  joint = [name is None and one_device() for name in names]
  sq_of = jax.jit(sq_norm, static_argnames=("stacked_axes", "joint"))

  def total(xs: Sequence[jax.Array], scale: jax.Array) -> jax.Array:
    by_name: dict[Any, jax.Array] = {}  # the leaves of each axis name: one psum
    for x, name, j in zip(xs, names, joint, strict=True):
      s, x = jax.lax.optimization_barrier((scale, x))  # not one stored broadcast: NOTES 2026-11-28
      by_name[name] = by_name.get(name, jnp.zeros((), jnp.float32)) + sq_of(x, joint=j, scale=s)
    return sum((_options.psum_if(t, n) for n, t in by_name.items()), jnp.zeros((), jnp.float32))

  cpu = functools.partial(norm_in_a_loop, total, list(leaves))
  return jax.lax.platform_dependent(
    **per_platform(cpu, lambda: one_pass_global_norm(leaves, names))
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def norm_in_a_loop(total: Callable, xs: list) -> jax.Array:
  """sqrt(total(xs, 1)), or after that overflowed sqrt(total(xs, DOWN)) / DOWN (`total`: the sum
  of (x scale)^2 over `xs`), from `_sum_in_a_loop`: XLA:CPU compiles the sums once, not again in
  a conditional's branch (NOTES.md 2026-12-03)."""
  return scaled_norm(*_sum_in_a_loop(total, xs))


def _sum_in_a_loop(total: Callable, xs: list) -> tuple[jax.Array, jax.Array]:
  """The sum and its scale from a loop whose body is `total` at a run-time scale, run again
  only after an overflow. x 1 is x: the plain sum bit for bit."""
  scale = lambda run: jnp.where(run == 0, jnp.float32(1.0), jnp.float32(DOWN))
  again = lambda c: jnp.logical_or(c[0] == 0, jnp.logical_and(c[0] == 1, jnp.isinf(c[1])))
  body = lambda c: (c[0] + 1, total(xs, scale(c[0])))
  zero = jnp.zeros((), jnp.result_type(jnp.float32, *(compute_dtype(x.dtype) for x in xs)))
  runs, sq = jax.lax.while_loop(again, body, (jnp.int32(0), zero))
  return sq, scale(runs - 1)


@norm_in_a_loop.defjvp
def _norm_in_a_loop_jvp(total: Callable, primals: tuple, tangents: tuple) -> tuple:
  """The loop's norm; the tangent outside it (reverse mode cannot transpose one), at its scale."""
  sq, scale = _sum_in_a_loop(total, *primals)
  d_sq = jax.jvp(lambda xs: total(xs, scale), primals, tangents)[1]
  return jax.jvp(lambda t: scaled_norm(t, scale), (sq,), (d_sq,))


def one_pass_global_norm(leaves: Sequence[jax.Array], names: Sequence[Any]) -> jax.Array:
  """`global_norm` with no conditional: each leaf's sums at `SCALES` in one reduction
  (`leaf_sq_sums`: no copy of a leaf), psum'd per name, the rescued sum taken where the plain
  one is `suspect`. What an accelerator computes, and skip_spikes' norm on every platform."""
  by_name: dict[Any, jax.Array] = {}  # in the leaves' widest compute dtype, as on the CPU
  dtype = jnp.result_type(*(compute_dtype(x.dtype) for x in leaves))
  (_, *scales), zeros = opaque_scales(), jnp.zeros(3, dtype)
  sums = jax.jit(lambda x, *s: jnp.stack(leaf_sq_sums(x, scales=(1.0, *s))).astype(dtype))
  for x, name in zip(leaves, names, strict=True):
    by_name[name] = by_name.get(name, zeros) + sums(x, *scales)
  plain, down, up = sum((_options.psum_if(t, n) for n, t in by_name.items()), zeros)
  return norm_from_sums(plain, chosen_scaled(plain, down, up))
