"""A state that does not belong to the params or to the optimizer raises at update (issue 12, class 3).

`update` (and the fused `update_and_apply`) compares the state with what this
optimizer's `init` gives for the params handed in (`jax.eval_shape(init, params)`:
structure, node types, shapes, dtypes; static, at trace time). Every mismatch is a
ValueError that names the state's path, what was expected and what was found, and
the state handed in is left as it was and still works with its own optimizer.
"""

import functools

import _fast_compile
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from tree_asserts import assert_unchanged, snapshot

import optax_lamb

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)


def lamb(**kwargs):
  return optax_lamb.lamb(kwargs.pop("learning_rate", 1e-2), **kwargs)


def params_of(shapes, dtype=jnp.float32):
  return {
    k: jnp.linspace(0.5, 1.5, int(np.prod(s)), dtype=dtype).reshape(s) for k, s in shapes.items()
  }


W1, W3, W4 = ({"w": (n,)} for n in (1, 3, 4))

# id: (the optimizer used, the optimizer that made the state, its params, the params used, message)
CASES = {
  "shape (1,) for (4,)": (
    lamb,
    lamb,
    params_of(W1),
    params_of(W4),
    r"state\[1\]\.mu\['w'\] has shape \(1,\) where init\(params\) gives shape \(4,\)",
  ),
  "shape (3,) for (4,)": (
    lamb,
    lamb,
    params_of(W3),
    params_of(W4),
    r"state\[1\]\.mu\['w'\] has shape \(3,\) where init\(params\) gives shape \(4,\)",
  ),
  "shape (4, 3) for (3, 4)": (
    lamb,
    lamb,
    params_of({"w": (4, 3)}),
    params_of({"w": (3, 4)}),
    r"state\[1\]\.mu\['w'\] has shape \(4, 3\) where init\(params\) gives shape \(3, 4\)",
  ),
  "other leaf names": (
    lamb,
    lamb,
    params_of({"v": (4,)}),
    params_of(W4),
    r"state\[1\]\.mu is a dict with keys \['v'\] where init\(params\) gives a dict with keys "
    r"\['w'\] \(missing \[\"\['w'\]\"\]; not expected \[\"\['v'\]\"\]\)",
  ),
  "a param added": (
    lamb,
    lamb,
    params_of(W4),
    params_of({"w": (4,), "b": (2,)}),
    r"state\[1\]\.mu is a dict with keys \['w'\] where .* keys \['b', 'w'\] \(missing",
  ),
  "state for bfloat16 params": (
    lamb,
    lamb,
    params_of(W4, jnp.bfloat16),
    params_of(W4),
    r"state\[1\]\.mu\['w'\] has dtype bfloat16 where init\(params\) gives dtype float32.*mu_dtype",
  ),
  "mu_dtype=bfloat16 state": (
    lamb,
    functools.partial(lamb, mu_dtype=jnp.bfloat16),
    params_of(W4),
    params_of(W4),
    r"state\[1\]\.mu\['w'\] has dtype bfloat16 where init\(params\) gives dtype float32",
  ),
  "state without stacked_axes": (
    functools.partial(lamb, stacked_axes=1),
    lamb,
    params_of({"w": (2, 3)}),
    params_of({"w": (2, 3)}),
    r"state\[3\]\.ratios has shape \(1,\) where init\(params\) gives shape \(2,\).*stacked_axes",
  ),
  "optax.lamb state": (
    lamb,
    optax.lamb,
    params_of(W4),
    params_of(W4),
    r"state is a tuple of 4 \(optax\.ScaleByAdamState, optax\.EmptyState, optax\.EmptyState, "
    r"optax\.EmptyState\) where init\(params\) gives a tuple of 5 \(optax\.EmptyState, "
    r"optax\.ScaleByAdamState, .*optax\.lamb",
  ),
  "optax.adam state": (
    lamb,
    optax.adam,
    params_of(W4),
    params_of(W4),
    r"state is a tuple of 2 \(optax\.ScaleByAdamState, optax\.EmptyState\) where init\(params\) "
    r"gives a tuple of 5",
  ),
  "plain state, skip_nonfinite=True": (
    functools.partial(lamb, skip_nonfinite=True),
    lamb,
    params_of(W4),
    params_of(W4),
    r"state is a tuple of 5 \(.*\) where init\(params\) gives optax_lamb\.SkipNonFiniteState\. "
    r".*skip_nonfinite",
  ),
  "skip_nonfinite state, plain lamb": (
    lamb,
    functools.partial(lamb, skip_nonfinite=True),
    params_of(W4),
    params_of(W4),
    r"state is optax_lamb\.SkipNonFiniteState where init\(params\) gives a tuple of 5",
  ),
  "plain state, master_weights=True": (
    functools.partial(lamb, master_weights=True),
    lamb,
    params_of(W4),
    params_of(W4),
    r"state is a tuple of 5 \(.*\) where init\(params\) gives optax_lamb\.MasterWeightsState",
  ),
  "float learning rate state, schedule": (
    functools.partial(lamb, learning_rate=SCHEDULE),
    lamb,
    params_of(W4),
    params_of(W4),
    r"state\[4\] is optax\.EmptyState where init\(params\) gives optax\.ScaleByScheduleState.*"
    r"learning_rate or weight_decay schedule",
  ),
  "schedule learning rate state, float": (
    lamb,
    functools.partial(lamb, learning_rate=SCHEDULE),
    params_of(W4),
    params_of(W4),
    r"state\[4\] is optax\.ScaleByScheduleState where init\(params\) gives optax\.EmptyState",
  ),
  "float weight decay state, schedule": (
    functools.partial(lamb, weight_decay=SCHEDULE),
    functools.partial(lamb, weight_decay=0.01),
    params_of(W4),
    params_of(W4),
    r"state\[2\] is optax\.EmptyState where init\(params\) gives optax\.ScaleByScheduleState",
  ),
  "no grad_scale state, grad_scale schedule": (
    functools.partial(lamb, grad_scale=lambda count: 2.0),
    lamb,
    params_of(W4),
    params_of(W4),
    r"state is a tuple of 5 \(.*\) where init\(params\) gives a tuple of 2 "
    r"\(optax_lamb\.UnscaleGradientsState, tuple\)",
  ),
  "weight-decay mask state, no mask": (
    functools.partial(lamb, weight_decay=0.01),
    functools.partial(lamb, weight_decay=0.01, mask={"w": True}),
    params_of(W4),
    params_of(W4),
    r"state\[2\] is optax\.MaskedState where init\(params\) gives optax\.EmptyState.*mask",
  ),
  "skip_nonfinite state for other shapes": (
    functools.partial(lamb, skip_nonfinite=True),
    functools.partial(lamb, skip_nonfinite=True),
    params_of(W1),
    params_of(W4),
    r"state\.inner_state\[1\]\.mu\['w'\] has shape \(1,\) where init\(params\) gives shape \(4,\)",
  ),
  "master weights for other shapes": (
    functools.partial(lamb, master_weights=True),
    functools.partial(lamb, master_weights=True),
    params_of(W3),
    params_of(W4),
    r"state\.master\['w'\] has shape \(3,\) where init\(params\) gives shape \(4,\)",
  ),
}


