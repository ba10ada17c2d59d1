"""lamb's options, typed: what is fixed when the transformation is built, and the numbers of a step.

`LambOptions` (frozen, hashable: a static argument of the kernels) holds the switches and
the moments' dtypes; `StepScalars` (a pytree) the numbers of one step, each a Python
number (a compile-time constant), a 0-d array (a runtime scalar: a schedule's value, a
hyper-parameter injected by ``optax.inject_hyperparams``) or None (off). `ScalarLayout.of`
is the one place that decides which numbers are constants, by name (the configuration the
step is planned from, with the numbers as given: `optax_lamb.core._config`);
`value_and_next_state` evaluates a schedule and steps its count.
`RatioLayout` is the static layout of a tree's trust ratios, `ScaleByTrustRatioState` the
state that holds them (built by the trust-ratio stage and the planned step alike).

Also the small helpers the layers above share, kept here, at the bottom, so that no two of
them import each other: `psum_if` over mapped axes, and `leaf_info` / `same_kind`, a state
leaf's shape and dtype as `optax_lamb.faults._checks` checks them and
`optax_lamb.faults._explain` describes them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
import optax

Scalar: TypeAlias = float | jax.Array
DecayPlacement: TypeAlias = Literal["direction", "gradient", "params"]
BiasCorrectionPlacement: TypeAlias = Literal["direction", "step_size"]
DECAY_PLACEMENTS: tuple[DecayPlacement, ...] = ("direction", "gradient", "params")
BIAS_CORRECTION_PLACEMENTS: tuple[BiasCorrectionPlacement, ...] = ("direction", "step_size")
AxisNames: TypeAlias = str | tuple[str, ...] | None  # one leaf's mapped axes (None: replicated)


@dataclasses.dataclass(frozen=True)
class LambOptions:
  """The switches of lamb's update, fixed when it is built (the defaults are lamb's own).

  ``weight_decay_placement``: where a decaying leaf's decay acts: ``"direction"``
  (u + wd p, inside the trust ratio: optax, apex, DeepSpeed, timm, TF Addons),
  ``"gradient"`` (g + wd p after the clip, before the moments: L2, apex
  ``adam_w_mode=False``) or ``"params"`` (p shrinks by wd p before the step,
  outside the ratio, whose ||p|| is then the shrunk one: Keras, timm
  ``decoupled_decay``; the step's ``weight_decay`` is then s wd).
  """

  bias_correction: bool = True
  bias_correction_placement: BiasCorrectionPlacement = "direction"  # or lr sqrt(bc2) / bc1
  grad_averaging: bool = True  # False: m = b1 m + g (apex, timm)
  weight_decay_placement: DecayPlacement = "direction"
  caution: bool = False  # timm's cautious update
  adapt_if_decaying: bool = False  # apex, timm: ratio only while the step's weight decay != 0
  finite_guard: bool = False  # ONNX Runtime: non-finite u or p: u 0, m, v kept; new p: old kept
  mu_dtype: np.dtype | None = None  # storage dtype of the moments (None: the param's)
  nu_dtype: np.dtype | None = None

  @property
  def bias_correction_in_direction(self) -> bool:
    return self.bias_correction and self.bias_correction_placement == "direction"

  @property
  def bias_correction_on_step_size(self) -> bool:
    return self.bias_correction and self.bias_correction_placement == "step_size"


class StepScalars(NamedTuple):
  """The numbers of one step, for every leaf: each a Python number, a 0-d array or None (off)."""

  b1: Scalar = 0.9  # decay of the first moment
  b2: Scalar = 0.999  # decay of the second moment
  eps: Scalar = 1e-6  # added to the Adam denominator, outside the square root
  eps_root: Scalar = 0.0  # added to the second moment, inside the square root
  bc1: Scalar = 1.0  # 1 - b1^t (1 without bias correction)
  bc2: Scalar = 1.0  # 1 - b2^t
  weight_decay: Scalar = 0.0  # lambda at this step (decaying leaves); "params": s lambda
  step_size: Scalar = -1.0  # -learning rate at this step
  clip_factor: Scalar | None = None  # min(1, max_norm / ||g||_global); None: no clipping
  min_ratio: Scalar | None = None  # lower clamp of the ratio
  max_ratio: Scalar | None = None  # upper clamp of the ratio
  max_param_norm: Scalar | None = None  # clamp of ||p|| in the ratio's numerator
  min_norm: Scalar = 0.0  # floor of both norms (optax's safe_norm)
  trust_coefficient: Scalar = 1.0  # gamma, multiplies the clamped ratio
  ratio_eps: Scalar = 0.0  # added to ||u|| in the ratio's denominator
  take: Scalar | None = None  # the step is applied (non-zero) or skipped (0); None: always applied
  adapt_gate: Scalar | None = None  # adapted slots get ratio 1 where this is 0; None: no gate


def is_constant(value: Any) -> bool:
  """A compile-time constant: a Python number or None (an array is a runtime scalar)."""
  return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


@dataclasses.dataclass(frozen=True)
class ScalarLayout:
  """Which numbers of a step are constants (with their values) and which are runtime operands.

  Static (hashable): a kernel takes it as a static argument, and the runtime
  values as one operand vector with an entry per `StepScalars` field (`index`).
  """

  constants: tuple[tuple[str, float | None], ...]
  runtime: tuple[str, ...]

  @classmethod
  def of(cls, scalars: StepScalars) -> tuple[ScalarLayout, dict[str, jax.Array]]:
    """(the layout of `scalars`, their runtime values by name)."""
    items = scalars._asdict().items()
    constants = tuple((k, None if v is None else float(v)) for k, v in items if is_constant(v))
    runtime = {k: jnp.asarray(v) for k, v in items if not is_constant(v)}
    return cls(constants, tuple(runtime)), runtime

  def join(self, values: Mapping[str, Any]) -> StepScalars:
    """The step's scalars from the runtime `values` (by name: a dict, or the `vector`'s ref)."""
    fields: dict[str, Any] = dict(self.constants)
    fields.update((k, values[k]) for k in self.runtime)
    return StepScalars(**fields)

  @staticmethod
  def index(name: str) -> int:
    """The position of the field `name` in `vector`."""
    return StepScalars._fields.index(name)

  def vector(self, values: Mapping[str, jax.Array]) -> jax.Array:
    """The runtime values as one float32 vector, an entry per field (0 for a constant), its
    length a power of two (Triton shapes)."""
    fields = StepScalars._fields
    entries = [jnp.asarray(values[k], jnp.float32) if k in values else 0.0 for k in fields]
    size = 1 << (len(entries) - 1).bit_length()
    return jnp.stack(
      [jnp.asarray(x, jnp.float32) for x in entries]
      + [jnp.zeros((), jnp.float32)] * (size - len(entries))
    )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RatioLayout:
  """Where each leaf's trust ratios sit in the state's ratio vector. Static: no arrays.

  Leaf ``i`` (in ``jax.tree.leaves`` order of the params) owns the entries
  ``offsets[i]:offsets[i + 1]``, reshaped to ``shapes[i]``: ``()`` for a plain
  leaf, the leading stacked axes of a stacked one.

  Attributes:
    treedef: the params' tree structure.
    shapes: per leaf, the shape of its ratios.
    offsets: per leaf, where its entries start, then the vector's length.
    size: the vector's length.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> params = {"layers": jnp.ones((2, 3)), "bias": jnp.ones(3)}
    >>> tx = optax_lamb.scale_by_trust_ratio(stacked_axes={"layers": 1, "bias": 0})
    >>> layout = tx.init(params).layout
    >>> print(layout.shapes, layout.offsets)
    ((), (2,)) (0, 1, 3)
  """

  treedef: Any  # of the params
  shapes: tuple[tuple[int, ...], ...]

  def __hash__(self) -> int:  # every jitted call hashes its arguments' static data: once here
    return self._hash

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, RatioLayout):
      return NotImplemented
    if self.treedef is None or other.treedef is None:  # LAYOUT_UNKNOWN stands for any layout
      return True
    return (self.treedef, self.shapes) == (other.treedef, other.shapes)

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.treedef, self.shapes))

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    return tuple(itertools.accumulate((math.prod(s) for s in self.shapes), initial=0))

  @property
  def size(self) -> int:
    return self.offsets[-1]

  def join(self, ratios: Sequence[jax.Array]) -> jax.Array:
    """One replicated vector from the per-leaf pieces (in leaf order), in float32 or wider
    (float64 pieces stay so: the state stores them in float32, `ScaleByTrustRatioState`)."""
    if not ratios:  # a tree emptied by optax.masked
      return jnp.ones((0,), jnp.float32)
    dtype = jnp.promote_types(jnp.result_type(*ratios), jnp.float32)
    return jnp.concatenate([jnp.reshape(replicated(r), (-1,)).astype(dtype) for r in ratios])

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

  def per_slot(self, per_leaf: Sequence[Any]) -> list[Any]:
    """A per-leaf list of values repeated for each of the leaf's slots (static, Python values)."""
    return [
      v for v, shape in zip(per_leaf, self.shapes, strict=True) for _ in range(math.prod(shape))
    ]


