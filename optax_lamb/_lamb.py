"""The LAMB optimizer: clipping, Adam, decoupled weight decay, trust ratio, learning rate."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _check_args, _dispatch, _leaf, _loss_scale, _norms, _prologue, _skip, _tree
from optax_lamb._adam import scale_by_adam
from optax_lamb._clipping import clip_stage
from optax_lamb._decay import add_decayed_weights
from optax_lamb._mixed_precision import with_master_weights
from optax_lamb._plan import LambConfig, decay_coefficient
from optax_lamb._schedule import scalar_valued
from optax_lamb._trust_ratio import trust_ratio_stage


def lamb(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-6,
  eps_root: float = 0.0,
  weight_decay: optax.ScalarOrSchedule = 0.0,
  mask: Any = None,
  *,
  bias_correction: bool = True,
  trust_ratio_mask: Any = None,
  min_trust_ratio: float | None = None,
  max_trust_ratio: float | None = None,
  max_grad_norm: float | None = None,
  stacked_axes: Any = None,
  mu_dtype: Any = None,
  nu_dtype: Any = None,
  axis_name: Any = None,
  implementation: str = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""The LAMB optimizer (You et al. 2019), a drop-in for :func:`optax.lamb`.

  The update, for each leaf (or each stacked layer slice of a leaf); the stages
  :func:`clip_by_global_norm`, :func:`scale_by_adam`, :func:`add_decayed_weights`
  and :func:`scale_by_trust_ratio` compute its lines, and every implementation
  computes all of it:

  .. math::
    g &\leftarrow g \cdot \min(1, c / \|g\|_{global})  \quad \text{(if max\_grad\_norm = c)} \\
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / (1 - b_1^t)}{\sqrt{v / (1 - b_2^t) + \epsilon_{root}} + \epsilon} + \lambda p \\
    r &= \mathrm{clip}(\|p\| / \|u\|, r_{min}, r_{max}) \quad (r = 1 \text{ if either norm is } 0) \\
    p &\leftarrow p - \eta_t \, r \, u

  With the defaults this computes what ``optax.lamb(learning_rate)`` computes.
  Its state is the tuple of the stage states, in order: clipping
  (:class:`optax.EmptyState`), :class:`optax.ScaleByAdamState`, weight decay,
  :class:`optax_lamb.ScaleByTrustRatioState` and the learning rate.

  Args:
    learning_rate: a finite float >= 0, a scalar array or an optax schedule.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the Adam denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    weight_decay: decoupled weight decay (float or schedule), added to the
      Adam direction and so inside the trust-ratio norm.
    mask: weight-decay mask, as in optax: a pytree of bools (a prefix of the
      params; a ``None`` entry decays) or callable(params) returning one.
    bias_correction: ``False`` gives u = m / (sqrt(v) + eps), as Google's code.
    trust_ratio_mask: pytree of bools (a prefix of the params) or callable(params):
      the leaves that get layer adaptation; the others use ratio 1. ``None`` (or a
      ``None`` entry): every leaf.
    min_trust_ratio: lower clamp of the ratio, applied when both norms are non-zero.
    max_trust_ratio: upper clamp of the ratio, applied when both norms are non-zero.
    max_grad_norm: clip the gradients to this global norm before the moments.
    stacked_axes: int, pytree of ints or callable(params): leading axes of a leaf
      that index stacked layers (``nn.scan``/``nnx.scan``); each slice gets its
      own trust ratio.
    mu_dtype: storage dtype of the first moment (default: param dtype).
    nu_dtype: storage dtype of the second moment (default: param dtype).
    axis_name: mapped axis name(s) over which leaves are sharded inside
      ``shard_map``/``pmap``; the squared norms (global clipping norm, trust-ratio
      norms) are ``psum``'d over them. A name or tuple of names for every leaf,
      or per leaf a pytree prefix / callable(params) of those with ``None`` for
      replicated leaves. ``None`` (default): no leaf is sharded, as under
      ``pmap`` with replicated params or ``jit`` with ``NamedSharding``.
    implementation: ``"auto"`` (the Pallas kernels on one GPU or inside
      ``shard_map``, else the XLA path; the rules are in ``optax_lamb/_dispatch.py``),
      ``"xla"`` (two fused passes over memory per leaf), ``"pallas"`` (Triton
      kernels over buckets of leaves; compiled and validated on an H100 with
      jax 0.11.2; without a GPU they run in Pallas interpret mode, slowly),
      ``"reference"`` (the plain chain of stages, slower), or a configured backend
      object such as ``optax_lamb.backends.pallas.PallasBackend(block_sizes=...)``.
      Same values and state.
    skip_nonfinite: skip a step whose (unscaled) gradients hold a NaN or an Inf:
      zero updates, state unchanged, counted (:func:`optax_lamb.skip_counts`).
    grad_scale: divide the gradients by this loss scale before anything else: a
      positive float, an array, or a schedule on the number of updates. A dynamic
      scale can instead be passed each step as ``update(..., grad_scale=s)``.
    master_weights: keep float32 master copies of the params in the state and run
      the LAMB math on them (:func:`optax_lamb.with_master_weights`), for
      bfloat16/float16 params.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; its updates have the
    params' dtypes. Its state is the stage tuple, wrapped (outermost first) in the
    grad-scale schedule state, :class:`optax_lamb.SkipNonFiniteState` and
    :class:`optax_lamb.MasterWeightsState` when those options are on. Integer,
    boolean and complex leaves, empty trees and mismatched shapes raise errors.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
    >>> tx = optax_lamb.lamb(1e-3, weight_decay=0.01)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    You et al., `Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes <https://arxiv.org/abs/1904.00962>`_, 2020
  """
  # b1, b2, eps, eps_root, bias_correction, mu_dtype, nu_dtype are checked by scale_by_adam,
  # weight_decay and mask by add_decayed_weights, when the reference chain is built.
  _check_args.check_non_negative("learning_rate", learning_rate, schedule=True)
  _check_args.check_per_leaf("trust_ratio_mask", trust_ratio_mask, "bool")
  _check_args.check_ratio_bounds(
    "min_trust_ratio", min_trust_ratio, "max_trust_ratio", max_trust_ratio
  )
  if max_grad_norm is not None:
    _check_args.check_positive("max_grad_norm", max_grad_norm)
  _check_args.check_per_leaf("stacked_axes", stacked_axes, "int")
  _check_args.check_axis_name("axis_name", axis_name)
  config = LambConfig(
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    weight_decay=weight_decay,
    mask=mask,
    bias_correction=bias_correction,
    trust_ratio_mask=trust_ratio_mask,
    min_trust_ratio=min_trust_ratio,
    max_trust_ratio=max_trust_ratio,
    max_grad_norm=max_grad_norm,
    stacked_axes=stacked_axes,
    axis_name=axis_name,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
  )
  return build(
    config,
    implementation=implementation,
    skip_nonfinite=skip_nonfinite,
    grad_scale=grad_scale,
    master_weights=master_weights,
  )


