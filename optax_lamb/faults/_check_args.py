"""Checks of the arguments a transformation is built with; each error names the argument and value.

`lamb_config` builds lamb's configuration and checks every field of it, the one place
for `optax_lamb.lamb` and the compat constructors; the public stages check their own
arguments with the same groups of checks (`check_adam_args`, `check_decay_args`,
`check_trust_ratio_args`).

Python and NumPy numbers are checked by value. A jax array may be a tracer
(``optax.inject_hyperparams`` passes the numeric hyper-parameters as arrays,
under jit), so only its shape and dtype are checked; a callable is a schedule
(or, for a per-leaf option, a function of the params) and is checked when called.
NaN fails every comparison, so each check states what is allowed
(``0 <= x < inf``), never what is not.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core._config import Hyperparams, LambConfig
from optax_lamb.core._options import (
  BIAS_CORRECTION_PLACEMENTS,
  DECAY_PLACEMENTS,
  LambOptions,
  is_axis_name,
)

_BOOLS = (bool, np.bool_)


def _number(name: str, value: Any, must: str, schedule: bool) -> float | None:
  """The value to check, or None where only run time knows it (a jax array, a schedule)."""
  if isinstance(value, _BOOLS):
    pass
  elif isinstance(value, numbers.Real):
    return float(value)
  elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
    real = jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)
    if value.ndim == 0 and real:
      return None if isinstance(value, jax.Array) else float(value)
  elif schedule and callable(value):
    return None
  raise TypeError(f"{name} must be {must}, got {name}={value!r}")


def number(name: str, value: Any, what: str = "a number") -> float | None:
  """`value` as a float, or None for a scalar jax array, which may be a tracer: what a
  constructor decides from its value it then decides at each step (see the module docstring)."""
  return _number(name, value, f"{what} or a scalar array", schedule=False)


def _check_number(name: str, value: Any, ok, what: str, schedule: bool) -> None:
  either = ", a scalar array or a schedule (count -> value)" if schedule else " or a scalar array"
  must = what + either
  x = _number(name, value, must, schedule)
  if x is not None and not ok(x):
    raise ValueError(f"{name} must be {what}, got {name}={value!r}")


def check_in_unit_interval(name: str, value: Any) -> None:
  _check_number(name, value, lambda x: 0.0 <= x < 1.0, "a number in [0, 1)", schedule=False)


def check_non_negative(name: str, value: Any, *, schedule: bool = False) -> None:
  _check_number(name, value, lambda x: 0.0 <= x < math.inf, "a finite number >= 0", schedule)


def check_positive(name: str, value: Any, *, schedule: bool = False) -> None:
  _check_number(name, value, lambda x: 0.0 < x < math.inf, "a finite number > 0", schedule)


def check_count(name: str, value: Any) -> None:
  """An integer >= 0 (Python or NumPy; not a bool), or a scalar integer jax array (only its
  shape and dtype: it may be a tracer, as ``optax.inject_hyperparams`` passes it)."""
  if isinstance(value, jax.Array) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer):
    return
  if isinstance(value, _BOOLS) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an integer >= 0, got {name}={value!r}")
  if value < 0:
    raise ValueError(f"{name} must be an integer >= 0, got {name}={value!r}")


def check_some_eps(eps_name: str, eps: Any, root_name: str, eps_root: Any) -> None:
  """Not both 0: a zero gradient element would then make 0 / 0 in the Adam direction (NaN)."""
  given = [v for v in (eps, eps_root) if isinstance(v, numbers.Real) and not isinstance(v, _BOOLS)]
  if len(given) == 2 and eps == 0 and eps_root == 0:
    raise ValueError(
      f"{eps_name} must be > 0 when {root_name} is 0 (else an element whose gradient is 0 "
      f"gets 0 / 0 = NaN), got {eps_name}={eps!r}, {root_name}={eps_root!r}"
    )


def check_ratio_bounds(min_name: str, min_value: Any, max_name: str, max_value: Any) -> None:
  """Optional (None) clamps, each finite and >= 0, the lower one <= the upper one."""
  for name, value in ((min_name, min_value), (max_name, max_value)):
    if value is not None:
      check_non_negative(name, value)
  if all(isinstance(v, numbers.Real) for v in (min_value, max_value)) and min_value > max_value:
    raise ValueError(
      f"{min_name} must be <= {max_name}, got {min_name}={min_value!r} > {max_name}={max_value!r}"
    )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if not (isinstance(value, str) and value in choices):
    raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}")


def check_bool(name: str, value: Any) -> None:
  if not isinstance(value, _BOOLS):
    raise TypeError(f"{name} must be True or False, got {name}={value!r}")


def check_float_dtype(name: str, value: Any, *, optional: bool = True) -> np.dtype | None:
  """The dtype `value` names, which must be a floating-point one (None passes if `optional`)."""
  if value is None and optional:
    return None
  try:
    dtype = None if value is None else jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"{name} must be {'None or ' if optional else ''}a floating-point dtype "
      f"(float32, bfloat16, float16), got {name}={value!r}"
    )
  return dtype


_QUANTIZED = {
  "mu_dtype": ("int8", "the first moment, signed"),
  "nu_dtype": ("uint8", "the second moment, unsigned"),
}


def check_moment_dtype(name: str, value: Any) -> np.dtype | None:
  """A moment's storage dtype (`name` is "mu_dtype" or "nu_dtype"): None, a floating-point
  dtype, or the 8-bit dtype that selects block-wise quantized storage for that moment
  (int8 for mu, uint8 for nu; `optax_lamb.core._moment_storage`); the other 8-bit one raises."""
  try:
    dtype = None if value is None else jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype not in (np.dtype(np.int8), np.dtype(np.uint8)):
    return check_float_dtype(name, value)
  want, what = _QUANTIZED[name]
  if dtype != np.dtype(want):
    other = next(n for n, (d, _) in _QUANTIZED.items() if d == dtype.name)
    raise ValueError(
      f"{name}={dtype.name}: 8-bit moments are block-wise quantized, and {dtype.name} selects the "
      f"map of {_QUANTIZED[other][1]} ({other}); {name} ({what}) takes jnp.{want}"
    )
  return dtype


def check_transformation(name: str, value: Any) -> None:
  if not all(callable(getattr(value, f, None)) for f in ("init", "update")):
    raise TypeError(f"{name} must be an optax.GradientTransformation, got {name}={value!r}")


def check_per_leaf(name: str, value: Any, kind: str) -> None:
  if value is not None and not callable(value):
    check_per_leaf_values(name, value, kind)


def check_axis_name(name: str, value: Any) -> None:
  if callable(value):
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(value, is_leaf=is_axis_name)[0]:
    if not is_axis_name(leaf):
      raise TypeError(
        f"{name} must be None, a mapped axis name (str), a tuple of names, a pytree of those "
        f"or a callable(params) returning one; got {name}{jax.tree_util.keystr(path)}={leaf!r}"
      )


def check_adam_args(
  b1: Any,
  b2: Any,
  eps: Any,
  eps_root: Any,
  bias_correction: Any,
  grad_averaging: Any,
  mu_dtype: Any,
  nu_dtype: Any,
) -> tuple[np.dtype | None, np.dtype | None]:
  """The Adam stage's arguments (lamb's too, by the same names); the moments' dtypes as
  NumPy dtypes."""
  check_in_unit_interval("b1", b1)
  check_in_unit_interval("b2", b2)
  check_non_negative("eps", eps)
  check_non_negative("eps_root", eps_root)
  check_some_eps("eps", eps, "eps_root", eps_root)
  check_bool("bias_correction", bias_correction)
  check_bool("grad_averaging", grad_averaging)
  return check_moment_dtype("mu_dtype", mu_dtype), check_moment_dtype("nu_dtype", nu_dtype)


def check_decay_args(weight_decay: Any, mask: Any) -> None:
  """The decay stage's arguments (lamb's too, by the same names)."""
  check_non_negative("weight_decay", weight_decay, schedule=True)
  check_per_leaf("mask", mask, "bool")


def check_trust_ratio_args(
  mask: tuple[str, Any],
  min_ratio: tuple[str, Any],
  max_ratio: tuple[str, Any],
  axes: Any,
  names: Any,
) -> None:
  """The trust-ratio stage's per-leaf options and clamps, each a (name, value) as the caller
  spells it (lamb: ``trust_ratio_mask``, ``min_trust_ratio``, ``max_trust_ratio``)."""
  check_per_leaf(*mask, "bool")
  check_ratio_bounds(*min_ratio, *max_ratio)
  check_per_leaf("stacked_axes", axes, "int")
  check_axis_name("axis_name", names)


def lamb_config(
  *, learning_rate_name: str = "learning_rate", library_clip: bool = False, **fields: object
) -> LambConfig:
  """lamb's configuration from its fields by name, checked: the one place that builds one.

  Every field is checked, each error naming the argument and its value; the moments'
  dtypes become NumPy dtypes and a schedule one that refuses non-scalar values.
  `learning_rate_name`: the learning rate's name in the caller's signature. With
  `library_clip`, ``max_grad_norm`` is a library's threshold, checked by its constructor
  under the library's name and rules (0 zeroes every gradient, inf clips none); else lamb's,
  a finite number > 0.
  """
  o, h, per_leaf = LambConfig.of(**fields)
  check_non_negative(learning_rate_name, h.learning_rate, schedule=True)
  mu_dtype, nu_dtype = check_adam_args(
    h.b1, h.b2, h.eps, h.eps_root, o.bias_correction, o.grad_averaging, o.mu_dtype, o.nu_dtype
  )
  check_decay_args(h.weight_decay, per_leaf.mask)
  check_trust_ratio_args(
    ("trust_ratio_mask", per_leaf.trust_ratio_mask),
    ("min_trust_ratio", h.min_trust_ratio),
    ("max_trust_ratio", h.max_trust_ratio),
    per_leaf.stacked_axes,
    per_leaf.axis_name,
  )
  if h.max_grad_norm is not None and not library_clip:
    check_positive("max_grad_norm", h.max_grad_norm)
  _check_variant_fields(o, h)
  return LambConfig(
    dataclasses.replace(o, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
    h._replace(
      learning_rate=scalar_valued(h.learning_rate, "learning_rate"),
      weight_decay=scalar_valued(h.weight_decay, "weight_decay"),
    ),
    per_leaf,
  )


def _check_variant_fields(o: LambOptions, h: Hyperparams) -> None:
  """The fields only the compat constructors set (from arguments they check themselves,
  under their own names): what each must be for the step to compute their variant."""
  for name in ("caution", "adapt_if_decaying", "finite_guard"):
    check_bool(name, getattr(o, name))
  check_choice("weight_decay_placement", o.weight_decay_placement, DECAY_PLACEMENTS)
  check_choice("bias_correction_placement", o.bias_correction_placement, BIAS_CORRECTION_PLACEMENTS)
  check_non_negative("clip_norm_eps", h.clip_norm_eps)
  if h.max_param_norm is not None:
    check_non_negative("max_param_norm", h.max_param_norm)
  if o.adapt_if_decaying and callable(h.weight_decay):  # the gate is read as a number (_ratios)
    raise ValueError(
      "weight_decay must be a number or a scalar array where it decides which leaves adapt "
      f"(apex, timm), got weight_decay={h.weight_decay!r}"
    )


@dataclasses.dataclass(frozen=True)
class ScalarValued:
  """A schedule that refuses a value that is not a scalar, naming its argument."""

  schedule: Callable[[Any], Any]
  name: str

  def __call__(self, count: Any) -> Any:
    out = self.schedule(count)
    if jnp.ndim(out) != 0:
      raise ValueError(
        f"{self.name} must be a schedule whose values are scalars, got {self.name}(count) of "
        f"shape {jnp.shape(out)}"
      )
    return out


def scalar_valued(value: Any, name: str) -> Any:
  """`value`; for a schedule, one that refuses a value that is not a scalar, naming `name`.

  The check runs when the step is traced (the value's shape is static), on every
  implementation: a schedule returning shape (2,) would otherwise broadcast a
  0-d param to shape (2,) on one path and fail with a stacking error on another.
  """
  if not callable(value) or isinstance(value, ScalarValued):
    return value
  return ScalarValued(value, name)


_KINDS = {"bool": "True or False", "int": "an int >= 0"}


def _leaf_error(kind: str, leaf: Any) -> type[Exception] | None:
  """None for a valid value of a per-leaf option of `kind`, else the error to raise."""
  if kind == "bool":
    return None if isinstance(leaf, _BOOLS) else TypeError
  if not isinstance(leaf, numbers.Integral) or isinstance(leaf, _BOOLS):
    return TypeError
  return None if int(leaf) >= 0 else ValueError


def check_per_leaf_values(name: str, value: Any, kind: str) -> None:
  """Every leaf of the pytree `value` is of `kind` ("bool" or "int"); None leaves are allowed."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
    error = _leaf_error(kind, leaf)
    if error is not None:
      raise error(
        f"{name} must be None, {_KINDS[kind]}, a pytree of those (a prefix of the params) or a "
        f"callable(params) returning one; got {name}{jax.tree_util.keystr(path)}={leaf!r}"
      )
