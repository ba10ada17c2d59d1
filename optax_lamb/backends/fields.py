"""Backend configurations check their fields when they are made: a bad value raises naming the
class, the field and the value (it used to pass silently, or fail at the first step inside the
backend with an internal error)."""

from __future__ import annotations

import dataclasses
import numbers
import typing
from typing import Any

import numpy as np

_BOOLS = (bool, np.bool_)


class Checked:
  """Base of a backend's configuration (a frozen dataclass): each field is checked against its
  annotation when an instance is made (``dataclasses.replace`` too): ``int`` is a size (an int
  >= 0, NumPy's too, not a bool), ``bool`` True or False (NumPy's too), a class an instance of
  it; ``X | None`` also takes None (the backend decides)."""

  def __post_init__(self) -> None:
    hints = typing.get_type_hints(type(self))
    for field in dataclasses.fields(self):  # type: ignore[arg-type]  # a dataclass subclass
      _check(type(self).__name__, field.name, getattr(self, field.name), hints[field.name])


def _check(owner: str, name: str, value: Any, hint: Any) -> None:
  kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
  optional = len(kinds) < len(typing.get_args(hint) or (hint,))
  if optional and value is None:
    return
  (kind,) = kinds
  what = {int: "an int >= 0", bool: "True, False"}.get(kind, f"a {kind.__name__}")
  what = f"{what} or None" if optional else what.replace(", ", " or ")
  must = f"{owner}.{name} must be {what}, got {name}={value!r}"
  if kind is int:
    if isinstance(value, _BOOLS) or not isinstance(value, numbers.Integral):
      raise TypeError(must)
    if value < 0:
      raise ValueError(must)
  elif not isinstance(value, _BOOLS if kind is bool else kind):
    raise TypeError(f"{must} ({type(value).__name__})")
