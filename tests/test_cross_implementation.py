"""The implementations agree on random options, trees and param dtypes (issue 12, property test).

Hypothesis draws an option set of `lamb`, a small tree (shapes, and per leaf a
float32, bfloat16 or float16 param) and a seed; `xla`, `reference` and `pallas`
(Pallas interpret mode off a GPU, tiny block sizes so that chunk tails, several
launches and both kinds of pass 2 occur) then take 3 steps, step by step: at
each step all three get the same params and state (the XLA path's), so their
outputs are compared without drift. The tolerance is the README's, rtol 1e-5
on float32 values (the trust ratios, float32 moments and params); a value
stored in bfloat16/float16 is the rounding of float32 values that agree to
rtol 1e-5, so it may differ by one unit in the last place of its dtype.
"""

import warnings

import _fast_compile
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optax_lamb
from optax_lamb.backends.pallas import BlockSizes, PallasBackend

STEPS = 3
RTOL, ATOL = 1e-5, 1e-7  # README: every implementation equals the XLA path to rtol 1e-5
# Tiny launches: 16-element chunks, 2 leaves per launch, pass 2 by XLA from 48 elements.
PALLAS = PallasBackend(
  block_sizes=BlockSizes(
    block=16, max_leaves_per_call=2, num_warps=4, sum_block=16, xla_pass2_min_size=48
  ),
  interpret=True,
)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

decay_matrices = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
adapt_non_scalars = lambda p: jax.tree.map(lambda x: x.ndim > 0, p)
stack_first_axis = lambda p: jax.tree.map(lambda x: min(x.ndim, 1), p)


@st.composite
def options(draw):
  """lamb keyword arguments: each option off or at one of a few values."""
  kw = {}
  kw["learning_rate"] = draw(st.sampled_from([1e-2, 0.1, optax.linear_schedule(0.1, 0.01, STEPS)]))
  kw["weight_decay"] = draw(
    st.sampled_from([0.0, 0.01, 0.3, optax.linear_schedule(0.3, 0.0, STEPS)])
  )
  if draw(st.booleans()):
    kw["mask"] = decay_matrices
  if draw(st.booleans()):
    kw["trust_ratio_mask"] = adapt_non_scalars
  if draw(st.booleans()):
    kw["stacked_axes"] = stack_first_axis
  kw["min_trust_ratio"] = draw(st.sampled_from([None, 0.05, 0.5]))
  kw["max_trust_ratio"] = draw(st.sampled_from([None, 2.0, 10.0]))
  kw["max_grad_norm"] = draw(st.sampled_from([None, 0.5, 100.0]))
  kw["bias_correction"] = draw(st.booleans())
  kw["b1"], kw["b2"] = draw(st.sampled_from([(0.9, 0.999), (0.8, 0.99)]))
  kw["eps"], kw["eps_root"] = draw(st.sampled_from([(1e-6, 0.0), (1e-3, 1e-8)]))
  kw["mu_dtype"] = draw(st.sampled_from([None, jnp.float32, jnp.bfloat16]))
  kw["nu_dtype"] = draw(st.sampled_from([None, jnp.float32]))
  kw["master_weights"] = draw(st.booleans())
  return kw


shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
trees = st.lists(
  st.tuples(shape, st.sampled_from(list(DTYPES)), st.booleans()), min_size=1, max_size=3
)


def make_tree(leaves, seed):
  """Params (a leaf may be all zeros: ratio exactly 1) and STEPS gradients, in the leaf dtypes."""
  rng = np.random.default_rng(seed)
  params, grads = {}, [{} for _ in range(STEPS)]
  for i, (s, dtype, zero) in enumerate(leaves):
    scale = 0.0 if zero else 0.5
    params[f"p{i}"] = jnp.asarray(scale * rng.standard_normal(s), DTYPES[dtype])
    for g in grads:
      g[f"p{i}"] = jnp.asarray(rng.standard_normal(s), DTYPES[dtype])
  return params, grads


def tolerance(want, dtype):
  """rtol 1e-5 in float32; one unit in the last place where the value is stored narrower."""
  finfo = jnp.finfo(dtype)
  if finfo.bits >= 32:
    return RTOL * np.abs(want) + ATOL
  return float(finfo.eps) * np.abs(want) + float(finfo.smallest_subnormal)


def assert_agree(got, want, name):
  paths_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  leaves_want, tree_want = jax.tree.flatten(want)
  assert tree_got == tree_want, name
  for (path, a), b in zip(paths_got, leaves_want, strict=True):
    where = f"{name}{jax.tree_util.keystr(path)}"
    assert a.dtype == b.dtype and a.shape == b.shape, where
    if not jnp.issubdtype(a.dtype, jnp.floating):
      np.testing.assert_array_equal(a, b, err_msg=where)
      continue
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    excess = np.abs(a64 - b64) - tolerance(b64, a.dtype)
    assert np.all(excess <= 0), (where, a64, b64)


@settings(
  max_examples=25,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(kwargs=options(), leaves=trees, seed=st.integers(0, 2**31 - 1))
def test_implementations_agree_step_by_step(kwargs, leaves, seed):
  params, grads = make_tree(leaves, seed)
  lr = kwargs.pop("learning_rate")
  txs = {
    name: optax_lamb.lamb(lr, implementation=impl, **kwargs)
    for name, impl in IMPLEMENTATIONS.items()
  }

  @_fast_compile.jit
  def step(params, state, g):
    """One update of each implementation from the same params and state."""
    out = {}
    for impl, tx in txs.items():
      updates, new_state = tx.update(g, state, params)
      out[impl] = (updates, optax.apply_updates(params, updates), new_state)
    return out

  state = txs["xla"].init(params)
  for t, g in enumerate(grads):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      out = step(params, state, g)
    # the kernels ran (only "interpret mode is slow" may be said), no fallback to XLA
    assert not [w for w in caught if "xla path" in str(w.message)], caught
    for impl in ("reference", "pallas"):
      for name, got, want in zip(
        ("updates", "params", "state"), out[impl], out["xla"], strict=True
      ):
        assert_agree(got, want, f"step {t + 1}: {impl} {name} vs xla ")
    ratios = [optax_lamb.trust_ratios(out[impl][2]) for impl in IMPLEMENTATIONS]
    for r in ratios[1:]:
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL), r, ratios[0])
    _, params, state = out["xla"]
