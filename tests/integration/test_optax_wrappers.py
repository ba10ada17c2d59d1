"""lamb inside optax's wrappers, under jit, with trust_ratios found at any depth.

No recompilation with schedules or injected hyper-parameters: tests/backends/conformance.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import FEW_ROUNDINGS, IMPLEMENTATION_RTOL, assert_trees_close

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


def close(a, b, rtol=FEW_ROUNDINGS):
  assert_trees_close(a, b, rtol=rtol)


def test_chain_with_optax_clip_equals_max_grad_norm(rng):
  params, grads = make(rng)
  grads = [jax.tree.map(lambda x: 10 * x, g) for g in grads]
  a, _ = train(optax.chain(optax.clip_by_global_norm(1.0), optax_lamb.lamb(1e-2)), params, grads)
  b, _ = train(optax_lamb.lamb(1e-2, max_grad_norm=1.0), params, grads)
  close(a, b, rtol=2 * FEW_ROUNDINGS)


def test_inject_hyperparams_equals_plain(rng):
  params, grads = make(rng)
  injected = optax.inject_hyperparams(optax_lamb.lamb)(
    learning_rate=1e-2, weight_decay=0.1, b1=0.8, min_trust_ratio=0.1, max_trust_ratio=3.0
  )
  plain = optax_lamb.lamb(1e-2, weight_decay=0.1, b1=0.8, min_trust_ratio=0.1, max_trust_ratio=3.0)
  a, state = train(injected, params, grads)
  b, _ = train(plain, params, grads)
  # b1, b2 as float32 arrays against Python floats: 1 - b2^t evaluated two ways (README rtol)
  close(a, b, rtol=IMPLEMENTATION_RTOL)
  # Hyper-parameters can be changed in the state, and the ratios are still found.
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  updates, state = injected.update(grads[0], state, a)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))
  assert set(optax_lamb.trust_ratios(state)) == {"w", "b"}


def test_multisteps_equals_averaged_gradients(rng):
  params, grads = make(rng)
  a, state = train(optax.MultiSteps(optax_lamb.lamb(1e-2), every_k_schedule=2), params, grads)
  mean_grads = [jax.tree.map(lambda x, y: (x + y) / 2, grads[i], grads[i + 1]) for i in (0, 2, 4)]
  b, _ = train(optax_lamb.lamb(1e-2), params, mean_grads)
  close(a, b, rtol=IMPLEMENTATION_RTOL)
  assert optax_lamb.trust_ratios(state)["w"].shape == ()


def test_masked_lamb_only_moves_masked_leaves(rng):
  params, grads = make(rng)
  tx = optax.masked(optax_lamb.lamb(1e-2), {"w": True, "b": False})
  new, state = train(tx, params, grads)
  assert not np.allclose(new["w"], params["w"])
  # Updates outside the mask pass through unchanged (optax.masked semantics): b moved by raw grads.
  np.testing.assert_allclose(new["b"], params["b"] + sum(g["b"] for g in grads), rtol=1e-5)
  assert "w" in optax_lamb.trust_ratios(state)


def test_apply_if_finite_skips_nan_steps(rng):
  params, grads = make(rng)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads[1])
  a, state = train(
    optax.apply_if_finite(optax_lamb.lamb(1e-2), 3), params, [grads[0], bad, grads[2]]
  )
  b, _ = train(optax_lamb.lamb(1e-2), params, [grads[0], grads[2]])
  close(a, b)
  assert int(state.total_notfinite) == 1


def test_extra_args_are_accepted(rng):
  params, grads = make(rng)
  tx = optax_lamb.lamb(1e-2)
  state = tx.init(params)
  tx.update(grads[0], state, params, value=jnp.asarray(1.0), key=jax.random.PRNGKey(0))


def test_trust_ratios_without_a_stage_is_a_clear_error():
  with pytest.raises(ValueError, match="No trust-ratio stage"):
    optax_lamb.trust_ratios(optax.adam(1e-3).init({"w": jnp.ones(2)}))


def test_stacked_ratio_shape(rng):
  params = {"layers": jnp.asarray(rng.standard_normal((4, 3, 2)), jnp.float32)}
  tx = optax_lamb.lamb(1e-2, stacked_axes=1)
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  assert optax_lamb.trust_ratios(state)["layers"].shape == (4,)
