"""The skip_nonfinite and unscale_gradients stages: non-finite gradients and loss scaling.

With lamb, MultiSteps, scan, jmp's dynamic loss scale and sharded leaves.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import FEW_ROUNDINGS, assert_trees_close, assert_trees_equal
from helpers.jaxprs import reductions
from helpers.lamb_reference import NumpyLamb
from helpers.trees import random_tree

import optax_lamb

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}


def make_params(rng, dtype=np.float32):
  return random_tree(rng, SHAPES, dtype)


def make_grads(rng, dtype=np.float32, scale=1.0):
  return random_tree(rng, SHAPES, dtype, scale)


def poison(grads, rng, value):
  """Put `value` (nan, inf, -inf) at one random element of one random leaf."""
  key = sorted(grads)[rng.integers(len(grads))]
  flat = np.array(grads[key]).reshape(-1)
  flat[rng.integers(flat.size)] = value
  return {**grads, key: jnp.asarray(flat.reshape(np.shape(grads[key])), grads[key].dtype)}


def run(tx, params, grads_seq, **update_kwargs):
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p, **update_kwargs))
  for g in grads_seq:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def reference_run(ref: NumpyLamb, params, grads_seq) -> dict:
  """The float64 NumPy LAMB's params after `grads_seq` (its skip counters advance too)."""
  want = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for g in grads_seq:
    want = ref.step(want, g)
  return want


def assert_near_reference(got, want) -> None:
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_bad_step_changes_nothing(value, rng):
  params = make_params(rng)
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, max_grad_norm=1.0, skip_nonfinite=True)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(3):
    updates, state = step(make_grads(rng), state, params)
    params = optax.apply_updates(params, updates)
  before = jax.tree.map(np.array, state)
  updates, after = step(poison(make_grads(rng), rng, value), state, params)
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(u), 0)
  assert_trees_equal(after.inner_state, before.inner_state)  # moments, count, ratios
  assert int(optax_lamb.skip_counts(after).total) == 1
  assert int(optax_lamb.skip_counts(after).consecutive) == 1
  assert_trees_equal(optax.apply_updates(params, updates), params)


def test_skipped_steps_are_as_if_absent(rng):
  """A run with bad steps interleaved ends bit-identical to the run without them."""
  params = make_params(rng)
  good = [make_grads(rng) for _ in range(8)]
  bad_at = {2, 3, 6}
  mixed, gi = [], iter(good)
  for i in range(len(good) + len(bad_at)):
    mixed.append(poison(make_grads(rng), rng, np.nan) if i in bad_at else next(gi))
  tx = optax_lamb.lamb(3e-2, weight_decay=0.01, skip_nonfinite=True)
  p_mixed, s_mixed = run(tx, params, mixed)
  p_clean, s_clean = run(tx, params, good)
  assert_trees_equal(p_mixed, p_clean)
  assert_trees_equal(s_mixed.inner_state, s_clean.inner_state)
  assert int(optax_lamb.skip_counts(s_mixed).total) == len(bad_at)
  assert int(optax_lamb.skip_counts(s_mixed).consecutive) == 0


def test_consecutive_counter_and_total(rng):
  params = make_params(rng)
  tx = optax_lamb.lamb(1e-2, skip_nonfinite=True)
  state = tx.init(params)
  step = jax.jit(tx.update)
  pattern = [False, True, True, False, True, True, True]
  expected_total = expected_run = 0
  for i, is_bad in enumerate(pattern):
    g = poison(make_grads(rng), rng, np.inf) if is_bad else make_grads(rng)
    _, state = step(g, state, params)
    expected_total += is_bad
    expected_run = expected_run + 1 if is_bad else 0
    counts = optax_lamb.skip_counts(state)
    assert (int(counts.total), int(counts.consecutive)) == (expected_total, expected_run)
    assert int(state.inner_state[1].count) == pattern[: i + 1].count(False)


def test_matches_reference_with_skips_under_scan(rng):
  """lax.scan over a gradient sequence with bad steps: no Python control flow on traced values."""
  params = make_params(rng)
  n = 30
  seq = [make_grads(rng) for _ in range(n)]
  for i in rng.choice(n, size=6, replace=False):
    seq[i] = poison(seq[i], rng, rng.choice([np.nan, np.inf, -np.inf]))
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *seq)
  kw = dict(weight_decay=0.05, max_grad_norm=2.0, min_trust_ratio=0.01, max_trust_ratio=10.0)
  tx = optax_lamb.lamb(1e-2, skip_nonfinite=True, **kw)

  def body(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  (p_final, state), _ = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), stacked))(
    params, tx.init(params)
  )
  ref = NumpyLamb(
    1e-2,
    weight_decay=0.05,
    max_grad_norm=2.0,
    min_ratio=0.01,
    max_ratio=10.0,
    skip_nonfinite=True,
  )
  assert_near_reference(p_final, reference_run(ref, params, seq))
  assert int(optax_lamb.skip_counts(state).total) == ref.skipped == 6
  assert int(optax_lamb.skip_counts(state).consecutive) == ref.consecutive