def reference_chain(config: LambConfig) -> optax.GradientTransformation:
  """The stages that compute lamb's step, run one after another; its init is lamb's init everywhere.

  The state is the tuple of the stage states in the order clip, Adam, decay,
  trust ratio, learning rate (``optax.chain`` of the five). With lamb's
  options they also run in that order. The variants of ``optax_lamb.compat``
  run the same stages in another order or with a step between them (each from
  `optax_lamb._leaf`): the decay stage on the clipped gradient (L2) or on the
  params before the step; caution after Adam; the bias correction on the step size.
  """
  c = config
  clip = (
    clip_stage(c.max_grad_norm, c.axis_name, c.clip_norm_eps)
    if c.max_grad_norm is not None
    else optax.identity()
  )
  adam = scale_by_adam(
    c.b1,
    c.b2,
    c.eps,
    c.eps_root,
    bias_correction=c.bias_correction_in_direction,
    grad_averaging=c.grad_averaging,
    mu_dtype=c.mu_dtype,
    nu_dtype=c.nu_dtype,
  )
  decay = add_decayed_weights(decay_coefficient(c), c.mask)
  trust = trust_ratio_stage(
    min_norm=0.0,
    trust_coefficient=1.0,
    eps=0.0,
    mask=c.trust_ratio_mask,
    min_ratio=c.min_trust_ratio,
    max_ratio=c.max_trust_ratio,
    stacked_axes=c.stacked_axes,
    axis_name=c.axis_name,
    mask_name="trust_ratio_mask",
    max_param_norm=c.max_param_norm,
  )
  scale = optax.scale_by_learning_rate(c.learning_rate)
  placement = c.weight_decay_placement

  def update_fn(grads, state, params=None):
    clip_state, adam_state, decay_state, trust_state, lr_state = state
    g, clip_state = clip.update(grads, clip_state, params)
    if placement == "gradient":
      g, decay_state = decay.update(g, decay_state, params)
    u, adam_state = adam.update(g, adam_state, params)
    if c.caution:
      axes = jax.tree.leaves(_tree.resolve_stacked_axes(c.stacked_axes, params))
      names = _tree.resolve_axis_names(c.axis_name, params)
      treedef = jax.tree.structure(u)
      us, gs = treedef.flatten_up_to(u), treedef.flatten_up_to(g)
      fractions = [_leaf.caution_fraction(*x) for x in zip(us, gs, axes, names, strict=True)]
      u = treedef.unflatten(map(_leaf.cautious, us, gs, fractions))
    ratio_params, shrink = params, None
    if placement == "direction":
      u, decay_state = decay.update(u, decay_state, params)
    elif placement == "params":
      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, _norms.compute_dtype(p.dtype)), params)
      shrink, decay_state = decay.update(zeros, decay_state, params)
      ratio_params = jax.tree.map(lambda p, d: p.astype(d.dtype) - d, params, shrink)
    u, trust_state = trust.update(u, trust_state, ratio_params)
    u, lr_state = scale.update(u, lr_state, params)
    if c.bias_correction_on_step_size:
      bcs = _leaf.bias_corrections(adam_state.count, c.b1, c.b2)
      u = jax.tree.map(lambda x: x * _leaf.step_size_correction(*bcs).astype(x.dtype), u)
    if shrink is not None:
      u = jax.tree.map(lambda x, d: x - d, u, shrink)
    return u, (clip_state, adam_state, decay_state, trust_state, lr_state)

  init = optax.chain(clip, adam, decay, trust, scale).init
  return optax.GradientTransformation(init, update_fn)


