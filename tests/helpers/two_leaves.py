"""A two-leaf problem (``w`` 4x3, ``b`` 3) and a few jitted steps of it, for tests that compare
two ways of building the same optimizer on it, at a float32 tolerance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

RTOL = 1e-5  # float32 arrays (injected) against Python floats (built in)


def tiny_params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    "b": jnp.asarray(0.1 * rng.normal(size=(3,)), jnp.float32),
  }


def tiny_grads(steps: int, seed: int = 1) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [
    {
      "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }
    for _ in range(steps)
  ]


def run_steps(tx, params: dict | None = None, grads: list[dict] | None = None, **extra) -> dict:
  """The params after `tx` stepped on `grads` (default: 3 steps of `tiny_grads`) from `params`
  (default: `tiny_params`), each step jitted; `extra` goes to every ``update``."""
  params = tiny_params() if params is None else params
  grads = tiny_grads(3) if grads is None else grads
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params, **extra)
    return optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, g)
  return params


def assert_close(got: dict, want: dict) -> None:
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=1e-7, err_msg=name)
