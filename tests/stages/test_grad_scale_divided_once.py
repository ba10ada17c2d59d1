"""A loss scale passed to update (grad_scale=s) is divided out exactly once, whichever of
unscale_gradients and lamb reads it, in plain, named and nested chains and through wrappers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers.two_leaves import assert_close, run_steps, tiny_grads, tiny_params

import optax_lamb

_SCALED_BUILDERS = {
  "lamb": lambda: optax_lamb.lamb(1e-2, weight_decay=0.01),
  "lamb_skip_nonfinite": lambda: optax_lamb.lamb(1e-2, skip_nonfinite=True),
  "skip_nonfinite_wrapper": lambda: optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2)),
  "lamb_master_weights": lambda: optax_lamb.lamb(1e-2, master_weights=True),
  "compat_apex": lambda: optax_lamb.compat.apex_fused_lamb(lr=1e-2),
}


@pytest.mark.parametrize("builder", sorted(_SCALED_BUILDERS))
def test_unscale_gradients_then_lamb_divides_once(builder):
  """chain(unscale_gradients(), lamb) with update(..., grad_scale=s), the pattern
  unscale_gradients' docstring shows, divides by s once: the moments see g, not g / s^2."""
  scale = 1024.0
  chained = optax.chain(optax_lamb.unscale_gradients(), _SCALED_BUILDERS[builder]())
  plain = _SCALED_BUILDERS[builder]()
  params = tiny_params()
  c_state, p_state = chained.init(params), plain.init(params)
  for grads in tiny_grads(3):
    scaled = jax.tree.map(lambda g: g * scale, grads)
    c_updates, c_state = chained.update(scaled, c_state, params, grad_scale=scale)
    p_updates, p_state = plain.update(grads, p_state, params)
    assert_close(c_updates, p_updates)
  mu = optax.tree_utils.tree_get(c_state, "mu")
  assert_close(mu, optax.tree_utils.tree_get(p_state, "mu"))


def _lamb_clipped():
  return optax_lamb.lamb(1e-2, weight_decay=0.01, max_grad_norm=1.0)


# Where a scale passed to update reaches lamb after unscale_gradients: through wrappers (whose
# lax.cond hands lamb new tracers), nested and named chains.
_UNSCALED_FIRST = {
  "skip_wrapper": lambda: optax.chain(
    optax_lamb.unscale_gradients(), optax_lamb.skip_nonfinite(_lamb_clipped())
  ),
  "named_chain": lambda: optax.named_chain(
    ("unscale", optax_lamb.unscale_gradients()), ("lamb", _lamb_clipped())
  ),
  "nested_chain": lambda: optax.chain(
    optax_lamb.unscale_gradients(), optax.chain(optax.identity(), _lamb_clipped())
  ),
  "inject_hyperparams": lambda: optax.chain(
    optax_lamb.unscale_gradients(),
    optax.inject_hyperparams(optax_lamb.lamb)(
      learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0
    ),
  ),
  "multi_steps": lambda: optax.MultiSteps(
    optax.chain(optax_lamb.unscale_gradients(), _lamb_clipped()), every_k_schedule=1
  ),
}


def _scaled_run(tx, scale: float, **extra) -> dict:
  grads = [jax.tree.map(lambda g: g * scale, g) for g in tiny_grads(3)]
  params, state = tiny_params(), tx.init(tiny_params())
  step = jax.jit(lambda p, s, g: tx.update(g, s, p, **extra))
  for g in grads:
    updates, state = step(params, state, g)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("composition", sorted(_UNSCALED_FIRST))
def test_grad_scale_is_divided_out_once_in_any_chain(composition):
  """Through wrappers and nested chains: a scale passed to update (an array, under jit) reaches
  lamb after unscale_gradients through wrappers and nested chains; it is divided out once."""
  scale = jnp.float32(512.0)
  got = _scaled_run(_UNSCALED_FIRST[composition](), 512.0, grad_scale=scale)
  assert_close(got, run_steps(_lamb_clipped()))