def replicated(x: jax.Array) -> jax.Array:
  """`x` replicated where its type says it is sharded (a stacked leaf's ratios: ``concatenate``
  takes operands of one sharding only; the gather is ratio-sized)."""
  sharding = jax.typeof(x).sharding
  if any(entry is not None for entry in getattr(sharding, "spec", ())):
    whole = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.reshard(x, whole)
  return x


# ------------------------------------------------------------------------------- schedules


def _is_count_state(x: Any) -> bool:
  return isinstance(x, tuple) and getattr(x, "_fields", None) == ("count",)


def value_and_next_state(value: Any, state: Any) -> tuple[Any, Any]:
  """(value at this step, state after it) for a number, an array or a schedule ``count -> value``.

  A schedule's step count lives in a NamedTuple with a ``count`` field
  (:class:`optax.ScaleByScheduleState`, :class:`optax_lamb.UnscaleGradientsState`),
  possibly nested (``optax.masked``): the value is taken at that count and every
  count in `state` is incremented. Numbers and arrays need no count.
  """
  if not callable(value):
    return value, state
  counts = [s for s in jax.tree.leaves(state, is_leaf=_is_count_state) if _is_count_state(s)]
  if not counts:
    raise ValueError(f"a schedule needs a step count in its state, got state={state!r}")
  next_state = jax.tree.map(
    lambda s: s._replace(count=optax.safe_increment(s.count)), state, is_leaf=_is_count_state
  )
  return value(counts[0].count), next_state