def build(
  config: LambConfig,
  *,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
  grad_transform: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """The transformation of a checked `config`, on `implementation`, behind the wrappers asked for.

  `grad_transform(grads, params) -> grads`, if given, is applied to the unscaled
  float32 gradients before the step, on every implementation (``optax_lamb.compat``:
  Keras' per-variable ``clipnorm`` and ``clipvalue``).
  """
  _dispatch.check_implementation(implementation)
  _check_args.check_bool("skip_nonfinite", skip_nonfinite)
  _check_args.check_bool("master_weights", master_weights)
  _loss_scale.check_grad_scale(grad_scale)
  config = dataclasses.replace(
    config,
    learning_rate=scalar_valued(config.learning_rate, "learning_rate"),
    weight_decay=scalar_valued(config.weight_decay, "weight_decay"),
  )
  grad_scale = scalar_valued(grad_scale, "grad_scale")
  stages = reference_chain(config)

  if implementation == "reference":

    def lamb_step(grads, state, params, *, apply):
      updates, state = stages.update(grads, state, params)
      updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
      return (optax.apply_updates(params, updates) if apply else updates), state

  else:

    def lamb_step(grads, state, params, *, apply):
      return _dispatch.step(config, implementation, grads, state, params, apply=apply)

  def step(grads, state, params, *, apply):
    if grad_transform is not None:
      grads = grad_transform(grads, params)
    return lamb_step(grads, state, params, apply=apply)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, apply=False)

  tx = optax.GradientTransformationExtraArgs(stages.init, update_fn)
  if master_weights:
    tx = with_master_weights(tx)
  if skip_nonfinite:
    tx = _skip.skip_nonfinite(tx, axis_name=config.axis_name)
  # update_and_apply writes the new params in the last pass; with a wrapper in between it
  # falls back to update + apply_updates.
  wrapped = master_weights or skip_nonfinite
  fused_apply = None if wrapped else functools.partial(step, apply=True)
  return _prologue.with_prologue(tx, who="lamb", grad_scale=grad_scale, fused_apply=fused_apply)
