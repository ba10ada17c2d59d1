"""Bad hyper-parameters fail at build time; bad trees fail with errors that name the problem."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lamb


@pytest.mark.parametrize(
  "kwargs, name, value",
  [
    (dict(b1=1.0), "b1", "1.0"),
    (dict(b1=-0.1), "b1", "-0.1"),
    (dict(b2=1.5), "b2", "1.5"),
    (dict(b2=-1e-3), "b2", "-0.001"),
    (dict(eps=-1e-8), "eps", "-1e-08"),
    (dict(eps_root=-1.0), "eps_root", "-1.0"),
    (dict(weight_decay=-0.01), "weight_decay", "-0.01"),
    (dict(min_trust_ratio=2.0, max_trust_ratio=1.0), "min_trust_ratio", "2.0"),
    (dict(min_trust_ratio=-1.0), "min_trust_ratio", "-1.0"),
    (dict(max_grad_norm=0.0), "max_grad_norm", "0.0"),
    (dict(max_grad_norm=-1.0), "max_grad_norm", "-1.0"),
    (dict(implementation="cuda"), "implementation", "'cuda'"),
  ],
)
def test_lamb_rejects_bad_hyperparameters(kwargs, name, value):
  with pytest.raises(ValueError, match=rf"{name}.*{value}"):
    optax_lamb.lamb(1e-3, **kwargs)


@pytest.mark.parametrize(
  "factory, kwargs, name",
  [
    (optax_lamb.scale_by_adam, dict(b1=1.0), "b1"),
    (optax_lamb.scale_by_adam, dict(eps=-1.0), "eps"),
    (optax_lamb.scale_by_trust_ratio, dict(min_norm=-1.0), "min_norm"),
    (optax_lamb.scale_by_trust_ratio, dict(trust_coefficient=0.0), "trust_coefficient"),
    (optax_lamb.scale_by_trust_ratio, dict(min_ratio=3.0, max_ratio=2.0), "min_ratio"),
    (optax_lamb.add_decayed_weights, dict(weight_decay=-1.0), "weight_decay"),
    (optax_lamb.clip_by_global_norm, dict(max_norm=0.0), "max_grad_norm"),
  ],
)
def test_stages_reject_bad_hyperparameters(factory, kwargs, name):
  with pytest.raises(ValueError, match=name):
    factory(**kwargs)


def test_array_hyperparameters_are_not_checked_at_build_time():
  # inject_hyperparams passes arrays; they cannot be checked without a host sync.
  optax_lamb.lamb(jnp.asarray(1e-3), b1=jnp.asarray(0.9), weight_decay=jnp.asarray(0.0))


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
