"""Stage 3: the per-leaf (or per stacked layer) trust ratio ||p|| / ||u||."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _check_args, _math, _nnx, _tree


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class RatioLayout:
  """Where each leaf's trust ratios sit in the state's ratio vector. Static: no arrays.

  Leaf ``i`` (in ``jax.tree.leaves`` order of the params) owns the entries
  ``offsets[i]:offsets[i + 1]``, reshaped to ``shapes[i]``: ``()`` for a plain
  leaf, the leading stacked axes of a stacked one.
  """

  treedef: Any  # None for a layout made from optax's params placeholder (tree_map_params)
  shapes: tuple[tuple[int, ...], ...]

  @classmethod
  def of(cls, params: Any, stacked_axes: Any = None) -> RatioLayout:
    if _tree.is_params_placeholder(params):
      return cls(None, ())
    treedef = jax.tree.structure(params)
    axes = treedef.flatten_up_to(_tree.resolve_stacked_axes(stacked_axes, params))
    return cls.from_leaves(treedef, treedef.flatten_up_to(params), axes)

  @classmethod
  def from_leaves(cls, treedef: Any, leaves: list, stacked_axes: list[int]) -> RatioLayout:
    shapes = tuple(tuple(jnp.shape(p)[:k]) for p, k in zip(leaves, stacked_axes, strict=True))
    return cls(treedef, shapes)

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    return tuple(itertools.accumulate((math.prod(s) for s in self.shapes), initial=0))

  @property
  def size(self) -> int:
    return self.offsets[-1]

  def join(self, ratios: list[jax.Array]) -> jax.Array:
    """One float32 vector from the per-leaf ratios (in leaf order)."""
    if not ratios:  # a tree emptied by optax.masked
      return jnp.ones((0,), jnp.float32)
    return jnp.concatenate([jnp.reshape(r, (-1,)).astype(jnp.float32) for r in ratios])

  def split(self, vector: jax.Array) -> Any:
    """The per-leaf pytree of ratios; leading batch axes of `vector` (pmap, vmap) are kept."""
    batch = jnp.shape(vector)[:-1]
    pieces = [
      jnp.reshape(vector[..., a:b], batch + shape)
      for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes, strict=True)
    ]
    return jax.tree.unflatten(self.treedef, pieces)

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, RatioLayout):
      return NotImplemented
    # The placeholder's layout matches any layout, so tree_map_params can pair the two states.
    return (
      self is other
      or self.treedef is None
      or other.treedef is None
      or (self.treedef == other.treedef and self.shapes == other.shapes)
    )

  def __hash__(self) -> int:
    return hash(RatioLayout)  # equal layouts must hash alike, the placeholder's included


class ScaleByTrustRatioState(NamedTuple):
  """The trust ratios of the last update: one float32 vector for the whole tree, and its layout.

  One buffer whatever the number of leaves (each jitted call pays host time per
  input buffer); read the per-leaf ratios with :func:`optax_lamb.trust_ratios`.
  """

  ratios: jax.Array
  layout: RatioLayout


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
  _check_args.check_non_negative("min_norm", min_norm)
  _check_args.check_positive("trust_coefficient", trust_coefficient)
  _check_args.check_non_negative("eps", eps)
  _check_args.check_per_leaf("mask", mask, "bool")
  _check_args.check_ratio_bounds("min_ratio", min_ratio, "max_ratio", max_ratio)
  _check_args.check_per_leaf("stacked_axes", stacked_axes, "int")
  _check_args.check_axis_name("axis_name", axis_name)
  return trust_ratio_stage(
    min_norm, trust_coefficient, eps, mask, min_ratio, max_ratio, stacked_axes, axis_name, "mask"
  )


def trust_ratio_stage(
  min_norm, trust_coefficient, eps, mask, min_ratio, max_ratio, stacked_axes, axis_name, mask_name
) -> optax.GradientTransformation:
  """:func:`scale_by_trust_ratio` with checked arguments; errors call the mask `mask_name`."""

  def init_fn(params):
    if not _tree.is_params_placeholder(params):
      _tree.resolve_per_leaf(mask, params, True, mask_name, "bool")  # fail early, by name
    layout = RatioLayout.of(params, stacked_axes)
    return ScaleByTrustRatioState(ratios=jnp.ones((layout.size,), jnp.float32), layout=layout)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("scale_by_trust_ratio needs params: call update(updates, state, params)")
    _tree.check_same_structure(updates, "updates", params, "params")
    adapt = _tree.resolve_per_leaf(mask, params, True, mask_name, "bool")
    axes = _tree.resolve_stacked_axes(stacked_axes, params)

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
    ratios = state.layout.join([r for _, r in results])
    return updates, ScaleByTrustRatioState(ratios=ratios, layout=state.layout)

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
  # Plain arrays also from a Flax NNX optimizer's state (OptVariable / Param wrappers).
  ratios = tuple(_nnx.plain_values(s.layout.split(_nnx.plain_values(s.ratios))) for s in found)
  return ratios[0] if len(ratios) == 1 else ratios


def _register_with_flax() -> None:
  """Teach flax.serialization (if installed) the static layout: nothing saved, the target's kept."""
  if importlib.util.find_spec("flax") is None:
    return
  try:
    from flax import serialization
  except Exception:  # a broken flax install must not break this package
    return
  serialization.register_serialization_state(
    RatioLayout, lambda _: {}, lambda target, _: target, override=True
  )


_register_with_flax()
