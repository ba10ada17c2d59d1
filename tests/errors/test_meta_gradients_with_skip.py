"""Meta-gradients (of a loss after a few training steps, with respect to the learning rate and the
weight decay) through ``lamb(..., skip_nonfinite=True)`` under float64 (``jax.enable_x64``, on in
this module only), on every implementation, against optax.lamb's (the independent reference: the
skip check only decides, so with finite gradients the step and its derivatives are optax.lamb's).

The gradients of the later steps depend on the hyper-parameters (they are the training loss's
at the updated params), so the skip check's reductions are differentiated: jax's derivative of
the check's variadic reduce (a float and a boolean operand) failed with "Error interpreting
argument to reshape ... ad_util.Zero".
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers.implementations import lamb_for

STEPS = 3
# The Pallas kernels take float32 params (float64 ones run on the XLA path, an error in the
# tests' configuration): float32 params there, float64 hyper-parameters.
PARAM_DTYPES = {"pallas": jnp.float32, "pallas-mosaic-gpu": jnp.float32}
RTOL = {jnp.float64: 1e-9, jnp.float32: 1e-5}  # float64: a few hundred roundings; float32: README


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def _params(rng, dtype):
  return {
    "w": jnp.asarray(rng.normal(size=(6, 40)), dtype),
    "bias": jnp.zeros((40,), dtype),  # ||p|| = 0 at the start: ratio 1
    "v": jnp.asarray(rng.normal(size=(300,)), dtype),
  }


def _train_loss(params):
  return sum(jnp.sum(jnp.sin(p) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


def _loss_after_steps(make_tx, params):
  """loss(hyper) = the training loss after `STEPS` steps of the optimizer `make_tx(lr, wd)`."""

  def loss(hyper):
    tx = make_tx(*hyper)
    p, state = params, tx.init(params)
    for _ in range(STEPS):
      updates, state = tx.update(jax.grad(_train_loss)(p), state, p)
      p = optax.apply_updates(p, updates)
    return _train_loss(p)

  return loss


SPELLINGS = {
  "inject_hyperparams": lambda factory, **kw: (
    lambda lr, wd: optax.inject_hyperparams(factory)(learning_rate=lr, weight_decay=wd, **kw)
  ),
  "traced_arguments": lambda factory, **kw: lambda lr, wd: factory(lr, weight_decay=wd, **kw),
}


CASES = [
  *[(name, "inject_hyperparams") for name in ("xla", "xla-one-device", "xla-large-tree")],
  *[(name, "inject_hyperparams") for name in ("reference", "pallas")],
  *[(name, "traced_arguments") for name in ("xla", "reference", "pallas")],
  ("pallas-mosaic-gpu", "inject_hyperparams"),
]


@pytest.mark.parametrize(("implementation", "spelling"), CASES)
def test_x64_meta_gradient_with_skip_nonfinite_equals_optax(implementation, spelling, rng):
  dtype = PARAM_DTYPES.get(implementation, jnp.float64)
  params = _params(rng, dtype)
  hyper = (jnp.float64(1e-2), jnp.float64(1e-2))
  spell = SPELLINGS[spelling]

  ours = _loss_after_steps(spell(lamb_for(implementation), skip_nonfinite=True), params)
  got = jax.jit(jax.grad(ours))(hyper)
  want = jax.grad(_loss_after_steps(spell(optax.lamb), params))(hyper)

  chex.assert_tree_all_finite(got)
  assert all(float(w) != 0 for w in want)  # both hyper-parameters move the loss
  chex.assert_trees_all_close(got, want, rtol=RTOL[dtype], atol=0)
