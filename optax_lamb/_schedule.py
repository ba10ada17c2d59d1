"""Hyper-parameters that may be schedules: the one place a schedule is evaluated and stepped.

A schedule's step count lives in a NamedTuple with a ``count`` field
(:class:`optax.ScaleByScheduleState`, :class:`optax_lamb.UnscaleGradientsState`),
possibly nested inside another state (``optax.masked``). Floats and arrays need
no count; their state is left as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax


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
  def schedule(count):
    out = value(count)
    if jnp.ndim(out) != 0:
      raise ValueError(
        f"{name} must be a schedule whose values are scalars, got {name}(count) of shape "
        f"{jnp.shape(out)}"
      )
    return out

  schedule._scalar_valued = True
  return schedule


def value_and_next_state(value: Any, state: Any) -> tuple[Any, Any]:
  """(value at this step, state after it) for a float, an array or a schedule ``count -> value``.

  For a schedule, `state` holds the count (directly or nested); the value is
  taken at that count and every count in `state` is incremented.
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
