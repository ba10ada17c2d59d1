"""Issue 34 ("Reliability round 4"), failure classes 1-3 for lamb and the wrappers.

Written before the fixes, from f5df42e, where the cases of classes 2 and 3 fail (each
docstring names its class); lamb's own cases of class 1 passed there already and guard it. The compat constructors' cases are in
tests/compat/test_compat_round4.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.implementations import TINY_BLOCKS

import optax_lamb
from optax_lamb.backends.pallas import PallasBackend

PALLAS = PallasBackend(block_sizes=TINY_BLOCKS, interpret=True)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}
RTOL = 1e-5  # float32 arrays (injected) against Python floats (built in)


def _params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    "b": jnp.asarray(0.1 * rng.normal(size=(3,)), jnp.float32),
  }


def _grads(steps: int, seed: int = 1) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [
    {
      "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }  # fmt: skip
    for _ in range(steps)
  ]


def _run(tx, steps: int = 3, params=None, **extra) -> dict:
  params = _params() if params is None else params
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  for grads in _grads(steps):
    params, state = step(params, state, grads)
  return params


def _assert_close(got: dict, want: dict) -> None:
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=1e-7, err_msg=name)


# --- class 1: numeric arguments injected by optax.inject_hyperparams ------------------------

# lamb's numeric arguments, each with a value other than its default (and one that acts here).
LAMB_NUMBERS = {
  "learning_rate": 2e-2,
  "b1": 0.8,
  "b2": 0.99,
  "eps": 1e-4,
  "eps_root": 1e-8,
  "weight_decay": 0.1,
  "min_trust_ratio": 0.5,
  "max_trust_ratio": 0.7,
  "max_grad_norm": 0.5,
  "grad_scale": 4.0,
}


# Pallas in interpret mode is slow: the arguments its kernels read as scalars from the step.
_INJECTED_CASES = [(name, impl) for name in sorted(LAMB_NUMBERS) for impl in ("xla", "reference")]
_INJECTED_CASES += [(name, "pallas") for name in ("learning_rate", "max_grad_norm", "weight_decay")]


@pytest.mark.parametrize("name,implementation", _INJECTED_CASES)
def test_lamb_under_inject_hyperparams(name, implementation):
  """Class 1: lamb with one numeric argument injected (an array, traced under jit) computes what
  lamb built with the same Python float computes, on every implementation."""
  kwargs = {"implementation": IMPLEMENTATIONS[implementation]}
  if name != "learning_rate":
    kwargs["learning_rate"] = 1e-2
  kwargs[name] = LAMB_NUMBERS[name]
  injected = optax.inject_hyperparams(optax_lamb.lamb)(**kwargs)
  _assert_close(_run(injected), _run(optax_lamb.lamb(**kwargs)))


# --- class 2: silent wrong results -------------------------------------------------------------

_SCALED_BUILDERS = {
  "lamb": lambda: optax_lamb.lamb(1e-2, weight_decay=0.01),
  "lamb_skip_nonfinite": lambda: optax_lamb.lamb(1e-2, skip_nonfinite=True),
  "skip_nonfinite_wrapper": lambda: optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2)),
  "lamb_master_weights": lambda: optax_lamb.lamb(1e-2, master_weights=True),
  "compat_apex": lambda: optax_lamb.compat.apex_fused_lamb(lr=1e-2),
}


@pytest.mark.parametrize("builder", sorted(_SCALED_BUILDERS))
def test_unscale_gradients_then_lamb_divides_once(builder):
  """Class 2: chain(unscale_gradients(), lamb) with update(..., grad_scale=s), the pattern
  unscale_gradients' docstring shows, divides by s once: the moments see g, not g / s^2."""
  scale = 1024.0
  chained = optax.chain(optax_lamb.unscale_gradients(), _SCALED_BUILDERS[builder]())
  plain = _SCALED_BUILDERS[builder]()
  params = _params()
  c_state, p_state = chained.init(params), plain.init(params)
  for grads in _grads(3):
    scaled = jax.tree.map(lambda g: g * scale, grads)
    c_updates, c_state = chained.update(scaled, c_state, params, grad_scale=scale)
    p_updates, p_state = plain.update(grads, p_state, params)
    _assert_close(c_updates, p_updates)
  mu = optax.tree_utils.tree_get(c_state, "mu")
  _assert_close(mu, optax.tree_utils.tree_get(p_state, "mu"))


def _nan_bias_params() -> dict:
  params = _params()
  return {"w": params["w"], "b": params["b"].at[1].set(jnp.nan)}


