"""Convergence on small problems, and low-precision moments with float32 params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb


@pytest.mark.parametrize("mu_dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_moments_with_float32_params(mu_dtype, rng):
  params = {"w": jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)}
  lo = optax_lamb.lamb(1e-2, mu_dtype=mu_dtype, nu_dtype=mu_dtype)
  hi = optax_lamb.lamb(1e-2)
  s_lo, s_hi = lo.init(params), hi.init(params)
  assert s_lo[1].mu["w"].dtype == mu_dtype and s_lo[1].nu["w"].dtype == mu_dtype
  p_lo = p_hi = params
  for _ in range(5):
    g = {"w": jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)}
    u_lo, s_lo = lo.update(g, s_lo, p_lo)
    u_hi, s_hi = hi.update(g, s_hi, p_hi)
    assert u_lo["w"].dtype == jnp.float32
    p_lo, p_hi = optax.apply_updates(p_lo, u_lo), optax.apply_updates(p_hi, u_hi)
  assert s_lo[1].mu["w"].dtype == mu_dtype
  # Moments rounded to 8-11 bits move the step by well under its size (lr * ||p|| per step).
  drift = float(jnp.linalg.norm(p_lo["w"] - p_hi["w"]))
  assert drift < 0.05 * 5 * 1e-2 * float(jnp.linalg.norm(params["w"]))


def _minimize(loss, params, tx, steps):
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params


def test_converges_on_a_parabola():
  target = jnp.array([1.0, -2.0, 3.0])
  loss = lambda p: jnp.sum((p["x"] - target) ** 2)
  tx = optax_lamb.lamb(optax.cosine_decay_schedule(0.05, 1000))
  params = _minimize(loss, {"x": jnp.array([0.5, 0.5, 0.5])}, tx, 1000)
  assert float(loss(params)) < 1e-4, params


def test_converges_on_rosenbrock():
  def loss(p):
    x, y = p["xy"][0], p["xy"][1]
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2

  tx = optax_lamb.lamb(optax.cosine_decay_schedule(0.02, 5000), b1=0.9, b2=0.99)
  params = _minimize(loss, {"xy": jnp.array([-1.2, 1.0])}, tx, 5000)
  np.testing.assert_allclose(params["xy"], [1.0, 1.0], atol=2e-2)
