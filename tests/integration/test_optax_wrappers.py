"""lamb inside optax's wrappers, under jit, with trust_ratios found at any depth."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb


def make(rng):
  params = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "b": jnp.zeros(3)}
  grads = [
    jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    for _ in range(6)
  ]
  return params, grads


def train(tx, params, grads):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def close(a, b, rtol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-7), a, b)


def test_update_compiles_once_with_a_schedule(fresh_rng, caplog):
  params, grads = make(fresh_rng)
  tx = optax_lamb.lamb(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.01)
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  params, state = step(params, state, grads[0])  # the one compilation
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    for g in grads[1:]:
      params, state = step(params, state, g)
  compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
  assert compiles == [], compiles
  # And the log does record a compilation when one happens (the check can fail).
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    jax.jit(lambda x: x + 1)(jnp.ones(7))
  assert any("Compiling" in r.getMessage() for r in caplog.records)


def test_chain_with_optax_clip_equals_max_grad_norm(fresh_rng):
  params, grads = make(fresh_rng)
  grads = [jax.tree.map(lambda x: 10 * x, g) for g in grads]
  a, _ = train(optax.chain(optax.clip_by_global_norm(1.0), optax_lamb.lamb(1e-2)), params, grads)
  b, _ = train(optax_lamb.lamb(1e-2, max_grad_norm=1.0), params, grads)
  close(a, b, rtol=2e-6)


def test_inject_hyperparams_equals_plain(fresh_rng):
  params, grads = make(fresh_rng)
  injected = optax.inject_hyperparams(optax_lamb.lamb)(
    learning_rate=1e-2, weight_decay=0.1, b1=0.8, min_trust_ratio=0.1, max_trust_ratio=3.0
  )
  plain = optax_lamb.lamb(1e-2, weight_decay=0.1, b1=0.8, min_trust_ratio=0.1, max_trust_ratio=3.0)
  a, state = train(injected, params, grads)
  b, _ = train(plain, params, grads)
  close(a, b)
  # Hyper-parameters can be changed in the state, and the ratios are still found.
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  updates, state = injected.update(grads[0], state, a)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))
  assert set(optax_lamb.trust_ratios(state)) == {"w", "b"}


def test_multisteps_equals_averaged_gradients(fresh_rng):
  params, grads = make(fresh_rng)
  a, state = train(optax.MultiSteps(optax_lamb.lamb(1e-2), every_k_schedule=2), params, grads)
  mean_grads = [jax.tree.map(lambda x, y: (x + y) / 2, grads[i], grads[i + 1]) for i in (0, 2, 4)]
  b, _ = train(optax_lamb.lamb(1e-2), params, mean_grads)
  close(a, b, rtol=1e-5)
  assert optax_lamb.trust_ratios(state)["w"].shape == ()


def test_masked_lamb_only_moves_masked_leaves(fresh_rng):
  params, grads = make(fresh_rng)
  tx = optax.masked(optax_lamb.lamb(1e-2), {"w": True, "b": False})
  new, state = train(tx, params, grads)
  assert not np.allclose(new["w"], params["w"])
  # Updates outside the mask pass through unchanged (optax.masked semantics): b moved by raw grads.
  np.testing.assert_allclose(new["b"], params["b"] + sum(g["b"] for g in grads), rtol=1e-5)
  assert "w" in optax_lamb.trust_ratios(state)


def test_apply_if_finite_skips_nan_steps(fresh_rng):
  params, grads = make(fresh_rng)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads[1])
  a, state = train(
    optax.apply_if_finite(optax_lamb.lamb(1e-2), 3), params, [grads[0], bad, grads[2]]
  )
  b, _ = train(optax_lamb.lamb(1e-2), params, [grads[0], grads[2]])
  close(a, b)
  assert int(state.total_notfinite) == 1


def test_extra_args_are_accepted(fresh_rng):
  params, grads = make(fresh_rng)
  tx = optax_lamb.lamb(1e-2)
  state = tx.init(params)
  tx.update(grads[0], state, params, value=jnp.asarray(1.0), key=jax.random.PRNGKey(0))


def test_trust_ratios_without_a_stage_is_a_clear_error():
  with pytest.raises(ValueError, match="No trust-ratio stage"):
    optax_lamb.trust_ratios(optax.adam(1e-3).init({"w": jnp.ones(2)}))


def test_stacked_ratio_shape(fresh_rng):
  params = {"layers": jnp.asarray(fresh_rng.standard_normal((4, 3, 2)), jnp.float32)}
  tx = optax_lamb.lamb(1e-2, stacked_axes=1)
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  assert optax_lamb.trust_ratios(state)["layers"].shape == (4,)