def test_multisteps_inside_skips_poisoned_accumulation(rng):
  """MultiSteps(lamb(skip)) skips the accumulated step a bad micro-batch poisoned.

  optax's MultiSteps resets its accumulator by multiplying it with 0, which keeps
  a NaN; pass ``should_skip_update_fn=optax.skip_not_finite`` so the bad
  micro-batch never enters the accumulator, or wrap MultiSteps in skip_nonfinite
  (next test).
  """
  params = make_params(rng)
  opt = optax.MultiSteps(
    optax_lamb.lamb(1e-2, skip_nonfinite=True),
    every_k_schedule=2,
    should_skip_update_fn=optax.skip_not_finite,
  )
  state = opt.init(params)
  step = jax.jit(opt.update)
  g1, g2, g3 = make_grads(rng), make_grads(rng), make_grads(rng)
  # The NaN micro-batch is dropped by MultiSteps; the lamb step then uses g1 and g2.
  u, state = step(g1, state, params)
  u, state = step(poison(make_grads(rng), rng, np.nan), state, params)
  u, state = step(g2, state, params)
  ref_opt = optax.MultiSteps(optax_lamb.lamb(1e-2, skip_nonfinite=True), every_k_schedule=2)
  ref_u, ref_state = run_multisteps(ref_opt, params, [g1, g2])
  assert_trees_equal(u, ref_u)
  # A whole accumulated step with an Inf reaches lamb only if MultiSteps lets it through.
  inner_only = optax.MultiSteps(optax_lamb.lamb(1e-2, skip_nonfinite=True), every_k_schedule=2)
  s = inner_only.init(params)
  inner_step = jax.jit(inner_only.update)
  u, s = inner_step(g3, s, params)
  u, s = inner_step(poison(g3, rng, np.inf), s, params)
  for leaf in jax.tree.leaves(u):
    np.testing.assert_array_equal(np.asarray(leaf), 0)
  assert int(optax_lamb.skip_counts(s.inner_opt_state).total) == 1
  assert int(s.inner_opt_state.inner_state[1].count) == 0


def run_multisteps(opt, params, grads_seq):
  state = opt.init(params)
  step = jax.jit(opt.update)
  for g in grads_seq:
    u, state = step(g, state, params)
  return u, state


def test_skip_nonfinite_around_multisteps(rng):
  """skip_nonfinite(MultiSteps(lamb)) drops the bad micro-batch and keeps the accumulator clean."""
  params = make_params(rng)
  tx = optax_lamb.skip_nonfinite(
    optax.MultiSteps(optax_lamb.lamb(1e-2), every_k_schedule=2).gradient_transformation()
  )
  g1, g2 = make_grads(rng), make_grads(rng)
  seq = [g1, poison(make_grads(rng), rng, np.nan), g2]
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in seq:
    u, state = step(g, state, params)
  ref_u, _ = run_multisteps(
    optax.MultiSteps(optax_lamb.lamb(1e-2), every_k_schedule=2), params, [g1, g2]
  )
  assert_trees_equal(u, ref_u)
  assert int(optax_lamb.skip_counts(state).total) == 1


def test_skip_holds_master_weights_and_schedule_counts(rng):
  params = make_params(rng, jnp.bfloat16)
  sched = optax.linear_schedule(1e-2, 1e-3, 10)
  tx = optax_lamb.lamb(
    sched, weight_decay=optax.constant_schedule(0.01), skip_nonfinite=True, master_weights=True
  )
  state = tx.init(params)
  _, state = tx.update(make_grads(rng, jnp.bfloat16), state, params)
  before = jax.tree.map(np.array, state)
  u, after = tx.update(poison(make_grads(rng, jnp.bfloat16), rng, np.nan), state, params)
  assert_trees_equal(after.inner_state, before.inner_state)
  assert all(np.asarray(x).dtype == jnp.bfloat16 for x in jax.tree.leaves(u))


