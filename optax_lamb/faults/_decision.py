"""Whether a step is taken: the spike test's verdict, the check it joins, the steps skipped in a row.

Shared by the skipping wrapper (`optax_lamb.faults._skip`), the spike test
(`optax_lamb.faults._spikes`) and the planned step (`optax_lamb.step._plan`), which
decides the same way inside its one update.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class Verdict(NamedTuple):
  """One step's spike test: whether it is a spike, and the values it was judged on."""

  spike: jax.Array
  norm: jax.Array
  loss: jax.Array | None


def passes(finite: jax.Array, verdict: Verdict | None) -> jax.Array:
  """Whether the step is fine: finite (its loss too), and not a spike."""
  if verdict is None:
    return finite
  if verdict.loss is not None:
    finite = jnp.logical_and(finite, jnp.isfinite(verdict.loss))
  return jnp.logical_and(finite, jnp.logical_not(verdict.spike))


def decide(ok: jax.Array, consecutive: jax.Array, max_errors: int | None) -> tuple:
  """(the new count of skipped steps in a row, whether this step is applied)."""
  consecutive = jnp.where(ok, 0, optax.safe_increment(consecutive))
  if max_errors is None:
    return consecutive, ok
  return consecutive, jnp.logical_or(ok, consecutive > max_errors)
