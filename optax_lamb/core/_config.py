"""lamb's configuration as built: the switches, the numbers as given, the per-leaf options.

`LambConfig` is the one description of a lamb step that every implementation reads (the
XLA path and the kernels through `optax_lamb.step._plan`, the stage chain through
`optax_lamb.step._reference`). `optax_lamb.faults._check_args.lamb_config` is the one place
that builds it from arguments and checks them, for `optax_lamb.lamb` and every
``optax_lamb.compat`` constructor; the rest of the package takes it as checked.

The per-leaf options' types: each is one value for every leaf, a pytree prefix of the
params (a None entry: that subtree's default) or a callable(params) returning one; any
pytree node type is accepted (the aliases name the usual ones, mappings and sequences).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import optax

from optax_lamb.core._options import AxisNames, LambOptions, Scalar

MaskTree: TypeAlias = "bool | np.bool_ | None | Mapping[Hashable, MaskTree] | Sequence[MaskTree]"
AxesTree: TypeAlias = "int | None | Mapping[Hashable, AxesTree] | Sequence[AxesTree]"
AxisNameTree: TypeAlias = "AxisNames | Mapping[Hashable, AxisNameTree] | Sequence[AxisNameTree]"
PerLeafMask: TypeAlias = "MaskTree | Callable[[optax.Params], MaskTree]"  # True: the leaf takes it
PerLeafAxes: TypeAlias = "AxesTree | Callable[[optax.Params], AxesTree]"  # leading stacked axes
PerLeafAxisNames: TypeAlias = "AxisNameTree | Callable[[optax.Params], AxisNameTree]"


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


# The hyper-parameters a step takes as given: name in `Hyperparams` -> name in
# `optax_lamb.core._options.StepScalars`. The one place a number's name changes between the
# two; `optax_lamb.step._plan.given_scalars` reads it for every implementation. The others
# enter a step computed (learning_rate: step_size, max_grad_norm: clip_factor, weight_decay:
# its value at the step) or not as a number (clip_norm_eps, decay_base_lr).
STEP_SCALAR_NAMES: Mapping[str, str] = MappingProxyType(
  {
    "b1": "b1",
    "b2": "b2",
    "eps": "eps",
    "eps_root": "eps_root",
    "min_trust_ratio": "min_ratio",
    "max_trust_ratio": "max_ratio",
    "max_param_norm": "max_param_norm",
  }
)


@dataclasses.dataclass(frozen=True, eq=False)
class PerLeafOptions:
  """Options given per leaf; resolved against the params at each step
  (`optax_lamb.faults._checks.resolve_per_leaf`)."""

  mask: PerLeafMask = None  # weight-decay mask
  trust_ratio_mask: PerLeafMask = None
  stacked_axes: PerLeafAxes = None
  axis_name: PerLeafAxisNames = None


class LambConfig(NamedTuple):
  """A lamb transformation's configuration, as built: switches, numbers, per-leaf options."""

  options: LambOptions
  hyper: Hyperparams
  per_leaf: PerLeafOptions

  @classmethod
  def of(cls, **fields: object) -> LambConfig:
    """The configuration from its fields by name (each a field of one of the three objects),
    unchecked: `optax_lamb.faults._check_args.lamb_config` builds it and checks it."""
    names = [{f.name for f in dataclasses.fields(t)} for t in (LambOptions, PerLeafOptions)]
    names.insert(1, set(Hyperparams._fields))
    parts: list[dict[str, Any]] = [
      {k: fields.pop(k) for k in list(fields) if k in group} for group in names
    ]
    if fields:
      raise TypeError(f"unknown lamb configuration fields: {sorted(fields)}")
    return cls(LambOptions(**parts[0]), Hyperparams(**parts[1]), PerLeafOptions(**parts[2]))