def test_unscale_gradients_after_lamb_leaves_its_updates():
  """The other order: an unscale_gradients after lamb does not divide lamb's updates
  (lamb took the scale)."""
  chained = optax.chain(_lamb_clipped(), optax_lamb.unscale_gradients())
  got = _scaled_run(chained, 64.0, grad_scale=64.0)
  assert_close(got, run_steps(_lamb_clipped()))


def test_a_scale_given_when_built_is_the_stage_own():
  """Both places: lamb built with grad_scale=s0 after unscale_gradients(s) divides by both (each
  stage's own scale); lamb built with s0 and given s at update refuses, naming grad_scale."""
  built = lambda: optax_lamb.lamb(1e-2, weight_decay=0.01, max_grad_norm=1.0, grad_scale=4.0)
  chained = optax.chain(optax_lamb.unscale_gradients(32.0), built())
  assert_close(_scaled_run(chained, 4.0 * 32.0), run_steps(_lamb_clipped()))
  with pytest.raises(ValueError, match=r"grad_scale was given both .* grad_scale=32\.0"):
    _scaled_run(optax.chain(optax_lamb.unscale_gradients(), built()), 1.0, grad_scale=32.0)


def test_unscale_gradients_alone_still_divides():
  """The guard of the rule: a chain whose only reader of grad_scale is unscale_gradients (asked
  to read it: from_update=True), and lamb called on its own, each divide once."""
  sgd = optax.sgd(0.1)
  chained = optax.chain(optax_lamb.unscale_gradients(from_update=True), sgd)
  assert_close(_scaled_run(chained, 16.0, grad_scale=16.0), run_steps(sgd))
  assert_close(_scaled_run(_lamb_clipped(), 16.0, grad_scale=16.0), run_steps(_lamb_clipped()))


def test_unscale_gradients_reads_the_update_scale_only_when_asked():
  """The contract, explicit: lamb reads update(..., grad_scale=s); unscale_gradients() leaves it
  alone (a chain of it and sgd is sgd), and from_update=True makes it divide, so before lamb
  the scale is divided twice (the documented misuse, computed as written)."""
  sgd = optax.sgd(0.1)
  assert_close(
    _scaled_run(optax.chain(optax_lamb.unscale_gradients(), sgd), 1.0, grad_scale=16.0),
    run_steps(sgd),
  )
  twice = optax.chain(optax_lamb.unscale_gradients(from_update=True), _lamb_clipped())
  got = _scaled_run(twice, 16.0 * 16.0, grad_scale=16.0)
  assert_close(got, run_steps(_lamb_clipped()))


def _hand_chain(*stages):
  """A chain written by hand (not optax.chain): each stage gets every extra argument."""

  def init(params):
    return tuple(s.init(params) for s in stages)

  def update(updates, state, params=None, **extra):
    new = []
    for stage, s in zip(stages, state, strict=True):
      updates, s = optax.with_extra_args_support(stage).update(updates, s, params, **extra)
      new.append(s)
    return updates, tuple(new)

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("lamb_first", [False, True])
def test_the_contract_needs_no_optax_chain(lamb_first):
  """Who divides does not depend on which chain runs the stages (nothing reads the call
  stack): a hand-written chain divides once, in both orders, as optax.chain does."""
  stages = [optax_lamb.unscale_gradients(), _lamb_clipped()]
  stages = stages[::-1] if lamb_first else stages
  got = _scaled_run(_hand_chain(*stages), 8.0, grad_scale=8.0)
  assert_close(got, run_steps(_lamb_clipped()))
  assert_close(got, _scaled_run(optax.chain(*stages), 8.0, grad_scale=8.0))


def test_unscale_gradients_refuses_two_sources_of_the_scale():
  with pytest.raises(ValueError, match=r"grad_scale=4\.0 and from_update=True"):
    optax_lamb.unscale_gradients(4.0, from_update=True)
  with pytest.raises(TypeError, match=r"from_update must be a bool, got from_update='yes'"):
    optax_lamb.unscale_gradients(from_update="yes")
