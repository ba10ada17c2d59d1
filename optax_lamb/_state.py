"""lamb's state, owned here: the trust-ratio state and its static layout, and named parts of the tuple.

lamb's state is the tuple of its stage states, (clip, Adam, decay, trust ratio,
learning rate), as ``optax.chain`` makes it: checkpoints hold that tuple, so it
stays a plain tuple, and `LambStateParts` names its parts for the code.
"""

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

from optax_lamb import _tree


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
    """One replicated vector from the per-leaf ratios (in leaf order), in float32 or wider.

    float64 pieces (float64 params) stay float64: the step uses the vector before
    the state stores it in float32 (`ScaleByTrustRatioState.after_step`).
    """
    if not ratios:  # a tree emptied by optax.masked
      return jnp.ones((0,), jnp.float32)
    dtype = jnp.promote_types(jnp.result_type(*ratios), jnp.float32)
    return jnp.concatenate([jnp.reshape(_replicated(r), (-1,)).astype(dtype) for r in ratios])

  def pieces(self, vector: jax.Array) -> list[jax.Array]:
    """The per-leaf ratios (in leaf order, stacked shapes); leading batch axes (pmap, vmap) kept."""
    batch = jnp.shape(vector)[:-1]
    return [
      jnp.reshape(vector[..., a:b], batch + shape)
      for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes, strict=True)
    ]

  def split(self, vector: jax.Array) -> Any:
    """The per-leaf pytree of ratios; leading batch axes of `vector` (pmap, vmap) are kept."""
    return jax.tree.unflatten(self.treedef, self.pieces(vector))

  def per_slot(self, per_leaf: list) -> list:
    """A per-leaf list of values repeated for each of the leaf's slots (static, Python values)."""
    return [
      value
      for value, shape in zip(per_leaf, self.shapes, strict=True)
      for _ in range(math.prod(shape))
    ]

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


def _replicated(x: jax.Array) -> jax.Array:
  """`x` replicated where its type says it is sharded (a mesh of Explicit axes).

  There a stacked leaf's ratios carry the sharding of its stacked axes, and
  ``concatenate`` takes operands of one sharding only; the gather is ratio-sized.
  """
  sharding = jax.typeof(x).sharding
  if any(entry is not None for entry in getattr(sharding, "spec", ())):
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.reshard(x, replicated)
  return x


class ScaleByTrustRatioState(NamedTuple):
  """The trust ratios of the last update: one float32 vector for the whole tree, and its layout.

  One buffer whatever the number of leaves (each jitted call pays host time per
  input buffer); read the per-leaf ratios with :func:`optax_lamb.trust_ratios`.
  """

  ratios: jax.Array
  layout: RatioLayout

  @classmethod
  def after_step(cls, ratios: jax.Array, layout: RatioLayout) -> ScaleByTrustRatioState:
    """The state holding the ratios a step applied, stored in float32 (as `init` makes them)."""
    return cls(ratios=ratios.astype(jnp.float32), layout=layout)


class LambStateParts(NamedTuple):
  """The parts of lamb's state tuple, by name (the state itself is ``tuple(parts)``)."""

  clip: Any  # optax.EmptyState
  adam: optax.ScaleByAdamState
  decay: Any  # optax.EmptyState, or the count of a weight-decay schedule (maybe masked)
  trust_ratio: ScaleByTrustRatioState
  learning_rate: Any  # optax.EmptyState, or the count of a learning-rate schedule

  @classmethod
  def of(cls, state: tuple) -> LambStateParts:
    """The named parts of a state the prologue has checked against init (a 5-tuple)."""
    return cls(*state)

  def as_state(self) -> tuple:
    return tuple(self)


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