def grad_scale_at_step(built: Any, given: Any, state: Any) -> tuple[Any, Any]:
  """(the loss scale of this step or None, the state after it): the scale given to the
  constructor (a number, an array or a schedule), or the one given to ``update``, not both."""
  if given is not None and built is not None:
    raise ValueError(
      "grad_scale was given both when building the optimizer and to update(); give it "
      f"in one place only (got grad_scale={given!r} at update)."
    )
  scale, state = value_and_next_state(built, state)
  return (given if given is not None else scale), state


def is_axis_name(x: object) -> TypeGuard[AxisNames]:
  """True for one mapped-axis name (a str), a tuple of names, or None (not sharded)."""
  if x is None or isinstance(x, str):
    return True
  return type(x) is tuple and len(x) > 0 and all(isinstance(a, str) for a in x)


def psum_if(x: jax.Array, axis_name: AxisNames) -> jax.Array:
  """Sum over the named mapped axes (shard_map/pmap) when `axis_name` is given."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def psum_by_name(pieces: Sequence[jax.Array], names: Sequence[Any]) -> list[jax.Array]:
  """Each piece summed over its own axis names (None: not sharded): one psum per distinct name,
  over the pieces of that name concatenated (a replicated piece stays replicated)."""
  out = list(pieces)
  for name in dict.fromkeys(names):
    if name is None:
      continue
    idx = [i for i, n in enumerate(names) if n == name]
    sizes = [math.prod(jnp.shape(pieces[i])) for i in idx]
    summed = jax.lax.psum(jnp.concatenate([jnp.ravel(pieces[i]) for i in idx]), name)
    for i, a, b in zip(idx, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
      out[i] = jnp.reshape(summed[a:b], jnp.shape(pieces[i]))
  return out


def same_kind(got: np.dtype, want: Any) -> bool:
  """Whether a state leaf's dtype `got` is what init gives (`want`)."""
  if jnp.issubdtype(want, jnp.integer):  # step counts: any integer width (a restore may widen)
    return jnp.issubdtype(got, jnp.integer)
  return got == np.dtype(want)