@pytest.mark.parametrize("kind", ["float", "array", "update_kwarg"])
def test_grad_scale_power_of_two_is_exact(kind, rng):
  """Dividing by a power of two is exact in float32: lamb on s*g equals lamb on g.

  Equal up to the order XLA picks for the norm reductions, which may differ between
  the two compiled steps (seen once in about 20 runs as a one-ulp difference).
  """
  params = make_params(rng)
  s = float(2 ** rng.integers(1, 16))
  seq = [make_grads(rng) for _ in range(4)]
  scaled = [jax.tree.map(lambda x: x * s, g) for g in seq]
  plain, _ = run(optax_lamb.lamb(1e-2, max_grad_norm=1.0), params, seq)
  if kind == "update_kwarg":
    got, _ = run(
      optax_lamb.lamb(1e-2, max_grad_norm=1.0), params, scaled, grad_scale=jnp.float32(s)
    )
  else:
    scale = s if kind == "float" else jnp.float32(s)
    got, _ = run(optax_lamb.lamb(1e-2, max_grad_norm=1.0, grad_scale=scale), params, scaled)
  assert_trees_close(got, plain, rtol=FEW_ROUNDINGS, atol=0)


def test_grad_scale_before_clipping_matches_reference(rng):
  params = make_params(rng)
  s = float(rng.uniform(10, 1000))
  seq = [make_grads(rng, scale=s) for _ in range(5)]
  got, _ = run(optax_lamb.lamb(1e-2, max_grad_norm=0.5, grad_scale=s), params, seq)
  ref = NumpyLamb(1e-2, max_grad_norm=0.5, grad_scale=s)
  p = dict(params)
  for g in seq:
    p = ref.step(p, g)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), p[k], rtol=1e-5, atol=1e-6)


def test_grad_scale_schedule_on_update_count(rng):
  params = make_params(rng)
  schedule = lambda count: 2.0 ** (3 + count % 4)
  seq = [make_grads(rng) for _ in range(6)]
  scaled = [jax.tree.map(lambda x, i=i: x * schedule(i), g) for i, g in enumerate(seq)]
  plain, _ = run(optax_lamb.lamb(1e-2), params, seq)
  got, state = run(optax_lamb.lamb(1e-2, grad_scale=schedule), params, scaled)
  assert_trees_equal(got, plain)
  assert int(state[0].count) == len(seq)


def test_grad_scale_float16_gradients_unscaled_in_float32():
  """A loss-scaled float16 gradient whose true value underflows float16 still arrives."""
  params = {"w": jnp.ones(4, jnp.float16)}
  tiny = 1e-8  # below float16's smallest subnormal (6e-8)
  g = {"w": jnp.full(4, tiny * 2**16, jnp.float16)}
  stage = optax_lamb.unscale_gradients(2.0**16)
  out, _ = stage.update(g, stage.init(params))
  assert out["w"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out["w"]), tiny, rtol=1e-3)
  assert float(jnp.asarray(tiny, jnp.float16)) == 0.0  # what a float16 result would hold


def test_overflowed_scaled_gradient_is_skipped(rng):
  params = make_params(rng, jnp.float16)
  tx = optax_lamb.lamb(1e-2, skip_nonfinite=True, nu_dtype=jnp.float32)
  state = tx.init(params)
  g = jax.tree.map(lambda x: (x * 2.0**15).astype(jnp.float16), make_grads(rng, scale=10.0))
  assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))
  u, state = jax.jit(tx.update)(g, state, params, grad_scale=jnp.float32(2.0**15))
  assert int(optax_lamb.skip_counts(state).total) == 1
  for leaf in jax.tree.leaves(u):
    np.testing.assert_array_equal(np.asarray(leaf), 0)


def test_jmp_dynamic_loss_scale(rng):
  """The README example: jmp.DynamicLossScale hands its scale to lamb each step."""
  jmp = pytest.importorskip("jmp")
  x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float16)
  y = jnp.asarray(rng.normal(size=(64,)), jnp.float16)
  params = {"w": jnp.zeros(8, jnp.float32), "b": jnp.zeros((), jnp.float32)}
  tx = optax_lamb.lamb(1e-2, skip_nonfinite=True)

  def loss_fn(p):
    pred = x @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
    return jnp.mean(jnp.square(pred - y))

  @jax.jit
  def train_step(params, opt_state, loss_scale):
    grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p)))(params)
    updates, opt_state = tx.update(grads, opt_state, params, grad_scale=loss_scale.loss_scale)
    loss_scale = loss_scale.adjust(jmp.all_finite(loss_scale.unscale(grads)))
    return optax.apply_updates(params, updates), opt_state, loss_scale

  # 2^24 overflows float16 at once; the scaler halves it on each skipped step.
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**24), period=5)
  opt_state = tx.init(params)
  loss0 = float(loss_fn(params))
  overflows = 0
  for _ in range(60):
    before = params
    params, opt_state, new_scale = train_step(params, opt_state, loss_scale)
    if float(new_scale.loss_scale) < float(loss_scale.loss_scale):
      overflows += 1
      assert_trees_equal(params, before)
    loss_scale = new_scale
  assert overflows >= 1
  assert int(optax_lamb.skip_counts(opt_state).total) == overflows
  assert float(loss_fn(params)) < loss0


