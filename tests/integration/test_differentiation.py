"""Derivatives through a lamb step: finite where a leaf is all zero, and the same on every
implementation (the Pallas kernels take the XLA step's derivatives).

A loss of the params after a step, differentiated with respect to the params, the
gradients or the learning rate, is compared with optax.lamb's (the independent
reference) and between implementations.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers.implementations import lamb_for

import optax_lamb

IMPLEMENTATIONS = ("xla", "xla-one-device", "xla-large-tree", "reference", "pallas")
# float32 steps of different implementations agree to about 1e-6 relative (two
# norms summed in different orders); their derivatives inherit that.
RTOL = 1e-5


def _problem(rng):
  """Params with a zero-initialised bias (its ||p|| is 0: ratio 1), and gradients."""
  params = {
    "w": jnp.asarray(rng.normal(size=(6, 40)), jnp.float32),
    "bias": jnp.zeros((40,), jnp.float32),
    "v": jnp.asarray(rng.normal(size=(300,)), jnp.float32),
  }
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  return params, grads


def _loss_after_steps(tx, grads, steps: int = 2):
  """loss(params) = sum of squares of the params after `steps` steps from `init`."""

  def loss(params, grads=grads):
    state = tx.init(params)
    for _ in range(steps):
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))

  return loss


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_grad_through_steps_with_a_zero_leaf_matches_optax(implementation, rng):
  params, grads = _problem(rng)
  want = jax.grad(_loss_after_steps(optax.lamb(1e-2, weight_decay=0.01), grads))(params)
  tx = lamb_for(implementation)(1e-2, weight_decay=0.01)
  got = jax.jit(jax.grad(_loss_after_steps(tx, grads)))(params)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-6)


def test_grad_through_the_trust_ratio_stage_with_a_zero_leaf_matches_optax(rng):
  params, grads = _problem(rng)
  ours = optax.chain(optax_lamb.scale_by_adam(), optax_lamb.scale_by_trust_ratio())
  theirs = optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio())
  got = jax.grad(_loss_after_steps(ours, grads))(params)
  want = jax.grad(_loss_after_steps(theirs, grads))(params)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-6)


def test_grad_with_respect_to_params_is_finite_when_every_gradient_is_zero():
  """The global clip norm of all-zero gradients is 0: its sqrt must not poison the gradient.

  (optax.clip_by_global_norm + optax.lamb gives NaN here. With respect to the
  gradients themselves the step is not differentiable at 0: Adam's sqrt(v).)
  """
  params = {"w": jnp.ones((3, 4)), "bias": jnp.zeros((4,))}
  grads = jax.tree.map(jnp.zeros_like, params)
  loss = _loss_after_steps(optax_lamb.lamb(1e-2, max_grad_norm=1.0), grads)
  chex.assert_tree_all_finite(jax.grad(loss)(params))


@pytest.mark.parametrize(
  "implementation",
  [
    pytest.param("pallas", marks=pytest.mark.slow),
    pytest.param("reference", marks=pytest.mark.slow),
  ],
)  # the kernels interpreted (17 s), the stage chain (12 s): CI runs them
def test_jvp_and_vjp_equal_the_xla_paths(implementation, rng):
  """With respect to params and gradients together, forward and reverse mode."""
  params, grads = _problem(rng)
  tangents = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), (params, grads))

  def step_of(name):
    tx = lamb_for(name)(1e-2, weight_decay=0.01, max_grad_norm=1.0)
    return lambda p, g: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])

  want_out, want_tangent = jax.jvp(step_of("xla"), (params, grads), tangents)
  got_out, got_tangent = jax.jit(lambda *a: jax.jvp(step_of(implementation), *a))(
    (params, grads), tangents
  )
  chex.assert_trees_all_close(
    (got_out, got_tangent), (want_out, want_tangent), rtol=RTOL, atol=1e-6
  )
  cotangent = jax.tree.map(jnp.ones_like, params)
  want_vjp = jax.vjp(step_of("xla"), params, grads)[1](cotangent)
  got_vjp = jax.vjp(step_of(implementation), params, grads)[1](cotangent)
  chex.assert_trees_all_close(got_vjp, want_vjp, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
def test_grad_with_respect_to_the_learning_rate_equals_xla(implementation, rng):
  """A hyper-parameter injected as a traced value (meta-learning the learning rate)."""
  params, grads = _problem(rng)

  def loss_of(name):
    def loss(learning_rate):
      tx = optax.inject_hyperparams(lamb_for(name))(learning_rate=learning_rate)
      return _loss_after_steps(tx, grads)(params)

    return loss

  want = jax.grad(loss_of("xla"))(jnp.float32(1e-2))
  got = jax.jit(jax.grad(loss_of(implementation)))(jnp.float32(1e-2))
  assert jnp.isfinite(got) and want != 0
  chex.assert_trees_all_close(got, want, rtol=RTOL)
