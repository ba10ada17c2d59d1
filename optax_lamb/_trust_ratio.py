"""Stage 3: the per-leaf (or per stacked layer) trust ratio ||p|| / ||u||."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _checks, _math, _tree


class ScaleByTrustRatioState(NamedTuple):
  """The trust ratios applied by the last update (float32, one per leaf or stacked slice)."""

  ratios: Any


def scale_by_trust_ratio(
  min_norm: float = 0.0,
  trust_coefficient: float = 1.0,
  eps: float = 0.0,
  *,
  mask: Any = None,
  min_ratio: float | None = None,
  max_ratio: float | None = None,
  stacked_axes: Any = None,
  axis_name: Any = None,
) -> optax.GradientTransformation:
  r"""Scale each leaf's update by its trust ratio (LARS/LAMB layer adaptation).

  .. math::
    r = c \cdot \mathrm{clip}\left(\frac{\max(\|p\|, n_{min})}{\max(\|u\|, n_{min}) + \epsilon},
        r_{min}, r_{max}\right), \qquad u \leftarrow r\,u

  and r = 1 when either norm is zero. Norms are accumulated in float32. With no
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
  """
  _checks.check_non_negative("min_norm", min_norm)
  _checks.check_non_negative("eps", eps)
  _checks.check_positive("trust_coefficient", trust_coefficient)
  _checks.check_ratio_bounds("min_ratio", min_ratio, "max_ratio", max_ratio)

  def leaf_options(params):
    adapt = _tree.resolve_per_leaf(mask, params, True)
    axes = _tree.resolve_stacked_axes(stacked_axes, params)
    return adapt, axes

  def init_fn(params):
    adapt, axes = leaf_options(params)
    ratios = jax.tree.map(lambda p, k: jnp.ones(jnp.shape(p)[:k], jnp.float32), params, axes)
    del adapt
    return ScaleByTrustRatioState(ratios=ratios)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("scale_by_trust_ratio needs params: call update(updates, state, params)")
    _tree.check_same_structure(updates, "updates", params, "params")
    adapt, axes = leaf_options(params)

    def leaf(u, p, k, adapts, name):
      if not adapts:
        return u, jnp.ones(jnp.shape(p)[:k], jnp.float32)
      r = _math.trust_ratio(
        _math.psum_if(_math.sq_norm(p, k), name),
        _math.psum_if(_math.sq_norm(u, k), name),
        min_norm=min_norm,
        trust_coefficient=trust_coefficient,
        eps=eps,
        min_ratio=min_ratio,
        max_ratio=max_ratio,
      ).astype(jnp.float32)
      return _math.scale_by_ratio(u, r), r

    treedef = jax.tree.structure(updates)
    names = _tree.resolve_axis_names(axis_name, params)
    columns = [treedef.flatten_up_to(t) for t in (updates, params, axes, adapt)]
    results = [leaf(*args) for args in zip(*columns, names, strict=True)]
    updates = jax.tree.unflatten(treedef, [u for u, _ in results])
    ratios = jax.tree.unflatten(treedef, [r for _, r in results])
    return updates, ScaleByTrustRatioState(ratios=ratios)

  return optax.GradientTransformation(init_fn, update_fn)


def trust_ratios(opt_state: Any) -> Any:
  """The per-leaf trust ratios applied by the last update.

  Searches any nesting of ``chain``, ``masked``, ``MultiSteps`` and
  ``inject_hyperparams`` states for the trust-ratio stage.

  Args:
    opt_state: the state of a transformation that contains a trust-ratio stage.

  Returns:
    A pytree like the params with float32 ratios (shape ``()`` per leaf, or the
    stacked-layer shape); a tuple of such trees if there are several stages.
  """
  found = _tree.find_states(
    opt_state,
    ScaleByTrustRatioState,
    "No trust-ratio stage in this optimizer state: trust_ratios() reads the state of "
    "optax_lamb.lamb or optax_lamb.scale_by_trust_ratio.",
  )
  return found[0].ratios if len(found) == 1 else tuple(s.ratios for s in found)
