"""A state that does not belong to the params or to the optimizer raises at update.

`update` (and the fused `update_and_apply`) compares the state with what this
optimizer's `init` gives for the params handed in (`jax.eval_shape(init, params)`:
structure, node types, shapes, dtypes; static, at trace time). Every mismatch is a
ValueError that names the state's path, what was expected and what was found, and
the state handed in is left as it was and still works with its own optimizer
(the table of such states: `failed_calls.FOREIGN_STATES`).
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from failed_calls import SCHEDULE, W1, W4, invoke, lamb, params_of
from flax import serialization
from helpers.asserts import assert_trees_equal

import optax_lamb


def ones_like(params):
  return jax.tree.map(jnp.ones_like, params)


def _with_count(count):
  return lambda s: (s[0], s[1]._replace(count=count), *s[2:])


@pytest.mark.parametrize(
  "edit, match",
  [
    (
      lambda s: jax.eval_shape(lambda: s),
      r"state\[1\]\.count is ShapeDtypeStruct\(shape=\(\), dtype=int32\) \(ShapeDtypeStruct\) "
      r"where an array of shape \(\) and dtype int32 is expected\. .*jax\.eval_shape",
    ),
    (
      _with_count(jnp.zeros((), jnp.float32)),
      r"state\[1\]\.count has dtype float32 where init\(params\) gives dtype int32",
    ),
    (_with_count("3"), r"state\[1\]\.count is '3' \(str\) where an array of shape \(\)"),
    (
      lambda s: (*s[:3], s[3]._replace(ratios=jnp.ones((2, 1))), s[4]),
      r"state\[3\]\.ratios has shape \(2, 1\) where init\(params\) gives shape \(1,\)",
    ),
  ],
  ids=["abstract (eval_shape) state", "float count", "str count", "batched ratios"],
)
def test_state_leaves_that_are_not_init_arrays(edit, match):
  params = params_of(W4)
  tx = lamb()
  state = edit(tx.init(params))
  with pytest.raises(ValueError, match=match):
    tx.update(ones_like(params), state, params)


def test_wrong_state_inside_optax_wrappers():
  """inject_hyperparams, chain and MultiSteps hand lamb its part of the state: it is checked too."""
  small, big = params_of(W1), params_of(W4)
  match = r"state\[1\]\.mu\['w'\] has shape \(1,\) where init\(params\) gives shape \(4,\)"
  injected = optax.inject_hyperparams(optax_lamb.lamb)(learning_rate=1e-2)
  state = injected.init(small)
  with pytest.raises(ValueError, match=match):
    injected.update(ones_like(big), state, big)
  chained = optax.chain(optax.clip(1.0), lamb())
  with pytest.raises(ValueError, match=match):
    chained.update(ones_like(big), chained.init(small), big)
  multi = optax.MultiSteps(lamb(), every_k_schedule=2)
  # (MultiSteps's own accumulator was made for (1,) too: caught as the gradients' shape)
  with pytest.raises(ValueError, match=r"has shape \(1,\) .* has shape \(4,\)"):
    jax.jit(multi.update)(ones_like(big), multi.init(small), big)


def test_standalone_skip_nonfinite_names_its_state():
  params = params_of(W4)
  tx = optax_lamb.skip_nonfinite(optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"skip_nonfinite: the optimizer state is tuple where "):
    tx.update(ones_like(params), optax.sgd(0.1).init(params), params)


RESTORE = r"restored without a target.*jax\.eval_shape\(tx\.init, params\)"


@pytest.mark.parametrize(
  "kwargs, where",
  [
    (
      {},
      r"state is a list of 5 \(None, dict, None, dict, None\) where init\(params\) gives a tuple",
    ),
    (
      {"skip_nonfinite": True, "learning_rate": SCHEDULE},
      r"state is a dict with keys \['consecutive', 'inner_state', 'total'\] where init\(params\) "
      r"gives optax_lamb\.SkipNonFiniteState",
    ),
  ],
  ids=["plain", "skip-schedule"],
)
def test_checkpoint_restored_without_target_says_how_to_restore(kwargs, where, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  params = params_of({"w": (3, 2), "b": (2,)})
  tx = lamb(**kwargs)
  update = jax.jit(tx.update)
  _, state = update(ones_like(params), tx.init(params), params)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  untargeted = checkpointer.restore(tmp_path / "ckpt")
  for how in ("update", "jit", "update_and_apply"):
    with pytest.raises(ValueError, match=where + ".*" + RESTORE):
      invoke(how, tx, ones_like(params), untargeted, params)
  # flax.serialization without a target gives dicts too.
  with pytest.raises(ValueError, match=RESTORE):
    tx.update(
      ones_like(params), serialization.msgpack_restore(serialization.to_bytes(state)), params
    )
  # Restored as the message says, it resumes.
  restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(tx.init, params))
  assert_trees_equal(
    update(ones_like(params), restored, params), update(ones_like(params), state, params)
  )


def test_states_that_fit_are_accepted():
  """No false alarm: batched (vmap) states, tree_map_params'd states, MaskedNode trees."""
  params = params_of({"w": (3, 2), "b": (2,)})
  tx = lamb(weight_decay=0.01, skip_nonfinite=True)
  batched = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
  states = jax.vmap(tx.init)(batched)
  updates, states = jax.jit(jax.vmap(tx.update))(ones_like(batched), states, batched)
  assert updates["w"].shape == (2, 3, 2) and optax_lamb.trust_ratios(states)["w"].shape == (2,)
  # optax.tree_map_params rebuilds the state from init(placeholder): the trust-ratio layout it
  # leaves is the placeholder's, and update puts these params' layout back.
  plain = lamb(stacked_axes={"w": 1, "b": 0})
  update = jax.jit(plain.update)
  state = plain.init(params)
  mapped = optax.tree_map_params(plain, lambda v: v, state)
  (u1, s1) = update(ones_like(params), mapped, params)
  assert_trees_equal((u1, s1), update(ones_like(params), state, params))
  assert optax_lamb.trust_ratios(s1)["w"].shape == (3,)
  masked = optax.masked(lamb(), {"w": True, "b": False})
  jax.jit(masked.update)(ones_like(params), masked.init(params), params)


