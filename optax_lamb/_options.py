"""lamb's options, typed: what is fixed when the transformation is built, and the numbers of a step.

Two objects describe a step:

* `LambOptions`, frozen and hashable: the switches (placements, bias correction,
  caution) and the moments' storage dtypes. Kernels take it as a static argument.
* `StepScalars`, a pytree: the numbers of one step (betas, eps, the learning rate
  and weight decay at this step, bias corrections, clip factor, ratio clamps). A
  field is a Python number (a compile-time constant), a 0-d array (a runtime
  scalar: a schedule's value, a bias correction, a hyper-parameter injected by
  ``optax.inject_hyperparams``) or None (the option is off: no clip, no clamp).

`ScalarLayout.of` is the one place that decides which numbers are constants and
which travel as runtime operands, by name. `Hyperparams` holds the numbers as
given to the constructor (numbers, arrays or schedules); `value_and_next_state`
is where a schedule is evaluated and its count stepped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax

Scalar: TypeAlias = float | jax.Array
DecayPlacement: TypeAlias = Literal["direction", "gradient", "params"]
BiasCorrectionPlacement: TypeAlias = Literal["direction", "step_size"]
DECAY_PLACEMENTS: tuple[DecayPlacement, ...] = ("direction", "gradient", "params")


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
  # apex, timm: an adapted leaf keeps its ratio only while the weight decay is not 0, read at
  # each step (`StepScalars.adapt_gate`): an injected weight decay is only known then.
  adapt_if_decaying: bool = False
  mu_dtype: np.dtype | None = None  # storage dtype of the moments (None: the param's)
  nu_dtype: np.dtype | None = None

  @property
  def bias_correction_in_direction(self) -> bool:
    return self.bias_correction and self.bias_correction_placement == "direction"

  @property
  def bias_correction_on_step_size(self) -> bool:
    return self.bias_correction and self.bias_correction_placement == "step_size"


class Hyperparams(NamedTuple):
  """lamb's numeric hyper-parameters as given: numbers, arrays or schedules; None where off."""

  learning_rate: optax.ScalarOrSchedule
  b1: Scalar = 0.9
  b2: Scalar = 0.999
  eps: Scalar = 1e-6
  eps_root: Scalar = 0.0
  weight_decay: optax.ScalarOrSchedule = 0.0
  max_grad_norm: Scalar | None = None
  clip_norm_eps: Scalar = 0.0  # the clip compares ||g|| + clip_norm_eps with max_grad_norm
  min_trust_ratio: Scalar | None = None
  max_trust_ratio: Scalar | None = None
  max_param_norm: Scalar | None = None  # clamp of ||p|| in the ratio (torch_optimizer)
  decay_base_lr: Scalar | None = None  # "params" placement: s = lr_t, or lr_t^2 / decay_base_lr


@dataclasses.dataclass(frozen=True, eq=False)
class PerLeafOptions:
  """Options given per leaf (a value, a pytree prefix of the params, or a callable(params));
  resolved against the params at each step (`optax_lamb._checks.resolve_per_leaf`)."""

  mask: Any = None  # weight-decay mask
  trust_ratio_mask: Any = None
  stacked_axes: Any = None
  axis_name: Any = None


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


# ------------------------------------------------------------------------------- schedules


def _is_count_state(x: Any) -> bool:
  return isinstance(x, tuple) and getattr(x, "_fields", None) == ("count",)


def scalar_valued(value: Any, name: str) -> Any:
  """`value`; for a schedule, one that refuses a value that is not a scalar, naming `name`.

  The check runs when the step is traced (the value's shape is static), on every
  implementation: a schedule returning shape (2,) would otherwise broadcast a
  0-d param to shape (2,) on one path and fail with a stacking error on another.
  """
  if not callable(value) or getattr(value, "_scalar_valued", False):
    return value

  @functools.wraps(value)
  def schedule(count: jax.Array) -> jax.Array:
    out = value(count)
    if jnp.ndim(out) != 0:
      raise ValueError(
        f"{name} must be a schedule whose values are scalars, got {name}(count) of shape "
        f"{jnp.shape(out)}"
      )
    return out

  schedule._scalar_valued = True  # type: ignore[attr-defined]
  return schedule


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


def is_axis_name(x: Any) -> bool:
  """True for one mapped-axis name (a str), a tuple of names, or None (not sharded)."""
  if x is None or isinstance(x, str):
    return True
  return type(x) is tuple and len(x) > 0 and all(isinstance(a, str) for a in x)


class LambConfig(NamedTuple):
  """A lamb transformation's configuration, as built: switches, numbers, per-leaf options."""

  options: LambOptions
  hyper: Hyperparams
  per_leaf: PerLeafOptions

  @classmethod
  def of(cls, **fields: Any) -> LambConfig:
    """The configuration from its fields by name (each field of one of the three objects)."""
    parts = [
      {k: fields.pop(k) for k in list(fields) if k in names}
      for names in (
        {f.name for f in dataclasses.fields(LambOptions)},
        set(Hyperparams._fields),
        {f.name for f in dataclasses.fields(PerLeafOptions)},
      )
    ]
    if fields:
      raise TypeError(f"unknown lamb configuration fields: {sorted(fields)}")
    return cls(LambOptions(**parts[0]), Hyperparams(**parts[1]), PerLeafOptions(**parts[2]))
