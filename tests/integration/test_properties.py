"""Property tests (hypothesis): random trees, dtypes and hyper-parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import seeds
from helpers.asserts import IMPLEMENTATION_RTOL, assert_close_to_reference
from helpers.lamb_reference import NumpyLamb as ReferenceLamb
from helpers.options import RANGES, lamb_options
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_lamb

SETTINGS = settings(max_examples=seeds.examples(25))
SHAPES = [(), (3,), (2, 3), (4, 1, 2)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@st.composite
def problems(draw, dtypes=DTYPES):
  """(params, grads list, lamb kwargs, names of all-zero param leaves)."""
  n = draw(st.integers(1, 3))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  params, grads, zero = {}, [{}, {}], set()
  for i in range(n):
    name = f"l{i}"
    shape = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from(dtypes))
    p_scale = draw(st.sampled_from([0.0, 1e-2, 1.0, 30.0]))
    g_scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    params[name] = jnp.asarray(p_scale * rng.normal(size=shape), dtype)
    for g in grads:
      g[name] = jnp.asarray(g_scale * rng.normal(size=shape), dtype)
    if p_scale == 0.0:
      zero.add(name)
  kwargs = {name: draw(st.floats(*bounds)) for name, bounds in RANGES.items()}
  kwargs |= draw(lamb_options(NAMES))
  return params, grads, kwargs, zero


# the options of the option table these tests draw (learning rate, b1, b2: any float in RANGES)
NAMES = (("eps", "eps_root"), "weight_decay", "min_trust_ratio", "max_trust_ratio", "max_grad_norm")


def is_finite_tree(tree):
  return all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(tree))


@pytest.mark.slow  # 10 s; CI runs it
@SETTINGS
@given(problem=problems(), master=st.booleans())
def test_finite_dtype_clamp_and_zero_leaves(problem, master):
  params, grads, kwargs, zero = problem
  tx = optax_lamb.lamb(**kwargs, master_weights=master, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  state = tx.init(params)
  for i, g in enumerate(grads):
    updates, state = tx.update(g, state, params)
    assert is_finite_tree(updates) and is_finite_tree(state)
    for k in params:
      assert updates[k].dtype == params[k].dtype
    ratios = optax_lamb.trust_ratios(state)
    if i == 0:
      for k in zero:  # ||p|| = 0: ratio exactly 1, clamps not applied
        assert float(ratios[k]) == 1.0
    for r in ratios.values():
      if float(r) == 1.0:
        continue  # a zero norm (or a ratio that is exactly 1)
      if kwargs["min_trust_ratio"] is not None:
        assert float(r) >= np.float32(kwargs["min_trust_ratio"])
      if kwargs["max_trust_ratio"] is not None:
        assert float(r) <= np.float32(kwargs["max_trust_ratio"])
    params = optax.apply_updates(params, updates)


@SETTINGS
@given(problem=problems(dtypes=[jnp.float32]))
def test_two_steps_match_the_float64_reference(problem):
  params, grads, kwargs, _ = problem
  tx = optax_lamb.lamb(**kwargs)
  state = tx.init(params)
  ref = ReferenceLamb(
    kwargs["learning_rate"],
    b1=kwargs["b1"],
    b2=kwargs["b2"],
    eps=kwargs["eps"],
    eps_root=kwargs["eps_root"],
    weight_decay=kwargs["weight_decay"],
    max_grad_norm=kwargs["max_grad_norm"],
    min_ratio=kwargs["min_trust_ratio"],
    max_ratio=kwargs["max_trust_ratio"],
  )
  for g in grads:
    updates, state = tx.update(g, state, params)
    expected = ref.step({k: np.asarray(p) for k, p in params.items()}, g)
    for k in params:
      want = expected[k] - np.asarray(params[k], np.float64)
      scale = np.max(np.abs(want), initial=0.0)
      # float32 math: 1 - b^t with b rounded to float32 (off by up to ~1e-4 relative for b2
      # near 1), and a decay that cancels the Adam step (a clamped ratio keeps the result
      # small) amplifies rounding by the reference's condition number.
      rtol = IMPLEMENTATION_RTOL * ref.ratio_condition[k] + ref.float32_constants_rtol
      assert_close_to_reference(updates[k], want, rtol=rtol, atol=rtol * scale, err_msg=k)
      ratio = optax_lamb.trust_ratios(state)[k]
      assert_close_to_reference(ratio, ref.ratios[k], rtol=rtol, atol=0, err_msg=k)
    params = optax.apply_updates(params, updates)


@settings(SETTINGS, max_examples=12)
@given(
  problem=problems(),
  master=st.booleans(),
  where=st.integers(0, 2**16),
  value=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_a_skipped_step_changes_nothing(problem, master, where, value):
  params, grads, kwargs, _ = problem
  tx = optax_lamb.lamb(**kwargs, master_weights=master, skip_nonfinite=True)
  state = tx.init(params)
  _, state = tx.update(grads[0], state, params)
  bad = dict(grads[1])
  name = sorted(bad)[where % len(bad)]
  flat = np.array(bad[name], np.float32).reshape(-1)
  flat[where % flat.size] = value
  bad[name] = jnp.asarray(flat.reshape(np.shape(bad[name])), bad[name].dtype)
  updates, after = tx.update(bad, state, params)
  for k in params:
    assert updates[k].dtype == params[k].dtype
    np.testing.assert_array_equal(np.asarray(updates[k], np.float32), 0)
  for a, b in zip(
    jax.tree.leaves(after.inner_state), jax.tree.leaves(state.inner_state), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(optax_lamb.skip_counts(after).total) == 1
