"""The fused XLA backend: two passes over memory per leaf instead of a chain of stages.

The stage chain (clip, Adam, decay, trust ratio, learning rate) computes the
same values but XLA materialises several param-sized intermediates for it and
reads each leaf many times. Here, per leaf:

* pass 1 (reads g, m, v, p; writes m, v in place) updates the moments and
  yields the two squared norms ||p||^2 and ||u||^2 from one reduction;
* the ratios of all leaves, from the two squared-norm vectors (`_ratios.ratio_vector`; where a
  plain sum over- or underflowed, from its scaled sums, computed only then, under ``lax.cond``);
* pass 2 (reads p, m, v; writes p or the updates in place) recomputes the
  direction u from the new moments with the identical expressions, so the
  values are bit-identical to pass 1's, and applies the trust ratio and the
  learning rate.

An `optimization_barrier` between the passes stops XLA from merging the two
computations of u (which would materialise u, a param-sized temporary). When
the moments are stored in a narrower dtype than they are computed in, pass 2
recomputes them from the old moments instead, so u never sees the rounding.

The smallest leaves, up to `materialize_u_max_size` elements in all, compute u
once and keep it between the norm and the update instead (recomputing costs more
than it saves there); every kept u is alive until the ratios are known, so the
total is what bounds the step's temporaries. Leaves without layer adaptation need no norm
and take one pass. Every formula is `optax_lamb._leaf`'s, every norm `optax_lamb._ratios`'.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from optax_lamb import _leaf, _ratios
from optax_lamb._plan import LeafArrays, LeafPlan, StepPlan, StepResult


@dataclasses.dataclass(frozen=True)
class XlaBackend:
  """The fused XLA path; runs everywhere, and XLA differentiates and partitions it.

  Attributes:
    materialize_u_max_size: the smallest leaves, up to this many elements in all
      (4K: 16 KiB of float32), keep u in memory between the norm and the update;
      the others recompute it.

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

  def auto_reason(self) -> str | None:
    return None

  def unsupported_reason(self, plan: StepPlan, leaves: list[LeafArrays]) -> str | None:
    del plan, leaves
    return None

  def runs_interpreted(self) -> bool:
    return False

  def step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult:
    """One lamb step in two passes per adapted leaf (one pass for the others)."""
    kept = _smallest_within(plan.leaves, self.materialize_u_max_size)
    firsts = [
      _pass1(plan, leaf, x, leaf.index in kept) for leaf, x in zip(plan.leaves, leaves, strict=True)
    ]
    names, adapted = plan.leaf_names, plan.adapted_slots
    sums = _ratios.slot_sums(plan.layout, names, [f.p_sq for f in firsts], [f.u_sq for f in firsts])

    def rescued() -> jax.Array:  # a plain sum over- or underflowed: the scaled sums, only then
      p_scales, u_scales = (plan.layout.pieces(_ratios.rescue_scale(x)) for x in sums[:2])
      scaled = [
        _scaled_sums(plan, leaf, x, f, p_scale, u_scale)
        for leaf, x, f, p_scale, u_scale in zip(
          plan.leaves, leaves, firsts, p_scales, u_scales, strict=True
        )
      ]
      p_scaled, u_scaled = [x[0] for x in scaled], [x[1] for x in scaled]
      exact = _ratios.with_scaled_sums(sums, plan.layout, names, p_scaled, u_scaled)
      return _ratios.ratio_vector(exact, plan.scalars, adapted)

    ratios = jax.lax.cond(
      _ratios.needs_rescue(sums.param, sums.update, adapted),
      rescued,
      lambda: _ratios.ratio_vector(sums, plan.scalars, adapted),
    )
    seconds = [
      _pass2(plan, leaf, x, f, ratio, apply=apply)
      for leaf, x, f, ratio in zip(
        plan.leaves, leaves, firsts, plan.layout.pieces(ratios), strict=True
      )
    ]
    out, mu, nu = ([second[i] for second in seconds] for i in range(3))
    return StepResult(out, mu, nu, ratios)


class _Pass1(NamedTuple):
  m: jax.Array  # the new moments as stored
  v: jax.Array
  m_c: jax.Array  # and in the compute dtype
  v_c: jax.Array
  p_sq: jax.Array  # squared norms per slice (zeros where the leaf does not adapt)
  u_sq: jax.Array
  u: jax.Array | None  # kept for the update (small leaves), else recomputed in pass 2
  kept: jax.Array | None  # caution's kept fraction per slice (None without caution)


def _direction(plan: StepPlan, leaf: LeafPlan, x: LeafArrays, m, v, p, kept) -> jax.Array:
  """u from the moments (`_leaf.direction`); with caution, masked by the moments' gradient."""
  o, s = plan.options, plan.scalars
  g = _leaf.moment_gradient(x.g, x.p, o, s, decay=leaf.decay) if o.caution else None
  return _leaf.direction(m, v, p, o, s, decay=leaf.decay, dtype=x.g.dtype, g=g, kept=kept)


def _smallest_within(leaves: tuple[LeafPlan, ...], total: int) -> set[int]:
  """The indices of the smallest leaves whose sizes add up to at most `total`."""
  chosen, used = set(), 0
  for leaf in sorted(leaves, key=lambda leaf: leaf.size):
    if used + leaf.size > total:
      break
    chosen.add(leaf.index)
    used += leaf.size
  return chosen


