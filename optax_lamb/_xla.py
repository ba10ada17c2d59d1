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

The state is the stage chain's state, leaf for leaf, so the two
implementations are interchangeable. Every formula comes from `_math`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _clipping, _math, _tree
from optax_lamb._trust_ratio import ScaleByTrustRatioState


@dataclasses.dataclass(frozen=True)
class LambConfig:
  """lamb's hyper-parameters, as given to :func:`optax_lamb.lamb`."""

  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  weight_decay: Any
  mask: Any
  bias_correction: bool
  trust_ratio_mask: Any
  min_trust_ratio: Any
  max_trust_ratio: Any
  max_grad_norm: Any
  stacked_axes: Any
  axis_name: Any


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(LambConfig))


# Leaves up to this many elements keep u in memory between the norm and the update (it stays
# in cache); larger ones recompute it (two passes over memory, no param-sized temporary).
_MATERIALISE_U_MAX_SIZE = 1 << 18


def _is_schedule_state(x) -> bool:
  return isinstance(x, optax.ScaleByScheduleState)


def _schedule_count(state):
  """The step count of the (possibly masked) schedule state of a stage."""
  found = [s for s in jax.tree.leaves(state, is_leaf=_is_schedule_state) if _is_schedule_state(s)]
  return found[0].count


def _advance_schedule(state):
  """The stage state after one step: every schedule count incremented."""
  return jax.tree.map(
    lambda s: optax.ScaleByScheduleState(count=optax.safe_increment(s.count)),
    state,
    is_leaf=_is_schedule_state,
  )


def _schedule_value(value, state):
  """(value at this step, next stage state) for a float or schedule hyper-parameter."""
  if callable(value):
    return value(_schedule_count(state)), _advance_schedule(state)
  return value, state


def update(
  config: LambConfig,
  grads: Any,
  state: tuple,
  params: Any,
  *,
  apply: bool = False,
) -> tuple[Any, tuple]:
  """One lamb step in two passes per leaf.

  Args:
    config: the hyper-parameters.
    grads: the gradients.
    state: the stage chain's state (clip, Adam, decay, trust ratio, learning rate).
    params: the current params.
    apply: return the new params (p + update, written by pass 2) instead of the updates.

  Returns:
    (updates, new_state), or (new_params, new_state) with ``apply=True``.
  """
  clip_state, adam_state, decay_state, _, lr_state = state
  _tree.check_same_structure(grads, "updates", adam_state.mu, "the optimizer state (mu)")
  c = config
  treedef = jax.tree.structure(params)

  count = optax.safe_increment(adam_state.count)
  bc1, bc2 = _math.bias_corrections(count, c.b1, c.b2, c.bias_correction)
  wd, decay_state = _schedule_value(c.weight_decay, decay_state)
  if callable(c.learning_rate):
    step_size = -1 * c.learning_rate(_schedule_count(lr_state))
    lr_state = _advance_schedule(lr_state)
  else:
    step_size = -1 * c.learning_rate
  if c.max_grad_norm is not None:
    factor = _math.clip_factor(_clipping.global_sq_norm(grads, c.axis_name), c.max_grad_norm)
  else:
    factor = None

  # Per-leaf options, resolved as the stages resolve them.
  decays = _tree.resolve_per_leaf(c.mask, grads, True)
  adapts = _tree.resolve_per_leaf(c.trust_ratio_mask, params, True)
  axes = _tree.resolve_stacked_axes(c.stacked_axes, params)

  def clipped(g):
    return g if factor is None else (g * factor).astype(g.dtype)

  def direction(g, m, v, p, decay):
    """Adam direction plus decay, with the stage chain's dtype casts; u has g's dtype."""
    u = _math.adam_direction(m, v, bc1, bc2, c.eps, c.eps_root).astype(g.dtype)
    return _math.add_decay(u, p, wd) if decay else u

  def layer_ratio(p_sq, u_sq, axis_name):
    return _math.trust_ratio(
      _math.psum_if(p_sq, axis_name),
      _math.psum_if(u_sq, axis_name),
      min_ratio=c.min_trust_ratio,
      max_ratio=c.max_trust_ratio,
    ).astype(jnp.float32)

  def leaf(g, m, v, p, decay, adapt, k, axis_name):
    g = clipped(g)
    m_c, v_c = _math.update_moments(g, m, v, c.b1, c.b2)
    m_new, v_new = m_c.astype(m.dtype), v_c.astype(v.dtype)
    # Recompute from the stored moments only where storing them did not round.
    from_new = m_new.dtype == m_c.dtype and v_new.dtype == v_c.dtype
    if adapt and jnp.size(p) <= _MATERIALISE_U_MAX_SIZE:
      # Small leaf: computing u once and keeping it (in cache) beats computing it twice.
      u = direction(g, m_c, v_c, p, decay)
      ratio = layer_ratio(_math.sq_norm(p, k), _math.sq_norm(u, k), axis_name)
      p2, u = p, _math.scale_by_ratio(u, ratio)
    elif adapt:
      u = direction(g, m_c, v_c, p, decay)
      ratio = layer_ratio(*_math.sq_norms(p, u, stacked_axes=k), axis_name)
      # Pass 2 starts here: the barrier keeps its u a recomputation, not a stored copy.
      if from_new:
        p2, m2, v2, ratio2 = jax.lax.optimization_barrier((p, m_new, v_new, ratio))
        u = direction(g, m2, v2, p2, decay)
      else:
        p2, g2, m2, v2, ratio2 = jax.lax.optimization_barrier((p, g, m, v, ratio))
        u = direction(g2, *_math.update_moments(g2, m2, v2, c.b1, c.b2), p2, decay)
      u = _math.scale_by_ratio(u, ratio2)
    else:
      ratio = jnp.ones(jnp.shape(p)[:k], jnp.float32)
      p2 = p
      u = direction(g, m_c, v_c, p, decay)
    # optax.scale_by_learning_rate, then lamb's cast to the param dtype.
    if callable(c.learning_rate):
      u = jnp.array(step_size, dtype=u.dtype) * u
    else:
      u = step_size * u
    u = u.astype(p.dtype)
    out = jnp.asarray(p2 + u).astype(p.dtype) if apply else u
    return out, m_new, v_new, ratio

  per_leaf = [
    treedef.flatten_up_to(t)
    for t in (grads, adam_state.mu, adam_state.nu, params, decays, adapts, axes)
  ]
  axis_names = _tree.resolve_axis_names(c.axis_name, params)
  leaves = [leaf(*args) for args in zip(*per_leaf, axis_names, strict=True)]
  out, mu, nu, ratios = (jax.tree.unflatten(treedef, [x[i] for x in leaves]) for i in range(4))
  new_state = (
    clip_state,
    optax.ScaleByAdamState(count=count, mu=mu, nu=nu),
    decay_state,
    ScaleByTrustRatioState(ratios=ratios),
    lr_state,
  )
  return out, new_state
