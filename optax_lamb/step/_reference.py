"""``implementation="reference"``: the planned step on a backend that computes each stage as the
stand-alone stages do, one after another.

The planned step (`optax_lamb.step._plan`, run by `optax_lamb.step._transform`) orchestrates
as on every backend: the global norm and clip factor, the skip decision, the spike rule, the
loss scale and the master weights are written there once. `ReferenceBackend` only supplies
the per-leaf passes, in the stages' order and with their plain math: the moments and the
direction of :func:`optax_lamb.scale_by_adam` (`_leaf.moments`, `_leaf.direction`, caution's
`_ratios.caution_fraction`), the decay of :func:`optax_lamb.add_decayed_weights`
(`_leaf.add_decay`, inside `_leaf.direction`), the ratios of
:func:`optax_lamb.scale_by_trust_ratio` (`optax_lamb.stages._trust_ratio.ratio_vector`,
from the materialized directions) and the learning rate (`_leaf.update`). No fusion, no
recomputation: each leaf's u is kept between the norms and the update.

The compat variants' cross-stage options (the decay on the clipped gradient before the moments,
the decay of the params outside the ratio, the bias correction on the step size, ONNX Runtime's
``finite_guard``) are `LambOptions` read by those `_leaf` functions, as on the other backends.
lamb's state is that of ``optax.chain`` of the stages (`init`) on every implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._config import LambConfig
from optax_lamb.stages._adam import adam_stage
from optax_lamb.stages._clipping import clip_stage
from optax_lamb.stages._decay import add_decayed_weights
from optax_lamb.stages._trust_ratio import ratio_vector, trust_ratio_stage
from optax_lamb.step._plan import (
  LeafArrays,
  LeafPlan,
  StepPlan,
  StepResult,
  decay_coefficient,
  given_scalars,
)


def stages(config: LambConfig) -> tuple[optax.GradientTransformation, ...]:
  """(clip, Adam, decay, trust ratio, learning rate): lamb's stages for `config`."""
  o, h, per_leaf = config
  clip = (
    clip_stage(h.max_grad_norm, per_leaf.axis_name, h.clip_norm_eps)
    if h.max_grad_norm is not None
    else optax.identity()
  )
  adam = adam_stage(
    h.b1,
    h.b2,
    h.eps,
    h.eps_root,
    bias_correction=o.bias_correction_in_direction,
    grad_averaging=o.grad_averaging,
    caution=o.caution,
    stacked_axes=per_leaf.stacked_axes,
    axis_name=per_leaf.axis_name,
    mu_dtype=o.mu_dtype,
    nu_dtype=o.nu_dtype,
  )
  decay = add_decayed_weights(decay_coefficient(config), per_leaf.mask)
  s = given_scalars(config)  # the ratio's numbers by their step names, as every path takes them
  trust = trust_ratio_stage(
    min_ratio=s.min_ratio,
    max_ratio=s.max_ratio,
    mask=per_leaf.trust_ratio_mask,
    stacked_axes=per_leaf.stacked_axes,
    axis_name=per_leaf.axis_name,
    mask_name="trust_ratio_mask",
    max_param_norm=s.max_param_norm,
    adapt_gate=s.adapt_gate,
  )
  return clip, adam, decay, trust, optax.scale_by_learning_rate(h.learning_rate)


def init(config: LambConfig) -> Any:
  """lamb's init for `config` on every implementation: that of the chain of its stages."""
  return optax.chain(*stages(config)).init


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
  """The per-leaf passes as the stages compute them (the module docstring); runs everywhere and
  jax differentiates it. Only ``implementation="reference"`` takes it."""

  name = "reference"
  differentiable = True  # plain jnp

  def auto_reason(self) -> str | None:
    return "the reference is taken only when asked for"

  def unsupported_reason(self, plan: StepPlan, leaves: list[LeafArrays]) -> str | None:
    return None

  def runs_interpreted(self) -> bool:
    return False

  def step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult:
    """The Adam stage per leaf, the trust-ratio stage over the tree, the learning rate per leaf."""
    o, s = plan.options, plan.scalars
    adam = [_adam(plan, leaf, x) for leaf, x in zip(plan.leaves, leaves, strict=True)]
    us = [u for _, _, u in adam]
    ps = [
      _leaf.ratio_params(x.p, o, s, decay=leaf.decay)
      for leaf, x in zip(plan.leaves, leaves, strict=True)
    ]
    adapts = [leaf.adapt for leaf in plan.leaves]
    axes = [leaf.stacked_axes for leaf in plan.leaves]
    ratios = ratio_vector(us, ps, s, plan.layout, adapts, axes, plan.leaf_names)
    out, mu, nu = [], [], []
    for leaf, x, (m_c, v_c, u), ratio in zip(
      plan.leaves, leaves, adam, plan.layout.pieces(ratios), strict=True
    ):
      r = ratio if leaf.adapt else None
      out.append(_leaf.update(u, x.p, r, o, s, apply=apply, decay=leaf.decay))
      m, v = _leaf.stored_moments(m_c, v_c, x.m, x.v, x.p, o, s, decay=leaf.decay)
      mu.append(m)
      nu.append(v)
    return StepResult(out, mu, nu, ratios)


def _adam(plan: StepPlan, leaf: LeafPlan, x: LeafArrays) -> tuple[Any, Any, Any]:
  """(m', v' in the compute dtype, u): the Adam stage's moments and direction, the decay
  stage's term where the leaf decays in the direction (L2: in the moments' gradient)."""
  o, s = plan.options, plan.scalars
  m_c, v_c = _leaf.moments(x.g, x.m, x.v, o, s, p=x.p, decay=leaf.decay)
  g = kept = None
  if o.caution:  # timm: over the leaf's (or slice's) direction before the decay
    g = _leaf.moment_gradient(x.g, x.p, o, s, decay=leaf.decay)
    u = _leaf.adam_direction(m_c, v_c, s).astype(x.g.dtype)
    kept = _ratios.caution_fraction(u, g, leaf.stacked_axes, leaf.axis_name)
  u = _leaf.direction(m_c, v_c, x.p, o, s, decay=leaf.decay, dtype=x.g.dtype, g=g, kept=kept)
  return m_c, v_c, u
