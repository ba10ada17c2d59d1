"""with_master_weights (lamb(master_weights=True)), and float16 params near the end of its range.

Low-precision params against the other implementations and the float64 LAMB:
tests/backends/conformance.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import ulp
from helpers.lamb_reference import NumpyLamb
from helpers.trees import random_like, random_tree

import optax_lamb

LOW = [jnp.bfloat16, jnp.float16]
SHAPES = {"w": (32, 16), "b": (16,)}


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def random_params(rng, dtype):
  return random_tree(rng, SHAPES, dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_master_weights_run_float32_lamb_on_the_master(dtype, rng):
  """The master follows a plain float32 LAMB run fed the same gradients; ratios come from it."""
  params = random_params(rng, dtype)
  kw = dict(weight_decay=0.01, max_grad_norm=1.0, min_trust_ratio=0.01, max_trust_ratio=10.0)
  tx = optax_lamb.lamb(1e-2, master_weights=True, **kw)
  tx32 = optax_lamb.lamb(1e-2, **kw)
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state, state32 = tx.init(params), tx32.init(params32)
  master = optax_lamb.master_weights(state)
  assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(master))
  step, step32 = jax.jit(tx.update), jax.jit(tx32.update)
  for _ in range(6):
    grads = random_like(rng, params)
    updates, state = step(grads, state, params)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    params = optax.apply_updates(params, updates)
    u32, state32 = step32(jax.tree.map(lambda g: g.astype(jnp.float32), grads), state32, params32)
    params32 = optax.apply_updates(params32, u32)
  for k in params:
    np.testing.assert_allclose(
      np.asarray(optax_lamb.master_weights(state)[k]), np.asarray(params32[k]), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
      np.asarray(optax_lamb.trust_ratios(state)[k]),
      np.asarray(optax_lamb.trust_ratios(state32)[k]),
      rtol=1e-6,
    )


@pytest.mark.parametrize("dtype", LOW)
def test_apply_updates_gives_the_rounded_master(dtype, rng):
  """optax.apply_updates(params, updates) == lowp(master) wherever lowp(master) - p is exact.

  Elsewhere (an element that shrinks by more than the low dtype's precision in one
  step) no update in the low dtype can reach the rounded master; the result is
  then within one ulp, and the next step starts again from the master, so the
  error never grows.
  """
  params = random_params(rng, dtype)
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, master_weights=True)
  state = tx.init(params)
  step = jax.jit(tx.update)
  mismatched = total = 0
  for _ in range(30):
    updates, state = step(random_like(rng, params), state, params)
    new = optax.apply_updates(params, updates)
    for k in params:
      p, got = f64(params[k]), f64(new[k])
      target = f64(optax_lamb.master_weights(state)[k].astype(dtype))
      exact_diff = f64(jnp.asarray(target - p, dtype)) == target - p
      sterbenz = (target / 2 <= p) & (p <= 2 * target) | (p / 2 >= target) & (target >= 2 * p)
      assert np.all(exact_diff[sterbenz])
      np.testing.assert_array_equal(got[exact_diff], target[exact_diff])
      err = np.abs(got - target)
      assert np.all(err <= ulp(np.maximum(np.abs(p), np.abs(target)), dtype))
      mismatched += int(np.sum(got != target))
      total += got.size
    params = new
  print(
    f"{jnp.dtype(dtype).name}: {mismatched}/{total} elements off the rounded master by <= 1 ulp"
  )
  assert mismatched < 0.05 * total


@pytest.mark.parametrize("dtype", LOW)
def test_apply_updates_bit_exact_when_no_element_halves(dtype, rng):
  """Params in [1, 1.9] with small steps: every element stays within a factor 2, all exact."""
  params = {"w": jnp.asarray(rng.uniform(1.0, 1.9, size=(64, 8)), dtype)}
  tx = optax_lamb.lamb(1e-3, master_weights=True)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(40):
    updates, state = step(random_like(rng, params), state, params)
    params = optax.apply_updates(params, updates)
    rounded = optax_lamb.master_weights(state)["w"].astype(dtype)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(rounded))


def test_small_steps_accumulate_in_the_master(rng):
  """A step below half a bfloat16 ulp is lost without master weights, kept with them."""
  params = {"w": jnp.ones((16,), jnp.bfloat16) + jnp.asarray(rng.uniform(0, 0.5, 16), jnp.bfloat16)}
  lr = 1e-4  # |step| = lr * ||p|| / sqrt(16) < 2^-9, half an ulp of bfloat16 in [1, 2)
  plain, master = optax_lamb.lamb(lr), optax_lamb.lamb(lr, master_weights=True)
  p_plain, p_master = params, params
  s_plain, s_master = plain.init(params), master.init(params)
  grads = {"w": jnp.ones((16,), jnp.bfloat16)}
  step_plain, step_master = jax.jit(plain.update), jax.jit(master.update)
  for _ in range(100):
    u, s_plain = step_plain(grads, s_plain, p_plain)
    p_plain = optax.apply_updates(p_plain, u)
    u, s_master = step_master(grads, s_master, p_master)
    p_master = optax.apply_updates(p_master, u)
  np.testing.assert_array_equal(np.asarray(p_plain["w"]), np.asarray(params["w"]))
  assert np.all(f64(p_master["w"]) < f64(params["w"]))
  np.testing.assert_array_equal(
    np.asarray(p_master["w"]),
    np.asarray(optax_lamb.master_weights(s_master)["w"].astype(jnp.bfloat16)),
  )


@pytest.mark.parametrize(
  "options",
  [
    dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32),
    dict(master_weights=True),
    dict(nu_dtype=jnp.float32, max_grad_norm=1.0),
  ],
  ids=["f32-moments", "master", "f32-nu-clip"],
)
def test_float16_no_overflow(options, rng):
  """float16 params of norm > 65504 and gradients near float16's max stay finite and correct."""
  params = {
    "big": jnp.asarray(rng.uniform(3000, 4000, size=(1024,)), jnp.float16),  # norm ~ 1.1e5
    "small": jnp.asarray(rng.normal(size=(8,)), jnp.float16),
  }
  assert float(jnp.sqrt(jnp.sum(jnp.square(params["big"].astype(jnp.float32))))) > 65504
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, **options)
  state = tx.init(params)
  ref = NumpyLamb(
    1e-2,
    weight_decay=0.01,
    max_grad_norm=options.get("max_grad_norm"),
  )
  step = jax.jit(tx.update)
  master = options.get("master_weights", False)
  p_ref = {k: f64(v) for k, v in params.items()}
  for _ in range(3):
    grads = {
      k: jnp.asarray(rng.uniform(-65000, 65000, size=p.shape), jnp.float16)
      for k, p in params.items()
    }
    updates, state = step(grads, state, params)
    # The master run follows the reference's own float64 trajectory; without a master,
    # the reference steps from the float16 params the optimizer was given.
    p_ref = ref.step(p_ref if master else {k: f64(v) for k, v in params.items()}, grads)
    for k in params:
      assert updates[k].dtype == jnp.float16
      assert np.all(np.isfinite(f64(updates[k])))
      # float32 bias correction: 1 - 0.999^t from b2 rounded to float32 is off by ~1.3e-5.
      np.testing.assert_allclose(float(optax_lamb.trust_ratios(state)[k]), ref.ratios[k], rtol=5e-4)
      if master:
        got = f64(optax_lamb.master_weights(state)[k])
        np.testing.assert_allclose(got, p_ref[k], rtol=1e-6, atol=1e-6)
      else:
        want = p_ref[k] - f64(params[k])
        # One float16 rounding, plus the ratio's tolerance on the whole leaf.
        np.testing.assert_allclose(
          f64(updates[k]), want, rtol=2**-11 + 5e-4, atol=5e-4 * np.max(np.abs(want))
        )
    params = optax.apply_updates(params, updates)
  assert all(np.all(np.isfinite(f64(x))) for x in jax.tree.leaves(state))