_UNDECAYED = dict(weight_decay=0.1, mask={"w": True, "b": False})


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_nan_param_of_undecayed_leaf_is_not_a_zero_norm(implementation):
  """Class 2: a NaN in a param of an undecayed leaf must not read as ||p|| = 0 (ratio 1): the
  leaf's ratio and update are non-finite, as with optax.lamb; the other leaf is untouched."""
  params, grads = _nan_bias_params(), _grads(1)[0]
  ours = optax_lamb.lamb(1e-2, implementation=IMPLEMENTATIONS[implementation], **_UNDECAYED)
  theirs = optax.lamb(1e-2, **_UNDECAYED)
  updates, state = jax.jit(ours.update)(grads, ours.init(params), params)
  want, _ = theirs.update(grads, theirs.init(params), params)
  ratio = optax_lamb.trust_ratios(state)["b"]
  assert not np.isfinite(float(ratio)), f"trust ratio of the NaN leaf: {float(ratio)}"
  np.testing.assert_array_equal(np.isfinite(updates["b"]), np.isfinite(want["b"]))
  assert np.all(np.isfinite(updates["w"]))


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_nan_param_in_one_stacked_slice_is_not_a_zero_norm(implementation):
  """Class 2, stacked: a NaN in one layer of a stacked undecayed leaf makes that layer's ratio
  non-finite (not 1); the other layers keep finite ratios."""
  params = {"w": jnp.ones((3, 4), jnp.float32).at[1, 2].set(jnp.nan)}
  grads = {"w": jnp.full((3, 4), 0.5, jnp.float32)}
  tx = optax_lamb.lamb(1e-2, stacked_axes=1, implementation=implementation)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  ratios = np.asarray(optax_lamb.trust_ratios(state)["w"])
  np.testing.assert_array_equal(np.isfinite(ratios), [True, False, True])


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_check_results_skips_a_nan_param_step(implementation):
  """Class 2: skip_nonfinite(check_results=True) skips (and counts) the step that a NaN param of
  an undecayed leaf would spoil: its updates are all zero."""
  params, grads = _nan_bias_params(), _grads(1)[0]
  inner = optax_lamb.lamb(1e-2, implementation=implementation, **_UNDECAYED)
  tx = optax_lamb.skip_nonfinite(inner, check_results=True)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert int(optax_lamb.skip_counts(state).total) == 1
  assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


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
  grads = [jax.tree.map(lambda g: g * scale, g) for g in _grads(3)]
  params, state = _params(), tx.init(_params())
  step = jax.jit(lambda p, s, g: tx.update(g, s, p, **extra))
  for g in grads:
    updates, state = step(params, state, g)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("composition", sorted(_UNSCALED_FIRST))
def test_grad_scale_is_divided_out_once_in_any_chain(composition):
  """Class 2, beyond the listed case: a scale passed to update (an array, under jit) reaches
  lamb after unscale_gradients through wrappers and nested chains; it is divided out once."""
  scale = jnp.float32(512.0)
  got = _scaled_run(_UNSCALED_FIRST[composition](), 512.0, grad_scale=scale)
  _assert_close(got, _run(_lamb_clipped()))


def test_unscale_gradients_after_lamb_leaves_its_updates():
  """Class 2, the other order: an unscale_gradients after lamb does not divide lamb's updates
  (lamb took the scale)."""
  chained = optax.chain(_lamb_clipped(), optax_lamb.unscale_gradients())
  got = _scaled_run(chained, 64.0, grad_scale=64.0)
  _assert_close(got, _run(_lamb_clipped()))


def test_a_scale_given_when_built_is_the_stage_own():
  """Class 2, both places: lamb built with grad_scale=s0 after unscale_gradients() given s at
  update divides by both (its own scale, and the passed one once)."""
  chained = optax.chain(
    optax_lamb.unscale_gradients(),
    optax_lamb.lamb(1e-2, weight_decay=0.01, max_grad_norm=1.0, grad_scale=4.0),
  )
  _assert_close(_scaled_run(chained, 4.0 * 32.0, grad_scale=32.0), _run(_lamb_clipped()))


def test_unscale_gradients_alone_still_divides():
  """The guard of the rule: a chain whose only reader of grad_scale is unscale_gradients, and
  lamb called on its own, each divide once."""
  sgd = optax.sgd(0.1)
  chained = optax.chain(optax_lamb.unscale_gradients(), sgd)
  _assert_close(_scaled_run(chained, 16.0, grad_scale=16.0), _run(sgd))
  _assert_close(_scaled_run(_lamb_clipped(), 16.0, grad_scale=16.0), _run(_lamb_clipped()))


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_nan_param_of_decayed_leaf_is_not_a_zero_norm(implementation):
  """Class 2, the decayed leaf: u holds the NaN too, and both norms read 0 on main (ratio 1, the
  finite elements moved). The leaf's update is NaN as with optax.lamb; the other stays finite."""
  params, grads = _nan_bias_params(), _grads(1)[0]
  ours = optax_lamb.lamb(1e-2, weight_decay=0.1, implementation=IMPLEMENTATIONS[implementation])
  theirs = optax.lamb(1e-2, weight_decay=0.1)
  updates, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  want, _ = theirs.update(grads, theirs.init(params), params)
  np.testing.assert_array_equal(np.isfinite(updates["b"]), np.isfinite(want["b"]))
  assert np.all(np.isfinite(updates["w"]))


