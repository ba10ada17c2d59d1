"""Bad trees fail with errors that name the problem (bad hyper-parameters: test_bad_hyperparams.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lamb


def test_auto_is_the_xla_path_until_the_kernel_is_validated_on_a_gpu(fresh_rng):
  params = {"w": jnp.asarray(fresh_rng.standard_normal((4, 3)), jnp.float32)}
  a, b = optax_lamb.lamb(1e-2), optax_lamb.lamb(1e-2, implementation="xla")
  ua, _ = a.update(params, a.init(params), params)
  ub, _ = b.update(params, b.init(params), params)
  np.testing.assert_array_equal(ua["w"], ub["w"])


def _tree():
  return {"a": jnp.ones((2, 3)), "b": {"c": jnp.ones(4)}}


def test_grads_params_structure_mismatch_names_the_paths():
  tx = optax_lamb.lamb(1e-3)
  params = _tree()
  state = tx.init(params)
  grads = {"a": jnp.ones((2, 3)), "b": {"d": jnp.ones(4)}}
  with pytest.raises(ValueError, match=r"\['b'\]\['d'\].*\['b'\]\['c'\]"):
    tx.update(grads, state, params)


def test_state_params_structure_mismatch_names_the_paths():
  tx = optax_lamb.lamb(1e-3)
  state = tx.init(_tree())
  other = {"a": jnp.ones((2, 3)), "extra": jnp.ones(1), "b": {"c": jnp.ones(4)}}
  with pytest.raises(ValueError, match=r"\['extra'\]"):
    tx.update(other, state, other)


def test_missing_params_is_a_clear_error():
  tx = optax_lamb.lamb(1e-3)
  state = tx.init(_tree())
  with pytest.raises(ValueError, match="needs params"):
    tx.update(_tree(), state)


def test_bad_stacked_axes_names_the_leaf():
  tx = optax_lamb.lamb(1e-3, stacked_axes=2)
  with pytest.raises(ValueError, match=r"stacked_axes=2 at \['b'\]\['c'\].*rank 1"):
    tx.init(_tree())


def test_failed_update_leaves_state_usable():
  tx = optax_lamb.lamb(1e-3)
  params = _tree()
  state = tx.init(params)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  with pytest.raises(ValueError):
    tx.update({"a": jnp.ones((2, 3))}, state, params)
  after = [np.asarray(x) for x in jax.tree.leaves(state)]
  for x, y in zip(before, after, strict=True):
    np.testing.assert_array_equal(x, y)
  tx.update(_tree(), state, params)  # the same state still works
