"""The fused XLA path: equal to the stage chain and to a float64 NumPy LAMB, same state, no big temporaries."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from option_cases import (
  CASES,
  LR,
  STEPS,
  by_path,
  make_grads,
  make_params,
  numpy_lamb,
)
from option_cases import build as _build

import optax_lamb
from optax_lamb.backends.xla import XlaBackend

# ------------------------------------------------------------------------- helpers


def run(tx, params, grads_per_step, *, fused_apply=False):
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    if fused_apply:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for grads in grads_per_step:
    params, state = step(params, state, grads)
  return params, state


def assert_trees_close(a, b, rtol, atol):
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
    ),
    a,
    b,
  )


# The fused path with the recompute-u design on every leaf, however small.
TWO_PASS = XlaBackend(materialize_u_max_size=0)


@functools.cache
def _results(case):
  kwargs, _, scale = CASES[case]
  params = make_params()
  grads = [make_grads(params, t, scale) for t in range(STEPS)]
  xla = run(_build(kwargs, TWO_PASS), params, grads)
  apply = run(_build(kwargs, TWO_PASS), params, grads, fused_apply=True)
  return {
    "params": params,
    "grads": grads,
    "xla": xla,
    "apply": apply,
    "xla_small_leaves": run(_build(kwargs, "xla"), params, grads),
    "reference": run(_build(kwargs, "reference"), params, grads),
  }


@pytest.mark.parametrize("variant", ["xla", "xla_small_leaves"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_stage_chain(case, variant):
  r = _results(case)
  (p_xla, s_xla), (p_ref, s_ref) = r[variant], r["reference"]
  assert jax.tree.structure(s_xla) == jax.tree.structure(s_ref)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), s_xla) == jax.tree.map(
    lambda x: (x.shape, x.dtype), s_ref
  )
  assert_trees_close(p_xla, p_ref, rtol=1e-5, atol=1e-7)
  assert_trees_close(s_xla, s_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", ["xla", "xla_small_leaves"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_numpy_float64(case, variant):
  kwargs, opts, _ = CASES[case]
  r = _results(case)
  expected, ratios = numpy_lamb(r["params"], r["grads"], opts)
  got = by_path(r[variant][0])
  for name, want in expected.items():
    np.testing.assert_allclose(np.asarray(got[name], np.float64), want, rtol=1e-5, atol=1e-6)
  got_ratios = by_path(optax_lamb.trust_ratios(r[variant][1]))
  for name, want in ratios.items():
    np.testing.assert_allclose(np.asarray(got_ratios[name], np.float64), want, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_update_and_apply_equals_update_then_apply(case):
  r = _results(case)
  assert_trees_close(r["apply"], r["xla"], rtol=1e-6, atol=1e-8)


def test_cases_exercise_the_options():
  """The clamps and the clipping bind, so the tests above check them."""
  _, opts_min, _ = CASES["min_trust_ratio"]
  _, ratios = numpy_lamb(make_params(), _results("defaults")["grads"], {})
  values = np.concatenate([np.ravel(r) for r in ratios.values()])
  assert (values < opts_min["min_ratio"]).any() and (
    values > CASES["max_trust_ratio"][1]["max_ratio"]
  ).any()
  grads = _results("max_grad_norm")["grads"][0]
  assert optax.tree.norm(grads) > CASES["max_grad_norm"][1]["max_grad_norm"]


def test_state_interchangeable_between_implementations():
  params = make_params()
  grads = [make_grads(params, t) for t in range(6)]
  kwargs = CASES["combined"][0]
  chain = _build(kwargs, "reference")
  _interchange(_build(kwargs, TWO_PASS), chain, params, grads)
  _interchange(_build(kwargs, "xla"), chain, params, grads)


def _interchange(fused, chain, params, grads):
  # 3 steps of the chain, then 3 of the fused path, against 6 of the fused path.
  p, s = run(chain, params, grads[:3])
  for g in grads[3:]:
    u, s = jax.jit(fused.update)(g, s, p)
    p = optax.apply_updates(p, u)
  p_all, s_all = run(fused, params, grads)
  assert_trees_close(p, p_all, rtol=1e-5, atol=1e-7)
  assert_trees_close(s, s_all, rtol=1e-5, atol=1e-7)
  # and the other way round
  p, s = run(fused, params, grads[:3])
  for g in grads[3:]:
    u, s = jax.jit(chain.update)(g, s, p)
    p = optax.apply_updates(p, u)
  assert_trees_close(p, p_all, rtol=1e-5, atol=1e-7)


def test_update_and_apply_falls_back_exactly_for_other_transformations():
  params = make_params()
  tx = optax.adam(1e-2)
  p1, s1 = run(tx, params, [make_grads(params, t) for t in range(3)])
  p2, s2 = run(tx, params, [make_grads(params, t) for t in range(3)], fused_apply=True)
  jax.tree.map(np.testing.assert_array_equal, (p1, s1), (p2, s2))
  # a reference-implementation lamb also takes the fallback
  tx = optax_lamb.lamb(1e-2, implementation="reference")
  state = tx.init(params)
  grads = make_grads(params, 0)
  u, s_a = tx.update(grads, state, params)
  p_b, s_b = optax_lamb.update_and_apply(tx, grads, state, params)
  jax.tree.map(np.testing.assert_array_equal, optax.apply_updates(params, u), p_b)


def test_fused_matches_optax_lamb():
  params = make_params()
  grads = [make_grads(params, t) for t in range(STEPS)]
  p_ours, _ = run(optax_lamb.lamb(LR, weight_decay=0.01), params, grads)
  p_optax, _ = run(optax.lamb(LR, weight_decay=0.01), params, grads)
  assert_trees_close(p_ours, p_optax, rtol=1e-5, atol=1e-7)


def test_mixed_dtypes_match_stage_chain():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
  grads = [jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_grads(params, t)) for t in range(4)]
  kwargs = {"weight_decay": 0.01, "mu_dtype": jnp.float32, "nu_dtype": jnp.float32}
  p_xla, s_xla = run(_build(kwargs, TWO_PASS), params, grads)
  p_ref, s_ref = run(_build(kwargs, "reference"), params, grads)
  assert jax.tree.map(lambda x: x.dtype, (p_xla, s_xla)) == jax.tree.map(
    lambda x: x.dtype, (p_ref, s_ref)
  )
  assert_trees_close(p_xla, p_ref, rtol=1e-2, atol=1e-3)
  assert_trees_close(s_xla[1].mu, s_ref[1].mu, rtol=1e-5, atol=1e-7)


def test_axis_name_sharded_leaves_match_unsharded():
  devices = np.array(jax.devices()[:8])
  if devices.size < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets them for the CPU)")
  mesh = jax.sharding.Mesh(devices, ("d",))
  spec = jax.sharding.PartitionSpec("d")
  k = jax.random.split(jax.random.PRNGKey(3), 2)
  params = {"w": jax.random.normal(k[0], (64, 32)), "v": jax.random.normal(k[1], (8, 96))}
  grads = [make_grads(params, t) for t in range(4)]
  kwargs = {"weight_decay": 0.01, "max_grad_norm": 1.0, "min_trust_ratio": 0.1}
  want, _ = run(optax_lamb.lamb(LR, **kwargs), params, grads)
  tx = optax_lamb.lamb(LR, axis_name="d", implementation=TWO_PASS, **kwargs)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
  def sharded(params, *grads):
    state = tx.init(params)
    for g in grads:
      params, state = optax_lamb.update_and_apply(tx, g, state, params)
    return params

  got = sharded(params, *grads)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-7)


def _donated_step(tx, fused_apply):
  def step(params, state, grads):
    if fused_apply:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1, 2))


@pytest.mark.parametrize("fused_apply", [False, True])
def test_donated_step_has_no_param_sized_temporary(fused_apply):
  shapes = [(1024, 512), (512, 1024), (768, 768), (1024,), (256,), (4, 512, 256), (300, 200)]
  keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
  params = {
    f"p{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
  }
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  temps = {}
  for name, tx in [
    ("ours", optax_lamb.lamb(LR, weight_decay=0.01)),
    ("optax", optax.lamb(LR, weight_decay=0.01)),
  ]:
    state = tx.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # grads cannot be reused for the outputs
      compiled = (
        _donated_step(tx, fused_apply and name == "ours").lower(params, state, params).compile()
      )
    memory = compiled.memory_analysis()
    temps[name] = memory.temp_size_in_bytes
    if name == "ours":
      # params and state are updated in place: every output aliases a donated input
      assert memory.alias_size_in_bytes >= 3 * param_bytes
  assert temps["ours"] < param_bytes / 4, temps
  assert temps["ours"] <= temps["optax"], temps


def test_fused_hlo_keeps_u_out_of_memory():
  """No param-sized array other than the moments and the new params is written for a big leaf."""
  params = {"w": jnp.ones((512, 1024))}
  tx = optax_lamb.lamb(LR, weight_decay=0.01)
  state = tx.init(params)
  step = _donated_step(tx, True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hlo = step.lower(params, state, params).compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :]
  big_fusions = [
    line
    for line in entry.splitlines()
    if " fusion(" in line and line.split("=")[1].strip().startswith("f32[512,1024]")
  ]
  # m, v and p: one loop fusion each (g is read by the first two)
  assert len(big_fusions) == 3, "\n".join(big_fusions)


def test_fused_under_inject_hyperparams_and_multisteps():
  """Hyper-parameters arrive as arrays (inject_hyperparams); the state nests (MultiSteps)."""
  params = make_params()
  grads = [make_grads(params, t) for t in range(6)]
  results = {}
  for impl in ("xla", "reference"):
    tx = optax.inject_hyperparams(optax_lamb.lamb, static_args=("implementation",))(
      learning_rate=LR, weight_decay=0.01, min_trust_ratio=0.1, implementation=impl
    )
    results[impl] = run(optax.MultiSteps(tx, 2), params, grads)
  assert_trees_close(results["xla"][0], results["reference"][0], rtol=1e-6, atol=1e-8)
  assert_trees_close(
    optax_lamb.trust_ratios(results["xla"][1]),
    optax_lamb.trust_ratios(results["reference"][1]),
    rtol=1e-6,
    atol=0,
  )