def test_nan_param_in_one_stacked_slice_on_the_kernels():
  """Class 2, stacked, on the Pallas kernels (slice sums): only the NaN layer's ratio is NaN."""
  params = {"w": jnp.ones((3, 4), jnp.float32).at[1, 2].set(jnp.nan)}
  grads = {"w": jnp.full((3, 4), 0.5, jnp.float32)}
  tx = optax_lamb.lamb(1e-2, stacked_axes=1, implementation=PALLAS)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  ratios = np.asarray(optax_lamb.trust_ratios(state)["w"])
  np.testing.assert_array_equal(np.isfinite(ratios), [True, False, True])


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_nan_gradient_is_not_a_zero_clipping_norm(implementation):
  """Class 2, the global clipping norm: a NaN gradient makes it NaN (on main: 0, so no leaf was
  clipped and the finite ones moved by their unclipped gradients), as optax's clip does."""
  params = _params()
  grads = _grads(1)[0]
  grads = {"w": grads["w"] * 100.0, "b": grads["b"].at[0].set(jnp.nan)}
  clip = optax_lamb.clip_by_global_norm(1.0)
  got, _ = clip.update(grads, clip.init(params))
  want, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  for k in grads:
    np.testing.assert_array_equal(np.isfinite(got[k]), np.isfinite(want[k]), err_msg=k)
  tx = optax_lamb.lamb(1e-2, max_grad_norm=1.0, implementation=IMPLEMENTATIONS[implementation])
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert not any(np.any(np.isfinite(u)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_zero_one_element_leaves_keep_the_zero_norm_rule(implementation):
  """The guard of the NaN rule: a zero scalar (or one-element) param, whose scaled sums XLA:CPU
  folds into 0 inf = NaN, still has norm 0 and ratio 1 when another leaf takes the rescue."""
  params = {
    "s": jnp.zeros((), jnp.float32), "one": jnp.zeros((1,), jnp.float32),
    "tiny": jnp.full((4, 3), 1e-30, jnp.float32),
  }  # fmt: skip
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, jnp.float32), params)
  tx = optax_lamb.lamb(1e-2, implementation=IMPLEMENTATIONS[implementation])
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  want, _ = optax.lamb(1e-2).update(grads, optax.lamb(1e-2).init(params), params)
  ratios = optax_lamb.trust_ratios(state)
  for k in ("s", "one"):
    assert float(ratios[k]) == 1.0, k
    np.testing.assert_allclose(updates[k], want[k], rtol=RTOL, err_msg=k)


# --- class 3: a valid combination crashes ------------------------------------------------------

_PER_LEAF_AXES = {"w": "d", "b": None}
# The per-leaf axis_name as a pytree prefix of the params, and as a callable(params).
AXIS_FORMS = {"pytree": _PER_LEAF_AXES, "callable": lambda params: _PER_LEAF_AXES}


def _sharded_inputs(n: int):
  rng = np.random.default_rng(3)
  params = {
    "w": jnp.asarray(rng.normal(size=(2 * n, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
  }
  grads = {
    "w": jnp.asarray(rng.normal(size=(2 * n, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
  }
  return params, grads


def _skip_wrapped(form: str):
  axis_name = AXIS_FORMS[form]
  inner = optax_lamb.lamb(1e-2, axis_name=axis_name)
  return optax_lamb.skip_nonfinite(inner, axis_name=axis_name, check_results=True)


@pytest.mark.parametrize("form", sorted(AXIS_FORMS))
def test_skip_nonfinite_per_leaf_axis_name_check_results_in_shard_map(form):
  """Class 3: skip_nonfinite with a per-leaf axis_name ({"w": "d", "b": None}, or a callable
  returning it) and check_results=True runs inside shard_map, and equals the unsharded step."""
  from jax.sharding import PartitionSpec as P

  n = 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("d",))
  params, grads = _sharded_inputs(n)
  tx = _skip_wrapped(form)
  spec = {"w": P("d"), "b": P()}

  def body(g, p):
    updates, state = tx.update(g, tx.init(p), p)
    return updates, optax_lamb.skip_counts(state).total

  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, P()), check_vma=False)
  )
  updates, skipped = step(grads, params)
  full = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), check_results=True)
  want, _ = full.update(grads, full.init(params), params)
  assert int(skipped) == 0
  _assert_close(updates, want)


@pytest.mark.parametrize("form", sorted(AXIS_FORMS))
def test_skip_nonfinite_per_leaf_axis_name_check_results_in_pmap(form):
  """Class 3: the same under pmap, "w" sharded over the mapped axis, "b" replicated."""
  n = 4
  params, grads = _sharded_inputs(n)
  tx = _skip_wrapped(form)

  def split(tree):
    return {"w": tree["w"].reshape(n, 2, 3), "b": jnp.broadcast_to(tree["b"], (n, 3))}

  @functools.partial(jax.pmap, axis_name="d", devices=jax.devices()[:n])
  def step(g, p):
    updates, state = tx.update(g, tx.init(p), p)
    return updates, optax_lamb.skip_counts(state).total

  updates, skipped = step(split(grads), split(params))
  full = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), check_results=True)
  want, _ = full.update(grads, full.init(params), params)
  assert np.all(np.asarray(skipped) == 0)
  _assert_close({"w": updates["w"].reshape(2 * n, 3), "b": updates["b"][0]}, want)
