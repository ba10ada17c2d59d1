"""Low-precision params, moment dtypes, and convergence on small problems."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lamb_reference import NumpyLamb

import optax_lamb


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_params_keep_dtype_and_track_reference(dtype, fresh_rng):
  shapes = {"w": (16, 8), "b": (8,), "s": ()}
  params = {k: jnp.asarray(fresh_rng.standard_normal(s), dtype) for k, s in shapes.items()}
  params["b"] = jnp.zeros(8, dtype)
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  state = tx.init(params)
  assert state[1].mu["w"].dtype == jnp.float32 and state[1].nu["w"].dtype == jnp.float32
  ref = NumpyLamb(1e-2, weight_decay=0.01)
  update = jax.jit(tx.update)
  for _ in range(5):
    grads = {k: jnp.asarray(fresh_rng.standard_normal(s), dtype) for k, s in shapes.items()}
    expected = ref.step(
      jax.tree.map(lambda x: np.asarray(x, np.float64), params),
      jax.tree.map(lambda x: np.asarray(x, np.float64), grads),
    )
    updates, state = update(grads, state, params)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    params = optax.apply_updates(params, updates)
    assert all(p.dtype == dtype for p in jax.tree.leaves(params))
    ratios = optax_lamb.trust_ratios(state)
    assert all(np.isfinite(r) and r.dtype == jnp.float32 for r in jax.tree.leaves(ratios))
    for k in shapes:  # one rounding of the new params to the low-precision grid
      np.testing.assert_allclose(
        np.asarray(params[k], np.float64), expected[k], rtol=1e-2, atol=1e-2
      )


def test_float16_leaf_with_norm_above_65504_has_a_finite_ratio():
  # ||p|| = 1000 * sqrt(10000) = 1e5 > float16 max: optax.lamb gives inf here (jax issue 39899).
  params = {"w": jnp.full((100, 100), 1000.0, jnp.float16)}
  grads = {"w": jnp.ones((100, 100), jnp.float16)}
  tx = optax_lamb.lamb(1e-3, nu_dtype=jnp.float32)
  updates, state = tx.update(grads, tx.init(params), params)
  ratio = optax_lamb.trust_ratios(state)["w"]
  # u = 1 everywhere at step 1, so ||u|| = 100 and r = 1e5 / 100.
  np.testing.assert_allclose(ratio, 1000.0, rtol=1e-3)
  np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -1.0, rtol=1e-2)
  assert updates["w"].dtype == jnp.float16


@pytest.mark.parametrize("mu_dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_moments_with_float32_params(mu_dtype, fresh_rng):
  params = {"w": jnp.asarray(fresh_rng.standard_normal((32, 4)), jnp.float32)}
  lo = optax_lamb.lamb(1e-2, mu_dtype=mu_dtype, nu_dtype=mu_dtype)
  hi = optax_lamb.lamb(1e-2)
  s_lo, s_hi = lo.init(params), hi.init(params)
  assert s_lo[1].mu["w"].dtype == mu_dtype and s_lo[1].nu["w"].dtype == mu_dtype
  p_lo = p_hi = params
  for _ in range(5):
    g = {"w": jnp.asarray(fresh_rng.standard_normal((32, 4)), jnp.float32)}
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