def leaf_info(x: Any) -> tuple[tuple[int, ...], np.dtype] | None:
  """(shape, dtype) of an array-like leaf; None for anything else (a string, an object).

  A ``jax.ShapeDtypeStruct`` (what ``jax.eval_shape(init, params)`` gives) has no
  values: inside ``jit``/``eval_shape`` the state's leaves are tracers instead.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return None
  try:
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.asarray(x).dtype  # a str: TypeError
    return tuple(jnp.shape(x)), dtype
  except TypeError:
    return None


# The layout in the state init gives for optax.tree_map_params' placeholder, which has no shapes:
# it equals every layout, so the mapping pairs it with the state's own; the mapped state carries
# it, and update puts the params' layout back (`with_layouts_of`). Never read for its offsets.
LAYOUT_UNKNOWN = RatioLayout(treedef=None, shapes=())


def with_layouts_of(expected: Any, state: Any) -> Any:
  """`state` with the trust-ratio layouts of `expected` (``init``'s state for these params, of the
  same structure): a state mapped by optax.tree_map_params carries `LAYOUT_UNKNOWN`, a Flax NNX
  state layouts whose tree metadata differs from init's."""
  is_layout = lambda x: isinstance(x, RatioLayout)
  wanted = iter([x for x in jax.tree.leaves(expected, is_leaf=is_layout) if is_layout(x)])
  treedef: Any
  leaves, treedef = jax.tree.flatten(state, is_leaf=is_layout)
  return treedef.unflatten([next(wanted) if is_layout(x) else x for x in leaves])


class ScaleByTrustRatioState(NamedTuple):
  """The trust ratios of the last update: one float32 vector for the whole tree (one buffer, as
  a jitted call pays host time per buffer), and its layout (:func:`optax_lamb.trust_ratios`).

  Attributes:
    ratios: float32 vector, one entry per leaf (or per stacked slice), in the order
      that ``layout`` gives; ones before the first update.
    layout: the static :class:`RatioLayout` (no arrays) that maps entries to leaves.

  Example (leaves in ``jax.tree.leaves`` order: bias, then one entry per layer):
    >>> import jax, jax.numpy as jnp, optax_lamb
    >>> params = {"layers": jnp.stack([jnp.ones(3), 2 * jnp.ones(3)]), "bias": jnp.ones(3)}
    >>> tx = optax_lamb.scale_by_trust_ratio(stacked_axes={"layers": 1, "bias": 0})
    >>> _, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    >>> print([round(r, 4) for r in state.ratios.tolist()], state.ratios.dtype)
    [1.0, 1.0, 2.0] float32
  """

  ratios: jax.Array
  layout: RatioLayout

  @classmethod
  def after_step(cls, ratios: jax.Array, layout: RatioLayout) -> ScaleByTrustRatioState:
    """The state of the ratios a step applied, in float32 (as `init` makes them)."""
    return cls(ratios=ratios.astype(jnp.float32), layout=layout)
