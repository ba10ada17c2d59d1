"""The fused XLA path of lamb: two passes over memory per leaf instead of a chain of stages.

The stage chain (clip, Adam, decay, trust ratio, learning rate) computes the
same values but XLA materialises several param-sized intermediates for it and
reads each leaf many times. Here, per leaf:

* pass 1 (reads g, m, v, p; writes m, v in place) updates the moments and
  yields the two squared norms ||p||^2 and ||u||^2 from one reduction;
* pass 2 (reads p, m, v; writes p or the updates in place) recomputes the
  direction u from the new moments with the identical expressions, so the
  values are bit-identical to pass 1's, and applies the trust ratio and the
  learning rate.

An `optimization_barrier` between the passes stops XLA from merging the two
computations of u (which would materialise u, a param-sized temporary). When
the moments are stored in a narrower dtype than they are computed in, pass 2
recomputes them from the old moments instead, so u never sees the rounding.

Leaves of at most 2^18 elements compute u once and keep it between the norm
and the update instead: it stays in cache, and recomputing would cost more than
it saves. Leaves without layer adaptation need no norm and take one pass.

This is the reference the Pallas kernels are tested against. It computes from
the step plan (`optax_lamb._plan`), as every backend does, so the state is the
stage chain's state and the implementations are interchangeable. Every formula
comes from `optax_lamb._math`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optax_lamb import _math
from optax_lamb._plan import LeafPlan, StepPlan

# Leaves up to this many elements keep u in memory between the norm and the update (it stays
# in cache); larger ones recompute it (two passes over memory, no param-sized temporary).
_MATERIALISE_U_MAX_SIZE = 1 << 18


def step(
  plan: StepPlan, grads: list, mu: list, nu: list, params: list, *, apply: bool
) -> tuple[list, list, list, jax.Array]:
  """One lamb step in two passes per leaf, on flat lists of leaves (grads in float32).

  Returns:
    (updates, or the new params with `apply`; new mu; new nu; the ratio vector).
  """
  c = plan.config

  def clipped(g):
    return g if plan.clip_factor is None else (g * plan.clip_factor).astype(g.dtype)

  def direction(g, m, v, p, decay):
    """Adam direction plus decay, with the stage chain's dtype casts; u has g's dtype."""
    u = _math.adam_direction(m, v, plan.bc1, plan.bc2, c.eps, c.eps_root).astype(g.dtype)
    return _math.add_decay(u, p, plan.weight_decay) if decay else u

  def layer_ratio(p_sq, u_sq, axis_name):
    return _math.trust_ratio(
      _math.psum_if(p_sq, axis_name),
      _math.psum_if(u_sq, axis_name),
      min_ratio=c.min_trust_ratio,
      max_ratio=c.max_trust_ratio,
    ).astype(jnp.float32)

  def leaf(g, m, v, p, opts: LeafPlan):
    g, k = clipped(g), opts.stacked_axes
    m_c, v_c = _math.update_moments(g, m, v, c.b1, c.b2)
    m_new, v_new = m_c.astype(m.dtype), v_c.astype(v.dtype)
    # Recompute from the stored moments only where storing them did not round.
    from_new = m_new.dtype == m_c.dtype and v_new.dtype == v_c.dtype
    if opts.adapt and jnp.size(p) <= _MATERIALISE_U_MAX_SIZE:
      # Small leaf: computing u once and keeping it (in cache) beats computing it twice.
      u = direction(g, m_c, v_c, p, opts.decay)
      ratio = layer_ratio(_math.sq_norm(p, k), _math.sq_norm(u, k), opts.axis_name)
      p2, u = p, _math.scale_by_ratio(u, ratio)
    elif opts.adapt:
      u = direction(g, m_c, v_c, p, opts.decay)
      ratio = layer_ratio(*_math.sq_norms(p, u, stacked_axes=k), opts.axis_name)
      # Pass 2 starts here: the barrier keeps its u a recomputation, not a stored copy.
      if from_new:
        p2, m2, v2, ratio2 = jax.lax.optimization_barrier((p, m_new, v_new, ratio))
        u = direction(g, m2, v2, p2, opts.decay)
      else:
        p2, g2, m2, v2, ratio2 = jax.lax.optimization_barrier((p, g, m, v, ratio))
        u = direction(g2, *_math.update_moments(g2, m2, v2, c.b1, c.b2), p2, opts.decay)
      u = _math.scale_by_ratio(u, ratio2)
    else:
      ratio = jnp.ones(jnp.shape(p)[:k], jnp.float32)
      p2 = p
      u = direction(g, m_c, v_c, p, opts.decay)
    u = _math.scale_by_step_size(u, plan.step_size, jnp.dtype(p.dtype))
    out = jnp.asarray(p2 + u).astype(p.dtype) if apply else u
    return out, m_new, v_new, ratio

  results = [leaf(*args) for args in zip(grads, mu, nu, params, plan.leaves, strict=True)]
  out, mu, nu, ratios = ([r[i] for r in results] for i in range(4))
  return out, mu, nu, plan.layout.join(ratios)