def _pass1(plan: StepPlan, leaf: LeafPlan, x: LeafArrays, keep_u: bool) -> _Pass1:
  o, s = plan.options, plan.scalars
  m_c, v_c = _leaf.moments(x.g, x.m, x.v, o, s, p=x.p, decay=leaf.decay)
  m, v = _leaf.stored_moments(m_c, v_c, x.m, x.v, x.p, o, s, decay=leaf.decay)
  if not leaf.narrow_moments:  # u from the moments as stored (kept where skipped): the old ones
    m_c, v_c = m, v  # are then read once, where they are overwritten (no copy)
  k = leaf.stacked_axes
  kept = None
  if o.caution:  # a reduction over the leaf before u: the kernels do not compute it
    g = _leaf.moment_gradient(x.g, x.p, o, s, decay=leaf.decay)
    kept = _ratios.caution_fraction(_leaf.adam_direction(m_c, v_c, s), g, k, leaf.axis_name)
    # u again after the barrier: kept in memory between the two reductions, it would be
    # a parameter-sized temporary.
    m_c, v_c, x, kept = jax.lax.optimization_barrier((m_c, v_c, x, kept))
  if not leaf.adapt:
    zeros = jnp.zeros(leaf.shape[:k], jnp.float32)
    return _Pass1(m, v, m_c, v_c, zeros, zeros, None, kept)
  u = _direction(plan, leaf, x, m_c, v_c, x.p, kept)
  p = _leaf.ratio_params(x.p, o, s, decay=leaf.decay)
  if keep_u:
    # Small leaf: computing u once and keeping it (in cache) beats computing it twice.
    p_sq, u_sq = _ratios.leaf_sq_sums(p, u, stacked_axes=k, partial_count=1)
    return _Pass1(m, v, m_c, v_c, p_sq, u_sq, u, kept)
  p_sq, u_sq = _ratios.leaf_sq_sums(p, u, stacked_axes=k)
  return _Pass1(m, v, m_c, v_c, p_sq, u_sq, None, kept)


def _scaled_sums(plan: StepPlan, leaf: LeafPlan, x: LeafArrays, first: _Pass1, p_scale,
                 u_scale) -> tuple:  # fmt: skip
  """The leaf's sums of (p s_p)^2 and (u s_u)^2 (`_ratios.rescue_scale`, per slice), u recomputed
  from the moments (one pass, like pass 1's reduction)."""
  k = leaf.stacked_axes
  if not leaf.adapt:
    return (jnp.zeros(leaf.shape[:k], jnp.float32),) * 2
  # Computed here from the branch's own operands: shared with pass 1, XLA would compute them
  # outside the branch and keep them in memory for it (the shrunk params, "params" placement).
  x, first = jax.lax.optimization_barrier((x, first))
  u = first.u
  if u is None and leaf.narrow_moments:  # from the old moments, which pass 2 overwrites later
    m_c, v_c = _leaf.moments(x.g, x.m, x.v, plan.options, plan.scalars, p=x.p, decay=leaf.decay)
    u = _direction(plan, leaf, x, m_c, v_c, x.p, first.kept)
  elif u is None:  # the new moments as stored are the computed ones: no copy for the branch
    u = _direction(plan, leaf, x, first.m, first.v, x.p, first.kept)
  p = _leaf.ratio_params(x.p, plan.options, plan.scalars, decay=leaf.decay)
  return _ratios.scaled_sq_sums(p, u, p_scale, u_scale, stacked_axes=k)


def _pass2(plan: StepPlan, leaf: LeafPlan, x: LeafArrays, first: _Pass1, ratio, *,
           apply: bool) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
  """The update (or new params) of one leaf and its moments as stored, from the ratio and pass 1.

  Moments stored narrower than they are computed are written here, recomputed from g and
  the old moments, not by pass 1: pass 1 only reads them, so each buffer is read and
  written in place in one pass (u never sees their rounding).
  """
  o, s = plan.options, plan.scalars
  p, u = x.p, first.u
  if leaf.narrow_moments and (u is None or not leaf.adapt):
    return _narrow_pass2(plan, leaf, x, ratio, first.kept, apply=apply)
  if not leaf.adapt:
    u = _direction(plan, leaf, x, first.m_c, first.v_c, p, first.kept)
    return _leaf.update(u, p, None, o, s, apply=apply, decay=leaf.decay), first.m, first.v
  if u is not None:
    return _leaf.update(u, p, ratio, o, s, apply=apply, decay=leaf.decay), first.m, first.v
  # Pass 2 starts here: the barrier keeps its u a recomputation, not a stored copy.
  p, m_c, v_c, ratio = jax.lax.optimization_barrier((p, first.m, first.v, ratio))
  u = _direction(plan, leaf, x, m_c, v_c, p, first.kept)
  return _leaf.update(u, p, ratio, o, s, apply=apply, decay=leaf.decay), first.m, first.v


def _narrow_pass2(plan: StepPlan, leaf: LeafPlan, x: LeafArrays, ratio, kept, *,
                  apply: bool) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
  """Pass 2 of a leaf whose moments are stored narrower than computed: m, v and p (or the
  update), the moments recomputed from g and the old ones, which pass 1 only read.

  XLA:CPU computes the three in separate fusions that each read the old moments, so it
  copies the donated moment buffers: the moments' bytes in temporaries (benchmarks/NOTES.md,
  "Memory"). The Pallas kernels write all three in one kernel.
  """
  o, s = plan.options, plan.scalars
  # The barrier keeps u (and the moments) a recomputation here, not pass 1's stored copy.
  x = LeafArrays(*jax.lax.optimization_barrier(tuple(x)))
  m_c, v_c = _leaf.moments(x.g, x.m, x.v, o, s, p=x.p, decay=leaf.decay)
  u = _direction(plan, leaf, x, m_c, v_c, x.p, kept)
  out = _leaf.update(u, x.p, ratio if leaf.adapt else None, o, s, apply=apply, decay=leaf.decay)
  return (out, *_leaf.stored_moments(m_c, v_c, x.m, x.v, x.p, o, s, decay=leaf.decay))
