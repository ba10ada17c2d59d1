"""Drop-in equality with optax: lamb, and each stage against its optax twin."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import FEW_ROUNDINGS, assert_trees_close
from helpers.options import LR, STEPS
from helpers.trees import make_grads, make_params

import optax_lamb


def random_tree(rng):
  return {
    "dense": {"kernel": rng.standard_normal((8, 4)), "bias": np.zeros(4)},
    "scalar": np.asarray(rng.standard_normal()),
    "conv": rng.standard_normal((3, 3, 2, 5)),
  } | {"emb": [rng.standard_normal((6, 3)), rng.standard_normal(3)]}


def as_jax(tree, dtype=jnp.float32):
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def run(tx, params, grads_list, apply=True):
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates_seen = []
  for grads in grads_list:
    updates, state = update(grads, state, params)
    updates_seen.append(updates)
    if apply:
      params = optax.apply_updates(params, updates)
  return params, state, updates_seen


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(learning_rate=1e-2),
    dict(learning_rate=1e-2, weight_decay=0.05),
    dict(learning_rate=optax.cosine_decay_schedule(1e-2, 20), b1=0.8, b2=0.99, eps=1e-4),
    dict(
      learning_rate=1e-2,
      weight_decay=0.1,
      eps_root=1e-8,
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
    ),
  ],
)
def test_lamb_equals_optax_lamb(kwargs, rng):
  params = as_jax(random_tree(rng))
  grads = [as_jax(random_tree(rng)) for _ in range(10)]
  ours, _, _ = run(optax_lamb.lamb(**kwargs), params, grads)
  theirs, _, _ = run(optax.lamb(**kwargs), params, grads)
  assert_trees_close(ours, theirs, rtol=2 * FEW_ROUNDINGS)


def test_adam_state_interchanges_with_optax(rng):
  params = as_jax(random_tree(rng))
  grads = [as_jax(random_tree(rng)) for _ in range(4)]
  ours, theirs = optax_lamb.scale_by_adam(), optax.scale_by_adam()
  _, state, _ = run(theirs, params, grads[:2], apply=False)
  assert isinstance(state, optax.ScaleByAdamState)
  # Continue from optax's state with ours, and from ours with optax's: same updates.
  # Both jitted: XLA's pow(b2, t) differs from the eager one by an ulp, which the
  # cancellation in 1 - b2^t turns into ~1e-5; under jit both libraries agree.
  ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
  u_ours, s_ours = ours_update(grads[2], state, params)
  u_theirs, s_theirs = theirs_update(grads[2], state, params)
  assert_trees_close(u_ours, u_theirs, rtol=FEW_ROUNDINGS)
  assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
  u2_theirs, _ = theirs_update(grads[3], s_ours, params)
  u2_ours, _ = ours_update(grads[3], s_ours, params)
  assert_trees_close(u2_ours, u2_theirs, rtol=FEW_ROUNDINGS)


@pytest.mark.parametrize(
  "kwargs", [{}, dict(min_norm=1e-3), dict(trust_coefficient=0.02), dict(eps=1e-2)]
)
def test_scale_by_trust_ratio_equals_optax(kwargs, rng):
  params = as_jax(random_tree(rng))
  updates = as_jax(random_tree(rng))
  ours = optax_lamb.scale_by_trust_ratio(**kwargs)
  theirs = optax.scale_by_trust_ratio(**kwargs)
  u_ours, _ = ours.update(updates, ours.init(params), params)
  u_theirs, _ = theirs.update(updates, theirs.init(params), params)
  assert_trees_close(u_ours, u_theirs, rtol=FEW_ROUNDINGS)


def test_add_decayed_weights_equals_optax(rng):
  params = as_jax(random_tree(rng))
  updates = as_jax(random_tree(rng))
  mask = jax.tree.map(lambda x: x.ndim > 1, params)
  for m in (None, mask):
    ours = optax_lamb.add_decayed_weights(0.3, m)
    theirs = optax.add_decayed_weights(0.3, m)
    u_ours, _ = ours.update(updates, ours.init(params), params)
    u_theirs, _ = theirs.update(updates, theirs.init(params), params)
    assert_trees_close(u_ours, u_theirs, rtol=FEW_ROUNDINGS)


def test_weight_decay_schedule_follows_step_count(rng):
  params = as_jax(random_tree(rng))
  zeros = jax.tree.map(jnp.zeros_like, params)
  schedule = optax.linear_schedule(1.0, 0.0, 4)
  tx = optax_lamb.add_decayed_weights(schedule)
  state = tx.init(params)
  for step in range(5):
    updates, state = tx.update(zeros, state, params)
    expected = jax.tree.map(lambda p, s=step: schedule(s) * p, params)
    assert_trees_close(updates, expected, rtol=FEW_ROUNDINGS)


@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_by_global_norm_equals_optax(max_norm, rng, device_count_seen):
  updates = as_jax(random_tree(rng))
  ours = optax_lamb.clip_by_global_norm(max_norm)
  theirs = optax.clip_by_global_norm(max_norm)
  u_ours, _ = ours.update(updates, ours.init(updates))
  u_theirs, _ = theirs.update(updates, theirs.init(updates))
  assert_trees_close(u_ours, u_theirs, rtol=FEW_ROUNDINGS)


def test_lamb_on_the_option_tree_equals_optax_lamb():
  """The option tree (a zero leaf, a scalar, an empty leaf, stacked leaves), ten steps."""
  params = make_params()
  grads = [make_grads(params, t) for t in range(STEPS)]
  ours, _, _ = run(optax_lamb.lamb(LR, weight_decay=0.01), params, grads)
  theirs, _, _ = run(optax.lamb(LR, weight_decay=0.01), params, grads)
  assert_trees_close(ours, theirs)


# Every public stage with an optax twin (docs/api.md's table), and the arguments to run it on
# defaults (those optax requires).
_TWINS = {
  "lamb": dict(learning_rate=1e-2),
  "scale_by_adam": {},
  "add_decayed_weights": {},
  "scale_by_trust_ratio": {},
  "clip_by_global_norm": dict(max_norm=1.0),
}


@pytest.mark.parametrize("name", list(_TWINS))
def test_defaults_are_the_optax_twins(name):
  ours = inspect.signature(getattr(optax_lamb, name)).parameters
  theirs = inspect.signature(getattr(optax, name)).parameters
  shared = [p for p in theirs if p in ours]
  assert shared, name
  assert {p: ours[p].default for p in shared} == {p: theirs[p].default for p in shared}


@pytest.mark.parametrize("name", list(_TWINS))
def test_defaults_compute_what_the_optax_twin_computes(name, rng):
  """At gradients near 1e-4 (where eps matters), params 1, so every stage acts."""
  params = as_jax(jax.tree.map(lambda x: 1.0 + 0.1 * x, random_tree(rng)))
  grads_list = [as_jax(jax.tree.map(lambda x: 1e-4 * x, random_tree(rng))) for _ in range(3)]
  kwargs = _TWINS[name]
  _, _, ours = run(getattr(optax_lamb, name)(**kwargs), params, grads_list, apply=False)
  _, _, theirs = run(getattr(optax, name)(**kwargs), params, grads_list, apply=False)
  assert_trees_close(ours, theirs, rtol=FEW_ROUNDINGS)