def test_mixed_dtype_tree_with_master_weights(rng):
  params = {
    "a": jnp.asarray(rng.normal(size=(5, 3)), jnp.bfloat16),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    "c": jnp.asarray(rng.normal(size=(2, 2)), jnp.float16),
  }
  tx = optax_lamb.lamb(1e-2, master_weights=True, skip_nonfinite=True)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(random_like(rng, params), state, params)
  for k in params:
    assert updates[k].dtype == params[k].dtype
    assert optax_lamb.master_weights(state)[k].dtype == jnp.float32


def test_float16_leaf_with_norm_above_65504_has_a_finite_ratio():
  # ||p|| = 1000 * sqrt(10000) = 1e5 > float16 max: optax.lamb gives inf here (its norm
  # in float16 overflows).
  params = {"w": jnp.full((100, 100), 1000.0, jnp.float16)}
  grads = {"w": jnp.ones((100, 100), jnp.float16)}
  tx = optax_lamb.lamb(1e-3, nu_dtype=jnp.float32)
  updates, state = tx.update(grads, tx.init(params), params)
  ratio = optax_lamb.trust_ratios(state)["w"]
  # u = 1 everywhere at step 1, so ||u|| = 100 and r = 1e5 / 100.
  np.testing.assert_allclose(ratio, 1000.0, rtol=1e-3)
  np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -1.0, rtol=1e-2)
  assert updates["w"].dtype == jnp.float16
