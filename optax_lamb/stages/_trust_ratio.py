"""Stage 3: the per-leaf (or per stacked layer) trust ratio ||p|| / ||u||."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _interop, _nnx
from optax_lamb.core import _leaf, _ratios
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.core._options import (
  LAYOUT_UNKNOWN,
  RatioLayout,
  Scalar,
  ScaleByTrustRatioState,
  StepScalars,
)
from optax_lamb.faults import _check_args, _checks


def scale_by_trust_ratio(
  min_norm: float = 0.0,
  trust_coefficient: float = 1.0,
  eps: float = 0.0,
  *,
  mask: PerLeafMask = None,
  min_ratio: float | None = None,
  max_ratio: float | None = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
) -> optax.GradientTransformation:
  """Scale each leaf's update by its trust ratio (LARS/LAMB layer adaptation): the r line.

  The update is written out once, in :func:`optax_lamb.lamb`; here, with this
  stage's extra knobs, ``r = c * clip(max(||p||, min_norm) / (max(||u||, min_norm) + eps),
  min_ratio, max_ratio)`` and ``u <- r u``, and r = 1 when either norm is zero. Norms are accumulated in float32. With no
  keyword-only option set this equals :func:`optax.scale_by_trust_ratio`.

  Args:
    min_norm: floor of both norms (optax's ``safe_norm``).
    trust_coefficient: c, multiplies the (clamped) ratio.
    eps: added to the update norm.
    mask: pytree of bools or callable(params): the leaves that get layer
      adaptation; the others use ratio 1. ``None``: every leaf.
    min_ratio: lower clamp of the ratio (DeepSpeed ``min_coeff``, ORT ``ratio_min``).
    max_ratio: upper clamp of the ratio (DeepSpeed ``max_coeff``, ORT ``ratio_max``).
    stacked_axes: int, pytree of ints or callable(params): leading axes of a leaf
      that index stacked layers (``nn.scan``); each slice gets its own ratio.
    axis_name: mapped axis name(s) the leaves are sharded over (``shard_map``,
      ``pmap``); the squared norms are ``psum``'d over them before the sqrt.
      One name or a tuple of names for every leaf, or per leaf a pytree prefix
      / callable(params) of those, with ``None`` for replicated leaves (and for
      stacked leaves sharded along their stacked axes, which hold whole layers).
      ``None``: no leaf is sharded.

  Returns:
    An :class:`optax.GradientTransformation` whose state holds the last ratios
    (read them with :func:`optax_lamb.trust_ratios`).

  References:
    You et al., `Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes <https://arxiv.org/abs/1904.00962>`_, 2020

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.scale_by_trust_ratio()
    >>> params = {"w": jnp.full(4, 2.0), "b": jnp.zeros(2)}  # ||w|| = 4, ||b|| = 0
    >>> updates = {"w": jnp.full(4, 0.5), "b": jnp.ones(2)}  # ||u_w|| = 1
    >>> scaled, state = tx.update(updates, tx.init(params), params)
    >>> print(scaled["w"].tolist(), scaled["b"].tolist())  # r = 4, and 1 for a zero norm
    [2.0, 2.0, 2.0, 2.0] [1.0, 1.0]
  """
  _check_args.check_non_negative("min_norm", min_norm)
  _check_args.check_positive("trust_coefficient", trust_coefficient)
  _check_args.check_non_negative("eps", eps)
  _check_args.check_trust_ratio_args(
    ("mask", mask), ("min_ratio", min_ratio), ("max_ratio", max_ratio), stacked_axes, axis_name
  )
  return trust_ratio_stage(
    min_norm=min_norm,
    trust_coefficient=trust_coefficient,
    eps=eps,
    mask=mask,
    min_ratio=min_ratio,
    max_ratio=max_ratio,
    stacked_axes=stacked_axes,
    axis_name=axis_name,
  )


def trust_ratio_stage(
  *,
  min_norm: Scalar = 0.0,
  trust_coefficient: Scalar = 1.0,
  eps: Scalar = 0.0,
  mask: PerLeafMask = None,
  min_ratio: Scalar | None = None,
  max_ratio: Scalar | None = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  mask_name: str = "mask",
  max_param_norm: Scalar | None = None,
  adapt_gate: Scalar | None = None,
) -> optax.GradientTransformation:
  """:func:`scale_by_trust_ratio` with checked arguments; errors call the mask `mask_name`.

  `max_param_norm` clamps ||p|| in the ratio (torch_optimizer's ``clamp_value``); where
  `adapt_gate` is 0 no leaf adapts (apex, timm: the weight decay, a number or an array).
  """
  s = StepScalars(
    min_ratio=min_ratio,
    max_ratio=max_ratio,
    min_norm=min_norm,
    trust_coefficient=trust_coefficient,
    ratio_eps=eps,
    max_param_norm=max_param_norm,
    adapt_gate=adapt_gate,
  )

  def init_fn(params) -> Any:
    if _interop.is_params_placeholder(params):
      # optax.tree_map_params' stand-in for the params: no shapes, so a layout equal to any.
      return ScaleByTrustRatioState(ratios=jnp.ones((0,), jnp.float32), layout=LAYOUT_UNKNOWN)
    _checks.resolve_per_leaf(mask, params, True, mask_name, "bool")  # fail early, by name
    layout = layout_of(params, stacked_axes)
    return ScaleByTrustRatioState(ratios=jnp.ones((layout.size,), jnp.float32), layout=layout)

  def update_fn(updates, state, params=None) -> tuple[Any, Any]:
    if params is None:
      raise ValueError("scale_by_trust_ratio needs params: call update(updates, state, params)")
    _checks.check_same_structure(updates, "updates", params, "params")
    treedef: Any = jax.tree.structure(updates)
    adapts = treedef.flatten_up_to(_checks.resolve_per_leaf(mask, params, True, mask_name, "bool"))
    adapts = [bool(a) for a in adapts]
    axes = treedef.flatten_up_to(_checks.resolve_stacked_axes(stacked_axes, params))
    names = _checks.resolve_axis_names(axis_name, params)
    names = [n if a else None for n, a in zip(names, adapts, strict=True)]
    us, ps = treedef.flatten_up_to(updates), treedef.flatten_up_to(params)
    layout = layout_of(params, stacked_axes)  # the state's may be tree_map_params' placeholder
    ratios = ratio_vector(us, ps, s, layout, adapts, axes, names)
    scaled = [
      _leaf.scale_by_ratio(u, r) if a else u
      for u, r, a in zip(us, layout.pieces(ratios), adapts, strict=True)
    ]
    return treedef.unflatten(scaled), ScaleByTrustRatioState.after_step(ratios, layout)

  return optax.GradientTransformation(init_fn, update_fn)


def layout_of(params: Any, stacked_axes: PerLeafAxes) -> RatioLayout:
  """The trust ratios' layout for `params`: one entry per leaf, or per stacked slice."""
  treedef: Any = jax.tree.structure(params)
  axes = treedef.flatten_up_to(_checks.resolve_stacked_axes(stacked_axes, params))
  shapes = [jnp.shape(p)[:k] for p, k in zip(treedef.flatten_up_to(params), axes, strict=True)]
  return RatioLayout(treedef, tuple(map(tuple, shapes)))


def ratio_vector(
  us: list,
  ps: list,
  s: StepScalars,
  layout: RatioLayout,
  adapts: list[bool],
  axes: list[int],
  names: list,
) -> jax.Array:
  """The ratios of the leaves `us` at params `ps`, from plain sums of squares, or from the scaled
  ones where a plain sum over- or underflowed: on the CPU under ``lax.cond``, computed only then;
  elsewhere the sums at both rescue scales beside the plain ones (`_ratios.per_platform`)."""
  adapted = layout.per_slot(adapts)

  def sq_norms(xs: list) -> list:  # per leaf; zeros where the leaf does not adapt (ratio 1)
    return [
      _ratios.sq_norm(x, k) if a else jnp.zeros(jnp.shape(x)[:k], jnp.float32)
      for x, k, a in zip(xs, axes, adapts, strict=True)
    ]

  sums = _ratios.slot_sums(layout, names, [sq_norms(ps), sq_norms(us)])

  def rescued() -> jax.Array:
    p_scales, u_scales = (layout.pieces(_ratios.rescue_scale(x)) for x in sums[:2])
    scaled = [
      _ratios.scaled_sq_sums(p, u, ps_, us_, stacked_axes=k)
      if a
      else (jnp.zeros(jnp.shape(p)[:k], jnp.float32),) * 2
      for p, u, ps_, us_, k, a in zip(ps, us, p_scales, u_scales, axes, adapts, strict=True)
    ]
    p_scaled, u_scaled = [x[0] for x in scaled], [x[1] for x in scaled]
    exact = sums._replace(scaled=_ratios.slot_sums(layout, names, [p_scaled, u_scaled])[:2])
    return _ratios.ratio_vector(exact, s, adapted)

  def on_accelerator() -> jax.Array:
    zeros = lambda x, k: jnp.zeros(jnp.shape(x)[:k], jnp.float32)
    scales = _ratios.opaque_scales()[1:]
    at = [
      _ratios.leaf_sq_sums(p, u, stacked_axes=k, scales=scales, partial_count=1)
      if a
      else (zeros(p, k),) * 4
      for p, u, k, a in zip(ps, us, axes, adapts, strict=True)
    ]
    p_down, p_up, u_down, u_up = ([x[i] for x in at] for i in range(4))
    exact = _ratios.with_fixed_scale_sums(sums, layout, names, p_down, u_down, p_up, u_up)
    return _ratios.ratio_vector(exact, s, adapted)

  on_cpu = lambda: jax.lax.cond(
    _ratios.needs_rescue(sums.param, sums.update, adapted),
    rescued,
    lambda: _ratios.ratio_vector(sums, s, adapted),
  )
  return jax.lax.platform_dependent(**_ratios.per_platform(on_cpu, on_accelerator))


def trust_ratios(opt_state: Any) -> Any:
  """The per-leaf trust ratios applied by the last update.

  Searches any nesting of ``chain``, ``masked``, ``MultiSteps`` and
  ``inject_hyperparams`` states for the trust-ratio stage.

  Args:
    opt_state: the state of a transformation that contains a trust-ratio stage.

  Returns:
    A pytree like the params with float32 ratios (shape ``()`` per leaf, or the
    stacked-layer shape); a tuple of such trees if there are several stages.

  Example:
    >>> import jax, jax.numpy as jnp, optax_lamb
    >>> params = {"layers": jnp.stack([jnp.ones(3), 2 * jnp.ones(3)]), "bias": jnp.ones(3)}
    >>> tx = optax_lamb.lamb(1e-3, stacked_axes={"layers": 1, "bias": 0})
    >>> state = tx.init(params)
    >>> _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> ratios = optax_lamb.trust_ratios(state)
    >>> print([round(r, 4) for r in ratios["layers"].tolist()], ratios["layers"].dtype)
    [1.0, 2.0] float32
    >>> print(ratios["layers"].shape, ratios["bias"].shape)  # per layer; per leaf
    (2,) ()
  """
  found = _checks.find_states(
    opt_state,
    ScaleByTrustRatioState,
    "No trust-ratio stage in this optimizer state: trust_ratios() reads the state of "
    "optax_lamb.lamb or optax_lamb.scale_by_trust_ratio.",
  )
  # Plain arrays also from a Flax NNX optimizer's state (OptVariable / Param wrappers).
  ratios = tuple(_nnx.plain_values(s.layout.split(_nnx.plain_values(s.ratios))) for s in found)
  return ratios[0] if len(ratios) == 1 else ratios
