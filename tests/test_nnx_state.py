"""Reading a Flax NNX optimizer's state gives plain arrays (issue 12, class 6).

``nnx.Optimizer(model, tx, wrt=nnx.Param).opt_state`` wraps every array of the
state in an ``OptVariable``, and the trust-ratio layout keeps the ``Param`` nodes
of the params ``init`` saw. `trust_ratios` and `skip_counts` take them off.
"""

import _fast_compile
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb

nnx = pytest.importorskip("flax.nnx")


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 4, rngs=rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # not a Param: not optimized

  def __call__(self, x):
    return self.out(jax.nn.tanh(self.hidden(x)))


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


OPTIONS = {
  "plain": {"weight_decay": 0.01},
  "skip-master-clip": {"skip_nonfinite": True, "master_weights": True, "max_grad_norm": 1.0},
}


def is_plain_array(x):
  return isinstance(x, jax.Array) and not isinstance(x, nnx.Variable)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_trust_ratios_of_an_nnx_optimizer_are_plain_arrays(options):
  kwargs = OPTIONS[options]
  model = MLP(nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  optimizer = nnx.Optimizer(model, optax_lamb.lamb(1e-2, **kwargs), wrt=nnx.Param)
  rng = np.random.default_rng(0)
  batches = [
    (jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.asarray(rng.normal(size=(8, 2))))
    for _ in range(2)
  ]

  @nnx.jit
  def train_step(model, optimizer, x, y):
    grads = nnx.grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return nnx.to_pure_dict(nnx.state(grads, nnx.Param))

  grads_seen = [train_step(model, optimizer, x, y) for x, y in batches]

  ratios = optax_lamb.trust_ratios(optimizer.opt_state)
  leaves = jax.tree.leaves(ratios, is_leaf=lambda v: isinstance(v, nnx.Variable))
  assert len(leaves) == 4 and all(is_plain_array(r) for r in leaves), ratios
  assert "OptVariable" not in repr(ratios) and "Param(" not in repr(ratios)
  assert optax_lamb.trust_ratios(nnx.as_pure(optimizer.opt_state)) is not None

  # The same values as lamb on the plain param dict.
  tx = optax_lamb.lamb(1e-2, **kwargs)
  state = tx.init(params)
  update = _fast_compile.jit(tx.update)
  for grads in grads_seen:
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  want = optax_lamb.trust_ratios(state)
  trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), trained, params)
  np.testing.assert_allclose(
    np.array(jax.tree.leaves(ratios)), np.array(jax.tree.leaves(want)), rtol=1e-6
  )
  if kwargs.get("skip_nonfinite"):
    counts = optax_lamb.skip_counts(optimizer.opt_state)
    assert all(is_plain_array(c) for c in counts) and int(counts.total) == 0