MOMENT_KINDS = {
  "float32": {},
  "bfloat16": {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16},
  "8-bit": {"mu_dtype": jnp.int8, "nu_dtype": jnp.uint8},
}
FLAX_RESTORES = {
  "from_bytes": lambda target, s: serialization.from_bytes(target, serialization.to_bytes(s)),
  "from_state_dict": lambda target, s: serialization.from_state_dict(
    target, serialization.to_state_dict(s)
  ),
}


@pytest.mark.parametrize("restore", FLAX_RESTORES)
@pytest.mark.parametrize("saved", MOMENT_KINDS)
@pytest.mark.parametrize("into", MOMENT_KINDS)
def test_flax_restore_into_other_moment_dtypes_names_the_mismatch(into, saved, restore):
  """A state saved with one kind of moments restored through flax.serialization into the state of
  an optimizer with another: a ValueError naming the moment's path, at the restore where the
  target has 8-bit moments (flax itself failed there with an AttributeError), else at the first
  update; the target is left as it was. The same kinds restore bit for bit."""
  params = params_of({"w": (16, 512), "b": (3,)})  # w quantized (8,192 elements), b not
  saved_tx, tx = lamb(**MOMENT_KINDS[saved]), lamb(**MOMENT_KINDS[into])
  _, state = saved_tx.update(ones_like(params), saved_tx.init(params), params)
  target = tx.init(params)
  if saved == into:
    assert_trees_equal(FLAX_RESTORES[restore](target, state), state)
    return
  if into == "8-bit":
    match = (
      r"checkpoint holds an array of shape \(16, 512\) and dtype " + saved + r" at 1/mu/w where "
      r"the target state has an 8-bit moment \(QuantizedMoment: codes int8 of shape \(16, 512\)"
    )
    with pytest.raises(ValueError, match=match):
      FLAX_RESTORES[restore](target, state)
  else:
    restored = FLAX_RESTORES[restore](target, state)
    with pytest.raises(ValueError, match=r"state\[1\]\.mu\['(w|b)'\] (is|has) "):
      tx.update(ones_like(params), restored, params)
  assert_trees_equal(target, tx.init(params))
