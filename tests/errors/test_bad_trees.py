"""Bad trees raise a clear error naming the argument and the path.

Bad trees at update also keep the state: `failed_calls.py` and test_failed_call_keeps_state.py.

Decisions: integer, boolean and complex leaves are errors (not frozen); None
leaves present in both params and gradients are accepted (None updates), as in
optax; a tree with no leaves at all is an error, but a tree emptied by
optax.masked / optax.multi_transform (only MaskedNodes) is accepted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import assert_unchanged, snapshot
from helpers.trees import random_like

import optax_lamb

OPTIONS = [{}, dict(skip_nonfinite=True, master_weights=True, max_grad_norm=1.0)]


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


def test_none_leaves_in_both_trees_are_kept(rng):
  params = {"w": jnp.asarray(rng.normal(size=(3, 2))), "frozen": None}
  grads = {"w": jnp.asarray(rng.normal(size=(3, 2))), "frozen": None}
  for options in OPTIONS:
    tx = optax_lamb.lamb(1e-2, **options)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert updates["frozen"] is None
    new = optax.apply_updates(params, updates)
    assert new["frozen"] is None and np.all(np.isfinite(np.asarray(new["w"])))


def test_masked_out_trees_are_accepted(rng):
  """optax.multi_transform gives every inner optimizer a tree; unused labels get only MaskedNodes."""
  params = {"w": jnp.asarray(rng.normal(size=(3, 2))), "b": jnp.zeros(2)}
  tx = optax.multi_transform(
    {"lamb": optax_lamb.lamb(1e-2, skip_nonfinite=True), "unused": optax_lamb.lamb(1e-3)},
    {"w": "lamb", "b": "lamb"},
  )
  state = tx.init(params)
  updates, state = tx.update(random_like(rng, params), state, params)
  assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
  all_false = optax.masked(optax_lamb.lamb(1e-2), {"w": False, "b": False})
  updates, _ = all_false.update(params, all_false.init(params), params)
  assert_unchanged(updates, snapshot(params))  # masked-out leaves pass through unchanged


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


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_python_number_leaves_step_alike_eager_and_jitted(implementation):
  """A Python float leaf becomes a float32 array, as jax.jit makes it, in both modes (which
  agree up to the rounding of fused and unfused float32 arithmetic)."""
  from helpers.asserts import assert_trees_close
  from helpers.implementations import lamb_for

  params = {"f": 1.5, "w": jnp.linspace(0.5, 1.0, 6).reshape(2, 3)}
  grads = {"f": 0.25, "w": jnp.full((2, 3), 0.1)}
  tx = lamb_for(implementation)(1e-2, weight_decay=0.01)
  state = tx.init(params)
  eager = tx.update(grads, state, params)
  jitted = jax.jit(tx.update)(grads, state, params)
  assert_trees_close(eager, jitted)
  new_params, _ = optax_lamb.update_and_apply(tx, grads, state, params)
  assert new_params["f"].dtype == jnp.float32


@pytest.mark.parametrize("where", ["params", "grads"])
def test_a_string_leaf_is_refused_naming_its_path(where):
  tx = optax_lamb.lamb(1e-2)
  params = {"w": jnp.ones(3), "name": jnp.ones(())}
  grads = jax.tree.map(jnp.ones_like, params)
  state = tx.init(params)
  bad = {**(params if where == "params" else grads), "name": "bias"}
  args = (grads, bad) if where == "params" else (bad, params)
  with pytest.raises(TypeError, match=r"\['name'\] has dtype <U4"):
    tx.update(args[0], state, args[1])
  if where == "params":
    with pytest.raises(TypeError, match=r"params\['name'\] has dtype <U4"):
      tx.init(bad)
