"""float64 params (under ``jax.enable_x64``, on in this module only) get float64 accuracy on every
implementation: norms, ratios and updates in float64, against the float64 NumPy LAMB.

The state keeps its float32 ratio vector (the checkpoint format); the step uses the
float64 ratios before storing them.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.implementations import IMPLEMENTATIONS, lamb_for
from helpers.lamb_reference import NumpyLamb

import optax_lamb

STEPS = 3
KWARGS = dict(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0)
RTOL = 1e-12  # float64 rounding (about 1e-16) times the step's few hundred operations


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _problem(rng):
  params = {"w": rng.normal(size=(8, 50)), "b": rng.normal(size=(50,)), "zero": np.zeros(7)}
  grads = [{k: rng.normal(size=v.shape) for k, v in params.items()} for _ in range(STEPS)]
  return params, grads


def _run(tx, params, grads):
  params = jax.tree.map(jnp.asarray, params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(jax.tree.map(jnp.asarray, g), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _expected(params, grads):
  reference = NumpyLamb(**KWARGS)
  for g in grads:
    params = reference.step(params, g)
  return params


def _assert_float64_accurate(got, want):
  for name, value in want.items():
    assert got[name].dtype == jnp.float64, name
    scale = np.max(np.abs(value))
    np.testing.assert_allclose(
      np.asarray(got[name]), value, rtol=0, atol=RTOL * scale, err_msg=name
    )


@pytest.mark.parametrize("implementation", [i for i in IMPLEMENTATIONS if "pallas" not in i])
def test_lamb_is_float64_accurate(implementation, rng):
  params, grads = _problem(rng)
  got, state = _run(lamb_for(implementation)(**KWARGS), params, grads)
  _assert_float64_accurate(got, _expected(params, grads))
  assert state[3].ratios.dtype == jnp.float32  # the stored report keeps init's dtype


def test_pallas_runs_float64_on_the_xla_path_accurately(rng):
  """The kernels take float32/bfloat16/float16; float64 falls back (saying so) at full accuracy."""
  from optax_lamb.backends.pallas_triton import PallasTritonBackend

  params, grads = _problem(rng)
  tx = optax_lamb.lamb(**KWARGS, implementation=PallasTritonBackend(interpret=True))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got, _ = _run(tx, params, grads)
  assert any("float64" in str(w.message) and "xla path" in str(w.message) for w in caught)
  _assert_float64_accurate(got, _expected(params, grads))


def test_the_stage_chain_is_float64_accurate(rng):
  params, grads = _problem(rng)
  tx = optax.chain(
    optax_lamb.clip_by_global_norm(KWARGS["max_grad_norm"]),
    optax_lamb.scale_by_adam(eps=1e-6),
    optax_lamb.add_decayed_weights(KWARGS["weight_decay"]),
    optax_lamb.scale_by_trust_ratio(),
    optax.scale_by_learning_rate(KWARGS["learning_rate"]),
  )
  got, _ = _run(tx, params, grads)
  _assert_float64_accurate(got, _expected(params, grads))
