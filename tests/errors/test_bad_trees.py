"""Bad input raises a clear error naming the argument, and the state handed in still works.

Decisions: integer, boolean and complex leaves are errors (not frozen); None
leaves present in both params and gradients are accepted (None updates), as in
optax; a tree with no leaves at all is an error, but a tree emptied by
optax.masked / optax.multi_transform (only MaskedNodes) is accepted.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tree_asserts import assert_unchanged, snapshot

import optax_lamb

OPTIONS = [{}, dict(skip_nonfinite=True, master_weights=True, max_grad_norm=1.0)]


@functools.cache
def optimizer(index):
  """One lamb per option set, and its jitted update, shared by the tests (compiled once)."""
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, **OPTIONS[index])
  return tx, jax.jit(tx.update)


def make_params(rng):
  return {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}


def make_grads(rng, params):
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


def check_state_still_works(update, state, params, grads):
  """The state handed to the failed call gives the same result as an untouched copy."""
  fresh = jax.tree.map(lambda x: jnp.array(np.asarray(x)), state)
  u1, s1 = update(grads, state, params)
  u2, s2 = update(grads, fresh, params)
  for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def prepared(index):
  rng = np.random.default_rng()
  params = make_params(rng)
  tx, step = optimizer(index)
  _, state = step(make_grads(rng, params), tx.init(params), params)
  return rng, tx, step, params, state


def bad_updates(rng, params):
  """(description, grads, params, error type, message pattern) for each bad update call."""
  grads = make_grads(rng, params)
  return [
    (
      "int grads",
      {**grads, "w": jnp.ones((4, 3), jnp.int32)},
      params,
      TypeError,
      r"updates \(gradients\)\['w'\] has dtype int32; LAMB updates floating-point",
    ),
    (
      "bool grads",
      {**grads, "b": jnp.ones(3, bool)},
      params,
      TypeError,
      r"updates \(gradients\)\['b'\] has dtype bool",
    ),
    (
      "complex grads",
      {**grads, "w": grads["w"].astype(jnp.complex64)},
      params,
      TypeError,
      r"updates \(gradients\)\['w'\] has complex dtype complex64",
    ),
    (
      "int params",
      grads,
      {**params, "w": jnp.ones((4, 3), jnp.int32)},
      TypeError,
      r"params\['w'\] has dtype int32",
    ),
    (
      "grad shape",
      {**grads, "w": jnp.ones((3, 4))},
      params,
      ValueError,
      r"updates \(gradients\)\['w'\] has shape \(3, 4\) but params\['w'\] has shape \(4, 3\)",
    ),
    (
      "broadcastable grad shape",
      {**grads, "b": jnp.ones((1, 3))},
      params,
      ValueError,
      r"\['b'\] has shape \(1, 3\) but params\['b'\] has shape \(3,\)",
    ),
    (
      "missing grad",
      {"w": grads["w"]},
      params,
      ValueError,
      r"in params but not in updates \(gradients\): \[\"\['b'\]\"\]",
    ),
    (
      "extra grad",
      {**grads, "extra": jnp.ones(2)},
      params,
      ValueError,
      r"in updates \(gradients\) but not in params: \[\"\['extra'\]\"\]",
    ),
    (
      "None grad",
      {**grads, "b": None},
      params,
      ValueError,
      r"None in updates \(gradients\) but not in params: \[\"\['b'\]\"\]",
    ),
    (
      "None param",
      grads,
      {**params, "b": None},
      ValueError,
      r"None in params but not in updates \(gradients\): \[\"\['b'\]\"\]",
    ),
    ("no params", grads, None, ValueError, r"lamb needs params for the trust ratio"),
  ]


CASES = [c[0] for c in bad_updates(np.random.default_rng(0), make_params(np.random.default_rng(0)))]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("index", [0, 1], ids=["plain", "skip-master-clip"])
@pytest.mark.parametrize("case", CASES)
def test_bad_update_raises_and_keeps_state(case, index, jit):
  rng, tx, step, params, state = prepared(index)
  _, grads, bad_params, error, match = {c[0]: c for c in bad_updates(rng, params)}[case]
  snap = snapshot(state)
  with pytest.raises(error, match=match):
    (step if jit else tx.update)(grads, state, bad_params)
  assert_unchanged(state, snap)
  check_state_still_works(step, state, params, make_grads(rng, params))


@pytest.mark.parametrize(
  "params, error, match",
  [
    (
      {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)},
      TypeError,
      r"params\['step'\] has dtype int32",
    ),
    ({"w": jnp.ones(3), "flag": jnp.ones(2, bool)}, TypeError, r"params\['flag'\] has dtype bool"),
    (
      {"w": jnp.ones(3, jnp.complex64)},
      TypeError,
      r"params\['w'\] has complex dtype complex64.*split_real_and_imaginary",
    ),
    ({}, ValueError, r"params has no array leaves \(got \{\}\)"),
    ([], ValueError, r"params has no array leaves \(got \[\]\)"),
    ({"a": None}, ValueError, r"params has no array leaves"),
  ],
  ids=["int", "bool", "complex", "empty-dict", "empty-list", "only-None"],
)
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "skip-master-clip"])
def test_bad_params_at_init(params, error, match, options):
  tx = optax_lamb.lamb(1e-2, **options)
  snap = snapshot(params)
  with pytest.raises(error, match=match):
    tx.init(params)
  with pytest.raises(error, match=match):
    jax.jit(tx.init)(params)
  assert_unchanged(params, snap)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (
      dict(skip_nonfinite="yes"),
      TypeError,
      r"skip_nonfinite must be True or False, got skip_nonfinite='yes'",
    ),
    (
      dict(master_weights=1),
      TypeError,
      r"master_weights must be True or False, got master_weights=1",
    ),
    (
      dict(grad_scale=0.0),
      ValueError,
      r"grad_scale must be a finite number > 0, got grad_scale=0.0",
    ),
    (
      dict(grad_scale=-1024),
      ValueError,
      r"grad_scale must be a finite number > 0, got grad_scale=-1024",
    ),
  ],
)
def test_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_lamb.lamb(1e-2, **kwargs)


def test_grad_scale_given_twice_keeps_state():
  rng, _, _, params, _ = prepared(0)
  tx = optax_lamb.lamb(1e-2, grad_scale=8.0)
  state = tx.init(params)
  snap = snapshot(state)
  with pytest.raises(
    ValueError, match=r"grad_scale was given both when building .* grad_scale=2.0"
  ):
    tx.update(make_grads(rng, params), state, params, grad_scale=2.0)
  with pytest.raises(
    ValueError, match=r"grad_scale must be a finite number > 0, got grad_scale=-2.0"
  ):
    optax_lamb.lamb(1e-2).update(make_grads(rng, params), state, params, grad_scale=-2.0)
  assert_unchanged(state, snap)
  check_state_still_works(jax.jit(tx.update), state, params, make_grads(rng, params))


def test_none_leaves_in_both_trees_are_kept():
  rng = np.random.default_rng()
  params = {"w": jnp.asarray(rng.normal(size=(3, 2))), "frozen": None}
  grads = {"w": jnp.asarray(rng.normal(size=(3, 2))), "frozen": None}
  for options in OPTIONS:
    tx = optax_lamb.lamb(1e-2, **options)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert updates["frozen"] is None
    new = optax.apply_updates(params, updates)
    assert new["frozen"] is None and np.all(np.isfinite(np.asarray(new["w"])))


def test_masked_out_trees_are_accepted():
  """optax.multi_transform gives every inner optimizer a tree; unused labels get only MaskedNodes."""
  rng = np.random.default_rng()
  params = {"w": jnp.asarray(rng.normal(size=(3, 2))), "b": jnp.zeros(2)}
  tx = optax.multi_transform(
    {"lamb": optax_lamb.lamb(1e-2, skip_nonfinite=True), "unused": optax_lamb.lamb(1e-3)},
    {"w": "lamb", "b": "lamb"},
  )
  state = tx.init(params)
  updates, state = tx.update(make_grads(rng, params), state, params)
  assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
  all_false = optax.masked(optax_lamb.lamb(1e-2), {"w": False, "b": False})
  updates, _ = all_false.update(params, all_false.init(params), params)
  assert_unchanged(updates, snapshot(params))  # masked-out leaves pass through unchanged