def ones_like(params):
  return jax.tree.map(jnp.ones_like, params)


@functools.cache
def made(case):
  """(used tx, state, params used, message, own tx, own params, own jitted update); built once."""
  used, own, own_params, params, match = CASES[case]
  own_tx = own(1e-2) if own in (optax.lamb, optax.adam) else own()
  own_update = _fast_compile.jit(own_tx.update)
  return used(), own_tx.init(own_params), params, match, own_tx, own_params, own_update


def call(how, tx, grads, state, params):
  if how == "update":
    return tx.update(grads, state, params)
  if how == "jit":
    return jax.jit(tx.update)(grads, state, params)
  return optax_lamb.update_and_apply(tx, grads, state, params)


@pytest.mark.parametrize("how", ["update", "jit", "update_and_apply"])
@pytest.mark.parametrize("case", list(CASES))
def test_foreign_state_raises_and_is_kept(case, how):
  tx, state, params, match, *_ = made(case)
  snap = snapshot(state)
  with pytest.raises(ValueError, match=r"^lamb: the optimizer state does not fit .*" + match):
    call(how, tx, ones_like(params), state, params)
  assert_unchanged(state, snap)


@pytest.mark.parametrize("case", list(CASES))
def test_foreign_state_still_works_with_its_own_optimizer(case):
  tx, state, params, _, _, own_params, own_update = made(case)
  with pytest.raises(ValueError):
    call("jit", tx, ones_like(params), state, params)
  fresh = jax.tree.map(lambda x: jnp.array(np.asarray(x)), state)
  got = own_update(ones_like(own_params), state, own_params)
  want = own_update(ones_like(own_params), fresh, own_params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
      call(how, tx, ones_like(params), untargeted, params)
  # flax.serialization without a target gives dicts too.
  with pytest.raises(ValueError, match=RESTORE):
    tx.update(
      ones_like(params), serialization.msgpack_restore(serialization.to_bytes(state)), params
    )
  # Restored as the message says, it resumes.
  restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(tx.init, params))
  got, want = update(ones_like(params), restored, params), update(ones_like(params), state, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
  (u1, s1), (u2, s2) = (
    update(ones_like(params), mapped, params),
    update(ones_like(params), state, params),
  )
  for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert optax_lamb.trust_ratios(s1)["w"].shape == (3,)
  masked = optax.masked(lamb(), {"w": True, "b": False})
  jax.jit(masked.update)(ones_like(params), masked.init(params), params)