def test_sharded_leaves_skip_together(rng):
  """Inside shard_map, a NaN on one device makes every device skip (axis_name)."""
  from jax.sharding import PartitionSpec as P

  n = 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
  params = {"w": jnp.asarray(rng.normal(size=(n * 2, 3)), jnp.float32)}
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, skip_nonfinite=True, axis_name="data")
  full = optax_lamb.lamb(1e-2, weight_decay=0.01, skip_nonfinite=True)
  spec = {"w": P("data")}

  def sharded_step(g, p):
    def body(g, p):
      u, s = tx.update(g, tx.init(p), p)
      return u, optax_lamb.skip_counts(s).total[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, P("data")))(g, p)

  step = jax.jit(sharded_step)
  shard = lambda t: jax.device_put(t, jax.sharding.NamedSharding(mesh, P("data")))
  params = shard(params)
  good = shard({"w": jnp.asarray(rng.normal(size=(n * 2, 3)), jnp.float32)})
  u, skipped = step(good, params)
  u_full, _ = full.update(good, full.init(params), params)
  np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(u_full["w"]), rtol=1e-5, atol=1e-8)
  np.testing.assert_array_equal(np.asarray(skipped), 0)
  bad = shard({"w": good["w"].at[rng.integers(n * 2), 1].set(jnp.inf)})
  u, skipped = step(bad, params)
  np.testing.assert_array_equal(np.asarray(u["w"]), 0)
  np.testing.assert_array_equal(np.asarray(skipped), 1)  # every device counted the skip


@pytest.mark.parametrize("cap", [0, 2])
def test_max_consecutive_errors_as_optax_apply_if_finite(cap, rng):
  """After more than `cap` non-finite steps in a row they are applied, until a finite one."""
  params = make_params(rng)
  bad = lambda: poison(make_grads(rng), rng, np.nan)  # noqa: E731
  grads_seq = [make_grads(rng), bad(), bad(), bad(), bad(), make_grads(rng), bad(), make_grads(rng)]
  ours_tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), max_consecutive_errors=cap)
  theirs_tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=cap)
  ours_state, theirs_state = ours_tx.init(params), theirs_tx.init(params)
  ours_params, theirs_params = params, params
  for grads in grads_seq:
    ours_updates, ours_state = jax.jit(ours_tx.update)(grads, ours_state, ours_params)
    theirs_updates, theirs_state = jax.jit(theirs_tx.update)(grads, theirs_state, theirs_params)
    ours_params = optax.apply_updates(ours_params, ours_updates)
    theirs_params = optax.apply_updates(theirs_params, theirs_updates)
    assert_trees_equal(ours_params, theirs_params)  # NaN where both let a bad step through
    counts = optax_lamb.skip_counts(ours_state)
    assert int(counts.consecutive) == int(theirs_state.notfinite_count)
    assert int(counts.total) == int(theirs_state.total_notfinite)


