"""The fused XLA backend: two passes over memory per leaf instead of a chain of stages (which
XLA would give several param-sized intermediates, reading each leaf many times). Per leaf:

* pass 1 (reads g, m, v, p; writes m, v in place) updates the moments and yields the two
  squared norms ||p||^2 and ||u||^2 from one reduction;
* the ratios, from the two squared-norm vectors (`_ratios.ratio_vector`; where a plain sum
  over- or underflowed, from its scaled sums: on the CPU only then, under ``lax.cond``, whose
  operands are kept few (XLA:CPU spends about 1 us a call on each); on other platforms from the
  sums at both rescue scales, summed in pass 1's reduction: no conditional, whose predicate
  XLA:GPU would read on the host, `_ratios.per_platform`);
* pass 2 (reads p, m, v; writes p or the updates in place) recomputes u from the new moments
  (bit-identical to pass 1's) and applies ratio and learning rate.

An `optimization_barrier` between the passes keeps u a recomputation, not a stored copy. Moments
stored narrower than computed: pass 2 recomputes them from the old ones (u never sees their
rounding; a float32 v beside a narrow m is written in pass 1, `nu_as_computed`). The smallest
leaves, `materialize_u_max_size` elements in all, keep u; on one device their sums come from
zero-padded rows (`slice_rows`: on XLA:CPU every reduction costs about 2 us a call). Every
formula is `_leaf`'s, every norm `_ratios`'.

Each leaf's passes are jitted functions of its arrays and the step's runtime scalars, their
static facts (options, the leaf's shape and switches, the constant scalars) the cache key
(`traced_once`): BERT-base's 199 leaves trace about a dozen times, not 199 (jax's trace and
lowering were most of the step's compile time over optax.lamb's: benchmarks/NOTES.md, "Trace
time"). XLA inlines the calls before it fuses: the program it compiles is the same.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_lamb.backends import fields
from optax_lamb.backends.xla import _chunked_sums, _sums
from optax_lamb.core import _leaf, _moment_storage, _ratios
from optax_lamb.core._options import LambOptions, ScalarLayout, StepScalars
from optax_lamb.step._plan import LeafArrays, LeafPlan, StepPlan, StepResult


@dataclasses.dataclass(frozen=True)
class XlaBackend(fields.Checked):
  """The fused XLA path; runs everywhere, and XLA differentiates and partitions it.

  Attributes:
    materialize_u_max_size: the smallest leaves, up to this many elements in all (4K: 16
      KiB of float32), keep u in memory between the norm and the update; the others recompute it.
    joint_small_sums: kept-u leaves' sums from zero-padded rows (a reduction per width),
      other small leaves' in one reduction each. None: `_ratios.one_device()`.
    chunked_sums: 8-bit leaves' norms by a loop over chunks of this many elements, or 0:
      not (`optax_lamb.backends.xla._chunked_sums`). None: 2^16 on the CPU backend with joint sums.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> from optax_lamb.backends.xla import XlaBackend
    >>> tx = optax_lamb.lamb(1e-3, implementation=XlaBackend(materialize_u_max_size=0))
    >>> params = {"w": jnp.ones((3, 3))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> print([round(x, 4) for x in optax.apply_updates(params, updates)["w"][0].tolist()])
    [0.999, 0.999, 0.999]
  """

  name = "xla"
  differentiable = True  # plain jnp: jax differentiates it
  materialize_u_max_size: int = 1 << 12
  joint_small_sums: bool | None = None
  chunked_sums: int | None = None

  def auto_reason(self) -> str | None:
    return None

  def unsupported_reason(self, plan: StepPlan, leaves: list[LeafArrays]) -> str | None:
    return None

  def runs_interpreted(self) -> bool:
    return False

  def step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult:
    """One lamb step in two passes per adapted leaf (one pass for the others)."""
    joint = _ratios.one_device() if self.joint_small_sums is None else self.joint_small_sums
    rows_on = joint and all(name is None for name in plan.leaf_names)  # psums per leaf
    kept = _sums.smallest_within(plan.leaves, self.materialize_u_max_size, rows_on)
    auto_chunks = _chunked_sums.CHUNK_ELEMENTS if joint and _ratios.column_blocks("cpu") else 0
    chunks = auto_chunks if self.chunked_sums is None else self.chunked_sums
    o, s = plan.options, plan.scalars
    firsts = [
      _pass1(o, s, leaf, x, keep_u=leaf.index in kept, in_rows=rows_on, joint=joint, chunks=chunks)
      for leaf, x in zip(plan.leaves, leaves, strict=True)
    ]
    # Where pass 1 wrote v over the old one (`nu_as_computed`), what follows reads the new v.
    new_v = [leaf.nu_as_computed for leaf in plan.leaves]
    leaves = [x._replace(v=f.v) if n else x for x, f, n in zip(leaves, firsts, new_v, strict=True)]
    small = {i: (f.p, f.u) for i, f in enumerate(firsts) if f.p_sq is None}
    rows = _sums.slice_rows(small, {i: plan.leaves[i].stacked_axes for i in small})
    ratios, pieces = _ratios_of(plan, leaves, firsts, rows, joint, chunks)
    seconds = [
      _pass2(o, s, leaf, x, f, ratio, apply=apply)
      for leaf, x, f, ratio in zip(plan.leaves, leaves, firsts, pieces, strict=True)
    ]
    seconds = _moments_after_params(plan, seconds)
    out, mu, nu = ([second[i] for second in seconds] for i in range(3))
    return StepResult(out, mu, nu, ratios)


# A leaf's pass: (options, scalars, leaf, *arrays, **static switches) -> arrays.
LeafPass = Callable[..., Any]


def traced_once(fn: LeafPass) -> LeafPass:
  """`fn` as one jitted function whose trace leaves alike share: same options, constant
  scalars, static switches and leaf facts but for the leaf's position (index, ratio offset),
  same array shapes and dtypes. Runtime scalars and arrays are its operands."""

  @functools.partial(jax.jit, static_argnames=("options", "layout", "leaf", "static", "knobs"))
  def run(runtime, arrays, *, options, layout, leaf, static, knobs) -> Any:
    return fn(options, layout.join(runtime), leaf, *arrays, **dict(static))

  @functools.wraps(fn)
  def call(o: LambOptions, s: StepScalars, leaf: LeafPlan, *arrays: Any, **static: Any) -> Any:
    layout, runtime = ScalarLayout.of(s)
    anywhere = leaf._replace(index=0, ratio_offset=0)  # the position does not enter the pass
    statics = tuple(sorted(static.items()))
    # What the passes read besides their arguments (tests set the first two): part of the key.
    knobs = (
      _ratios.NORM_BLOCKS,
      _ratios.PLATFORM_BRANCH,
      jax.default_backend(),
      jax.device_count(),
    )
    return run(
      runtime, arrays, options=o, layout=layout, leaf=anywhere, static=statics, knobs=knobs
    )

  return call


class _Pass1(NamedTuple):
  m: jax.Array  # the new moments as stored
  v: jax.Array
  m_c: jax.Array  # and in the compute dtype
  v_c: jax.Array
  p_sq: jax.Array | None  # squared norms per slice (zeros where the leaf does not adapt; None
  u_sq: jax.Array | None  # where u is kept: the sums come from the rows)
  u: jax.Array | None  # kept for the update (small leaves), else recomputed in pass 2
  kept: jax.Array | None  # caution's kept fraction per slice (None without caution)
  p: jax.Array | None = None  # the params the norm is of, where u is kept (the sums come later)
  # (p's, u's) at `_ratios.DOWN`, then at `UP`, off the CPU; from the chunks' loop, rescued (both)
  scaled: tuple[jax.Array, ...] | None = None


def _direction(
  o: LambOptions, s: StepScalars, leaf: LeafPlan, x: LeafArrays, m, v, p, kept
) -> jax.Array:
  """u from the moments (`_leaf.direction`); with caution, masked by the moments' gradient."""
  g = _leaf.moment_gradient(x.g, x.p, o, s, decay=leaf.decay) if o.caution else None
  return _leaf.direction(m, v, p, o, s, decay=leaf.decay, dtype=x.g.dtype, g=g, kept=kept)


@traced_once
def _pass1(
  o: LambOptions,
  s: StepScalars,
  leaf: LeafPlan,
  x: LeafArrays,
  *,
  keep_u: bool,
  in_rows: bool,
  joint: bool,
  chunks: int,
) -> _Pass1:
  """Pass 1 of one leaf; a kept u's sums are left to the rows (None) when `in_rows`. On the CPU
  the plain sums (`_in_chunks`: from a loop over `chunks` elements, its rescued sums in `scaled`);
  on other platforms the sums at `_ratios.SCALES` in the same reduction (no loop)."""
  m_c, v_c = _leaf.moments(x.g, x.m, x.v, o, s, p=x.p, decay=leaf.decay)
  m, v = _leaf.stored_moments(m_c, v_c, x.m, x.v, x.p, o, s, decay=leaf.decay)
  if not leaf.narrow_moments:  # u from the moments as stored (kept where skipped): the old ones
    m_c, v_c = m, v  # are then read once, where they are overwritten (no copy)
  elif leaf.nu_as_computed:  # so is v (written here); pass 2 recomputes only m
    v_c = v
  k = leaf.stacked_axes
  kept = None
  if o.caution:  # a reduction over the leaf before u: the kernels do not compute it
    g = _leaf.moment_gradient(x.g, x.p, o, s, decay=leaf.decay)
    u = _leaf.adam_direction(m_c, v_c, s)
    kept = _ratios.caution_fraction(u, g, k, leaf.axis_name, joint)
    # u again after the barrier: kept between the two reductions, it would be param-sized.
    m_c, v_c, x, kept = jax.lax.optimization_barrier((m_c, v_c, x, kept))
  if not leaf.adapt:
    zeros = jnp.zeros(leaf.shape[:k], jnp.float32)
    return _Pass1(m, v, m_c, v_c, zeros, zeros, None, kept, scaled=(zeros,) * 4)
  u = _direction(o, s, leaf, x, m_c, v_c, x.p, kept)  # the loop's program leaves it unused
  p = _leaf.ratio_params(x.p, o, s, decay=leaf.decay)
  if keep_u and in_rows:  # small leaf: computing u once and keeping it beats computing it twice
    return _Pass1(m, v, m_c, v_c, None, None, u, kept, p)
  partials = 1 if keep_u else _ratios.PARTIALS  # u in memory: a plain reduction per sum
  blocks: dict[str, Any] = {"stacked_axes": k, "partial_count": partials, "joint": joint}

  def on_cpu() -> tuple:
    if _in_chunks(o, leaf, x, chunks, keep_u):  # and the rescued sums, in both places
      p_sq, u_sq, *rescued = _chunked_sums.norm_sums(
        x, o, s, decay=leaf.decay, stacked_axes=k, chunk_elements=chunks
      )
      return p_sq, u_sq, *rescued, *rescued
    sums = _ratios.leaf_sq_sums(p, u, columns=_ratios.column_blocks("cpu"), **blocks)
    return (*sums, *(jnp.zeros_like(a) for a in sums), *(jnp.zeros_like(a) for a in sums))

  def on_accelerator() -> tuple:
    p1, p_down, p_up, u1, u_down, u_up = _ratios.leaf_sq_sums(
      p, u, scales=_ratios.opaque_scales(), columns=_ratios.column_blocks("cuda"), **blocks
    )
    return p1, u1, p_down, u_down, p_up, u_up

  p_sq, u_sq, *scaled = jax.lax.platform_dependent(**_ratios.per_platform(on_cpu, on_accelerator))
  return _Pass1(m, v, m_c, v_c, p_sq, u_sq, u if keep_u else None, kept, scaled=tuple(scaled))


def _ratios_of(
  plan: StepPlan,
  leaves: list[LeafArrays],
  firsts: list[_Pass1],
  rows: _sums.SliceRows,
  joint: bool,
  chunks: int,
) -> tuple[jax.Array, list[jax.Array]]:
  """The ratio vector and its per-leaf pieces; where a plain sum is suspect, from the sums at the
  rescue scales: on the CPU computed only then from few operands (the small leaves' rows, the
  others' new moments and params; those of leaves summed `_in_chunks` pass 1 gave), each leaf's
  ratio from its own sums (`_sums`: one kernel per leaf shape); elsewhere pass 1's sums at both
  scales (and the rows' at both), chosen per slot, the pieces sliced from the vector."""
  names, adapted, layout = plan.leaf_names, plan.adapted_slots, plan.layout
  o, s = plan.options, plan.scalars
  p_sq, u_sq = [f.p_sq for f in firsts], [f.u_sq for f in firsts]  # None: in the rows
  row_sums = _sums.rows_sq_sums(rows, layout)
  sums = _ratios.slot_sums(layout, names, [p_sq, u_sq], rows.members, row_sums)

  def on_accelerator() -> tuple:
    slots = layout.offsets[-1]
    at = lambda scale: _sums.rows_sq_sums(rows, layout, [jnp.full(slots, scale, jnp.float32)] * 2)
    _, down, up = _ratios.opaque_scales()
    row_sums = [(*d, *u) for d, u in zip(at(down), at(up), strict=True)]
    p_down, u_down, p_up, u_up = ([f.scaled and f.scaled[i] for f in firsts] for i in range(4))
    exact = _ratios.with_fixed_scale_sums(
      sums, layout, names, p_down, u_down, p_up, u_up, rows.members, row_sums
    )
    vector = _ratios.ratio_vector(exact, plan.scalars, adapted)
    return vector, layout.pieces(vector)

  def on_cpu() -> tuple:
    p_leaf, u_leaf = _sums.leaf_sums(layout, names, [p_sq, u_sq], rows.members, row_sums)
    leaf_adapted = [leaf.adapt for leaf in plan.leaves]

    def rescued() -> tuple:
      scales = [[_ratios.rescue_scale(x) for x in xs] for xs in (p_leaf, u_leaf)]
      scaled = [
        (None, None)
        if f.p_sq is None
        else f.scaled[:2]
        if _in_chunks(o, leaf, x, chunks, keep_u=f.u is not None)
        else _scaled_sums(o, s, leaf, x, f, p_scale, u_scale, joint=joint)
        for leaf, x, f, p_scale, u_scale in zip(plan.leaves, leaves, firsts, *scales, strict=True)
      ]
      slot_scales = [_ratios.rescue_scale(x) for x in sums[:2]]  # the rows' scales, by slot
      scaled_rows = _sums.rows_sq_sums(rows, layout, slot_scales)
      exact = _sums.leaf_sums(
        layout, names, [[x[0] for x in scaled], [x[1] for x in scaled]], rows.members, scaled_rows
      )
      return _sums.leaf_ratios(p_leaf, u_leaf, plan.scalars, leaf_adapted, (exact[0], exact[1]))

    plain = lambda: _sums.leaf_ratios(p_leaf, u_leaf, plan.scalars, leaf_adapted)
    pieces = jax.lax.cond(_ratios.needs_rescue(sums.param, sums.update, adapted), rescued, plain)
    return layout.join(pieces), list(pieces)

  vector, pieces = jax.lax.platform_dependent(**_ratios.per_platform(on_cpu, on_accelerator))
  return vector, list(pieces)


def _in_chunks(o: LambOptions, leaf: LeafPlan, x: LeafArrays, chunks: int, keep_u: bool) -> bool:
  """Whether pass 1 sums the leaf in `_chunked_sums`' loop over `chunks` elements (0: never):
  an adapted leaf with an 8-bit moment, u not kept in memory, no caution, rows to chunk."""
  quantized = any(isinstance(y, _moment_storage.QuantizedMoment) for y in (x.m, x.v))
  plain = quantized and leaf.adapt and not (keep_u or o.caution)
  return bool(chunks) and plain and _chunked_sums.applies(leaf.shape, leaf.stacked_axes)


@traced_once
def _scaled_sums(
  o: LambOptions,
  s: StepScalars,
  leaf: LeafPlan,
  x: LeafArrays,
  first: _Pass1,
  p_scale,
  u_scale,
  *,
  joint: bool,
) -> tuple:
  """The leaf's sums of (p s_p)^2 and (u s_u)^2 (`_ratios.rescue_scale`, per slice), in one pass."""
  k = leaf.stacked_axes
  if not leaf.adapt:
    return (jnp.zeros(leaf.shape[:k], jnp.float32),) * 2
  # From the branch's own operands, only those u needs (the conditional costs per operand):
  # shared with pass 1, XLA would compute them outside the branch and keep them in memory.
  if first.u is not None:  # kept in memory: read, not recomputed
    u, p = jax.lax.optimization_barrier((first.u, _leaf.ratio_params(x.p, o, s, decay=leaf.decay)))
    return _ratios.scaled_sq_sums(p, u, p_scale, u_scale, stacked_axes=k, joint=joint)
  if leaf.narrow_moments:  # from the old moments, which pass 2 overwrites later
    x, kept = jax.lax.optimization_barrier((x, first.kept))
    m_c, v_c = _leaf.moments(*x[:3], o, s, p=x.p, decay=leaf.decay, v_is_new=leaf.nu_as_computed)
  else:  # the new moments as stored are the computed ones: no copy for the branch
    g = x.g if o.caution else None
    m_c, v_c, p, g, kept = jax.lax.optimization_barrier((first.m, first.v, x.p, g, first.kept))
    x = x._replace(p=p, g=x.g if g is None else g)
  u = _direction(o, s, leaf, x, m_c, v_c, x.p, kept)
  p = _leaf.ratio_params(x.p, o, s, decay=leaf.decay)
  return _ratios.scaled_sq_sums(p, u, p_scale, u_scale, stacked_axes=k, joint=joint)


@traced_once
def _pass2(
  o: LambOptions,
  s: StepScalars,
  leaf: LeafPlan,
  x: LeafArrays,
  first: _Pass1,
  ratio,
  *,
  apply: bool,
) -> tuple[jax.Array, Any, Any]:
  """The update (or new params) of one leaf and its moments as stored, from the ratio and pass 1
  (narrow moments: `_narrow_pass2`; pass 1 only read them, u never sees their rounding)."""
  p, u = x.p, first.u
  if leaf.narrow_moments and (u is None or not leaf.adapt):
    return _narrow_pass2(o, s, leaf, x, ratio, first.kept, apply=apply)
  if not leaf.adapt:
    u = _direction(o, s, leaf, x, first.m_c, first.v_c, p, first.kept)
    return _leaf.update(u, p, None, o, s, apply=apply, decay=leaf.decay), first.m, first.v
  if u is not None:
    return _leaf.update(u, p, ratio, o, s, apply=apply, decay=leaf.decay), first.m, first.v
  # Pass 2 starts here: the barrier keeps its u a recomputation, not a stored copy.
  p, m_c, v_c, ratio = jax.lax.optimization_barrier((p, first.m, first.v, ratio))
  u = _direction(o, s, leaf, x, m_c, v_c, p, first.kept)
  return _leaf.update(u, p, ratio, o, s, apply=apply, decay=leaf.decay), first.m, first.v


def _narrow_pass2(
  o: LambOptions, s: StepScalars, leaf: LeafPlan, x: LeafArrays, ratio, kept, *, apply: bool
) -> tuple[jax.Array, Any, Any]:
  """Pass 2 of a leaf whose moments are stored narrower than computed: m, v and p (or the
  update), the moments recomputed from g and the old ones, which pass 1 only read. XLA:CPU
  writes the three in separate fusions that each read the old moments: with `apply` the
  moments' come after p's (`_moments_after_params`); the update of ``tx.update`` is written
  by the caller, so XLA copies the old moments there (docs/memory.md)."""
  # The barrier keeps u (and the moments) a recomputation here, not pass 1's stored copy.
  x = LeafArrays(*jax.lax.optimization_barrier(tuple(x)))
  new_v = leaf.nu_as_computed
  m_c, v_c = _leaf.moments(x.g, x.m, x.v, o, s, p=x.p, decay=leaf.decay, v_is_new=new_v)
  u = _direction(o, s, leaf, x, m_c, v_c, x.p, kept)
  out = _leaf.update(u, x.p, ratio if leaf.adapt else None, o, s, apply=apply, decay=leaf.decay)
  if apply and leaf.size:  # the moments after the params: `_moments_after_params`
    return out, _Later(x), None
  return (out, *_leaf.stored_moments(m_c, v_c, *x[1:], o, s, decay=leaf.decay, v_is_new=new_v))


class _Later(NamedTuple):
  """A narrow leaf whose moments `_moments_after_params` writes: its arrays past pass 2's barrier."""

  x: LeafArrays


def _moments_after_params(plan: StepPlan, seconds: list[tuple]) -> list[tuple]:
  """Pass 2's results, the moments `_narrow_pass2` left (`_Later`) computed from g - z, z a zero
  from one conditional on all their leaves' new params (`_moment_storage.zero_after`): each is
  then written over its old moments after every such leaf's params, no copy (g - 0 is g bit for
  bit, another expression: no CSE with u's moments). One conditional for the step, not one a
  leaf: XLA:CPU compiles each conditional's branches on their own, and jax traces each."""
  later = [i for i, second in enumerate(seconds) if isinstance(second[1], _Later)]
  if not later:
    return seconds
  o, s = plan.options, plan.scalars
  zero = _moment_storage.zero_after([seconds[i][0] for i in later], seconds[later[0]][1].x.g)
  seconds = list(seconds)
  for i in later:
    out, (x,), _ = seconds[i]
    seconds[i] = (out, *_moments_from_zero(o, s, plan.leaves[i], x, zero))
  return seconds


@traced_once
def _moments_from_zero(
  o: LambOptions, s: StepScalars, leaf: LeafPlan, x: LeafArrays, zero: jax.Array
) -> tuple[Any, Any]:
  """A narrow leaf's new moments as stored, from g - `zero` (`_moments_after_params`)."""
  g, new_v = x.g - zero.astype(x.g.dtype), leaf.nu_as_computed
  m_c, v_c = _leaf.moments(g, x.m, x.v, o, s, p=x.p, decay=leaf.decay, v_is_new=new_v)
  return _leaf.stored_moments(m_c, v_c, *x[1:], o, s, decay=leaf.decay, v_is_new=new_v)
