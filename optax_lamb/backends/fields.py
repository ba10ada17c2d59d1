"""Checks of a backend configuration's fields, run when it is constructed: a bad value raises
naming the class, the field and the value (it used to pass silently, or fail at the first step
inside the backend with an internal error)."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

_BOOLS = (bool, np.bool_)


def check_size(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
  """An integer >= 0 (Python or NumPy; not a bool), or None where `optional`."""
  if optional and value is None:
    return
  what = "an int >= 0" + (" or None" if optional else "")
  if isinstance(value, _BOOLS) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{owner}.{name} must be {what}, got {name}={value!r}")
  if value < 0:
    raise ValueError(f"{owner}.{name} must be {what}, got {name}={value!r}")


def check_optional_bool(owner: str, name: str, value: Any) -> None:
  """True, False or None (None: the backend decides)."""
  if value is not None and not isinstance(value, _BOOLS):
    raise TypeError(f"{owner}.{name} must be True, False or None, got {name}={value!r}")


def check_instance(owner: str, name: str, value: Any, cls: type) -> None:
  if not isinstance(value, cls):
    raise TypeError(
      f"{owner}.{name} must be a {cls.__name__} instance, got {name}={value!r} "
      f"({type(value).__name__})"
    )
