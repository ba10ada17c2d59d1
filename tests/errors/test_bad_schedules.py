"""A schedule whose value is not a scalar is refused when the step is traced, naming the
argument and the shape, alike on every implementation, eager and jitted; the state is kept."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers.asserts import assert_unchanged, snapshot
from helpers.implementations import lamb_for

import optax_lamb

PARAMS = {"scalar": jnp.ones(()), "w": jnp.ones((3, 2))}
GRADS = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), PARAMS)
VECTOR = lambda count: jnp.array([1e-2, 1e-3])  # noqa: E731 (shape (2,))
SCHEDULES = {
  "learning_rate": dict(learning_rate=VECTOR),
  "weight_decay": dict(learning_rate=1e-2, weight_decay=VECTOR),
  "grad_scale": dict(learning_rate=1e-2, grad_scale=VECTOR),
}


def _refused(update, state, name):
  kept = snapshot(state)
  expected = rf"^{name} must be a schedule whose values are scalars, got {name}\(count\) of shape "
  with pytest.raises(ValueError, match=expected + re.escape("(2,)")):
    update(GRADS, state, PARAMS)
  assert_unchanged(state, kept)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_lamb_refuses_a_schedule_with_non_scalar_values(name, implementation, jitted):
  tx = lamb_for(implementation)(**SCHEDULES[name])
  _refused(jax.jit(tx.update) if jitted else tx.update, tx.init(PARAMS), name)


@pytest.mark.parametrize(
  "name, tx",
  [
    ("weight_decay", optax_lamb.add_decayed_weights(VECTOR)),
    ("grad_scale", optax_lamb.unscale_gradients(VECTOR)),
  ],
)
def test_stages_refuse_a_schedule_with_non_scalar_values(name, tx):
  _refused(tx.update, tx.init(PARAMS), name)
