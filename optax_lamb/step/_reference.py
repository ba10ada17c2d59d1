"""``implementation="reference"``: lamb as the public stages run one after another.

For lamb's own options this is ``optax.chain`` of :func:`optax_lamb.clip_by_global_norm`,
:func:`optax_lamb.scale_by_adam`, :func:`optax_lamb.add_decayed_weights`,
:func:`optax_lamb.scale_by_trust_ratio` and ``optax.scale_by_learning_rate``, and
its state is that chain's: lamb's state on every implementation. The stages'
options cover the compat variants that act inside one stage (``grad_averaging``,
timm's caution, DeepSpeed's clip eps, torch_optimizer's ``clamp_value``). Three
variants act across stages, and the stage states that checkpoints hold leave no
room for what they would pass between them (the step count after the Adam
stage), so `chain` wires the same stages around them here: the decay on the
clipped gradient before the moments (L2), the decay of the params outside the
ratio (Keras, timm ``decoupled_decay``) and the bias correction on the step size
(DeepSpeed, torch_optimizer).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb.core import _leaf
from optax_lamb.core._config import LambConfig
from optax_lamb.stages._adam import adam_stage
from optax_lamb.stages._clipping import clip_stage
from optax_lamb.stages._decay import add_decayed_weights
from optax_lamb.stages._trust_ratio import trust_ratio_stage
from optax_lamb.step._plan import decay_coefficient, given_scalars


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


def chain(config: LambConfig) -> optax.GradientTransformation:
  """The stages of `config` run one after another; its init is lamb's init everywhere."""
  clip, adam, decay, trust, lr = parts = stages(config)
  plain = optax.chain(*parts)
  o = config.options
  if (
    o.weight_decay_placement == "direction"
    and not o.bias_correction_on_step_size
    and not o.finite_guard
  ):
    return plain
  gradient, params_placement = (o.weight_decay_placement == p for p in ("gradient", "params"))

  def update_fn(grads, state, params=None) -> tuple[Any, Any]:
    clip_state, adam_state, decay_state, trust_state, lr_state = state
    g, clip_state = clip.update(grads, clip_state, params)
    if gradient:  # L2: the decay stage on the clipped gradient, before the moments
      g, decay_state = decay.update(g, decay_state, params)
    u, adam_state = adam.update(g, adam_state, params)
    ratio_params, shrink = params, None
    if params_placement:  # p shrinks by wd p outside the ratio, whose ||p|| is the shrunk one
      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, _leaf.compute_dtype(p.dtype)), params)
      shrink, decay_state = decay.update(zeros, decay_state, params)
      ratio_params = jax.tree.map(lambda p, d: p.astype(d.dtype) - d, params, shrink)
    elif not gradient:
      u, decay_state = decay.update(u, decay_state, params)
    if o.finite_guard:  # ONNX Runtime: a non-finite direction element is 0, its moments kept
      u, adam_state = _finite_direction(u, params, adam_state, state[1])
    u, trust_state = trust.update(u, trust_state, ratio_params)
    u, lr_state = lr.update(u, lr_state, params)
    if o.finite_guard:  # and a non-finite new param element is discarded (update 0)
      u = jax.tree.map(_finite_update, u, params)
    if o.bias_correction_on_step_size:
      bcs = _leaf.bias_corrections(adam_state.count, config.hyper.b1, config.hyper.b2)
      u = jax.tree.map(lambda x: x * _leaf.step_size_correction(*bcs).astype(x.dtype), u)
    if shrink is not None:
      u = jax.tree.map(lambda x, d: x - d, u, shrink)
    return u, (clip_state, adam_state, decay_state, trust_state, lr_state)

  return optax.GradientTransformation(plain.init, update_fn)


def _finite_direction(u: Any, params: Any, new: Any, old: Any) -> tuple[Any, Any]:
  """(u zeroed where `_leaf.finite_direction` is False, the Adam state `new` with the `old`
  moments there): ``finite_guard`` on the stages' direction and moments."""
  finite = jax.tree.map(_leaf.finite_direction, u, params)
  keep = lambda f, n, o: jnp.where(f, n, o)
  return (
    jax.tree.map(lambda f, x: jnp.where(f, x, jnp.zeros_like(x)), finite, u),
    new._replace(
      mu=jax.tree.map(keep, finite, new.mu, old.mu), nu=jax.tree.map(keep, finite, new.nu, old.nu)
    ),
  )


def _finite_update(u: Any, p: Any) -> Any:
  """u, or 0 where p + u (in p's dtype, as `step` applies it) is not finite (``finite_guard``)."""
  new = jnp.asarray(p + u.astype(p.dtype)).astype(p.dtype)
  return jnp.where(jnp.isfinite(new), u, jnp.zeros_like(u))


def step(
  tx: optax.GradientTransformation, grads: Any, state: Any, params: Any, *, apply: bool
) -> tuple[Any, Any]:
  """The chain's updates in the params' dtypes, or the new params with `apply`."""
  updates, state = tx.update(grads, state, params)
  updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
  return (optax.apply_updates(params, updates) if apply else updates), state
