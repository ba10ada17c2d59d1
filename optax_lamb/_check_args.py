"""Validation of hyper-parameters given as Python numbers, at build time."""

from __future__ import annotations

import numbers
from typing import Any


def is_python_number(x: Any) -> bool:
  """True for int/float literals; arrays, tracers and schedules are checked at run time."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_in_unit_interval(name: str, value: Any) -> None:
  if is_python_number(value) and not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {name}={value!r}")


def check_non_negative(name: str, value: Any) -> None:
  if is_python_number(value) and value < 0:
    raise ValueError(f"{name} must be >= 0, got {name}={value!r}")


def check_positive(name: str, value: Any) -> None:
  if is_python_number(value) and not value > 0:
    raise ValueError(f"{name} must be > 0, got {name}={value!r}")


def check_ratio_bounds(min_name: str, min_value: Any, max_name: str, max_value: Any) -> None:
  check_non_negative(min_name, min_value)
  check_non_negative(max_name, max_value)
  if is_python_number(min_value) and is_python_number(max_value) and min_value > max_value:
    raise ValueError(
      f"{min_name} must be <= {max_name}, got {min_name}={min_value!r} > {max_name}={max_value!r}"
    )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}")


def check_bool(name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be True or False, got {name}={value!r}")