OVERFLOW_CASES = {  # (nu dtype, max_grad_norm, |g|, skipped): the threshold is sqrt(max of nu's dtype)
  "float32, 1e20": (jnp.float32, None, 1e20, True),
  "float32, 1e18": (jnp.float32, None, 1e18, False),
  "float32, 1e20 clipped": (jnp.float32, 1.0, 1e20, False),  # judged after clipping
  "float16, 300": (jnp.float16, None, 300.0, True),
  "float16, 200": (jnp.float16, None, 200.0, False),
  # judged from the clipping norm (max_grad_norm at most half the threshold), its rescue taken
  "float16, 300 clipped": (jnp.float16, 1.0, 300.0, False),
  "float32, 1e30 clipped": (jnp.float32, 1.0, 1e30, False),
  "float16, 300 clipped to 200": (jnp.float16, 200.0, 300.0, False),  # the largest |g| read
}


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas_triton"])
@pytest.mark.parametrize("case", list(OVERFLOW_CASES))
def test_lamb_skips_a_gradient_that_would_overflow_the_second_moment(case, implementation, rng):
  """lamb(skip_nonfinite=True) skips, by default, a finite step whose gradient squared would
  overflow the second moment in its dtype (taken, it would leave nu inf for good); a gradient
  below the threshold, or brought under it by clipping, is taken and leaves nu finite."""
  nu_dtype, max_grad_norm, magnitude, skipped = OVERFLOW_CASES[case]
  params = make_params(rng)
  grads = make_grads(rng)
  grads = {**grads, "w": grads["w"].at[0, 0].set(magnitude)}
  tx = optax_lamb.lamb(1e-2, skip_nonfinite=True, nu_dtype=nu_dtype, max_grad_norm=max_grad_norm,
                       implementation=implementation)  # fmt: skip
  state = tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # pallas_triton interpreted on the CPU
    updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert int(optax_lamb.skip_counts(new_state).total) == int(skipped)
  if skipped:
    assert_trees_equal(new_state.inner_state, state.inner_state)  # bit-identical
    assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
  else:
    floats = [x for x in jax.tree.leaves(new_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(bool(jnp.isfinite(x).all()) for x in floats)


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_check_results_skips_a_finite_step_that_would_overflow_the_moments(implementation, rng):
  """The generic wrapper around a transformation it cannot look into: a finite gradient of
  1e20, whose square overflows nu. Checking the gradients lets it through (nu is inf for good,
  as optax.lamb does); checking the results skips and counts it. lamb's own
  skip_nonfinite=True skips it by default (the test above)."""
  params = make_params(rng)
  grads = make_grads(rng)
  huge = {**grads, "w": grads["w"].at[0, 0].set(1e20)}
  lamb = optax_lamb.lamb(1e-2, implementation=implementation)
  for check, skipped in ((False, 0), (True, 1)):
    tx = optax_lamb.skip_nonfinite(lamb, check_results=check)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(huge, state, params)
    leaves = jax.tree.leaves(state.inner_state)
    assert int(optax_lamb.skip_counts(state).total) == skipped
    if check:  # the state is the one before the step, and the params do not move
      assert_trees_equal(state.inner_state, tx.init(params).inner_state)
      np.testing.assert_array_equal(np.asarray(updates["w"]), 0)
    else:
      assert not all(bool(jnp.isfinite(x).all()) for x in leaves), "nu should overflow"
    # the next, ordinary step is taken either way
    _, state = jax.jit(tx.update)(grads, state, params)
    assert int(optax_lamb.skip_counts(state).consecutive) == 0


def test_clipped_skip_reads_the_gradients_no_more_than_the_clip(rng):
  """With max_grad_norm, lamb(skip_nonfinite=True) decides from the clipping norm it already
  has (finite gradients clip to at most max_grad_norm, under every overflow threshold): not
  one reduction over the gradients more than the clip alone. Without clipping it reads them."""
  params, grads = make_params(rng), make_grads(rng)

  def count(**kw):
    tx = optax_lamb.lamb(1e-2, implementation="xla", **kw)
    _, inside, outside = reductions(jax.make_jaxpr(tx.update)(grads, tx.init(params), params).jaxpr)
    return inside + outside

  assert count(max_grad_norm=1.0, skip_nonfinite=True) == count(max_grad_norm=1.0)
  assert count(skip_nonfinite=True) > count()
  # a clip that may leave a finite gradient above float16's threshold: the largest |g| is read
  wide = dict(max_grad_norm=200.0, nu_dtype=jnp.float16)
  assert count(skip_nonfinite=True, **wide) > count(**wide)


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_clipped_skip_matches_reference_at_extreme_magnitudes(implementation, rng):
  """skip_nonfinite with clipping, against the float64 NumPy LAMB: finite gradients of every
  magnitude (1e30, whose float32 sum of squares overflows, and 1e-30) are clipped and taken,
  a NaN or an Inf anywhere is skipped."""
  params = make_params(rng)
  seq = [
    make_grads(rng),
    make_grads(rng, scale=1e30),
    poison(make_grads(rng), rng, np.inf),
    make_grads(rng, scale=1e-30),
    poison(make_grads(rng, scale=1e30), rng, np.nan),
    make_grads(rng),
  ]
  kw = dict(weight_decay=0.01, max_grad_norm=1.0, skip_nonfinite=True)
  got, state = run(optax_lamb.lamb(1e-2, implementation=implementation, **kw), params, seq)
  ref = NumpyLamb(1e-2, **kw)
  assert_near_reference(got, reference_run(ref, params, seq))
  assert int(optax_lamb.skip_counts(state).total) == ref.skipped == 2
