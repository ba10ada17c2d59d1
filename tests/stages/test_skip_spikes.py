"""skip_nonfinite(tx, spikes=SpikeRule(...)): skipping steps whose gradient norm or loss spikes.

Checked against `SpikeReference`, a float64 Python simulation of the running averages and the
decision, over sequences with injected spikes; the guarantees of the non-finite skip (a
skipped step keeps the state bit for bit, no parameter-sized temporary, shard_map, MultiSteps,
scan) and the states of before (``spikes=None``) unchanged.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import assert_trees_close, assert_trees_equal

import optax_lamb

SHAPES = {"w": (4, 3), "b": (3,)}
RULE = optax_lamb.SpikeRule(factor=4.0, warmup_steps=3, decay=0.8, loss_factor=3.0)


class SpikeReference:
  """The spike rule in float64 Python: bias-corrected averages of the accepted steps' values."""

  def __init__(self, rule, max_errors=None):
    self.rule, self.max_errors = rule, max_errors
    self.norm, self.loss = [0.0, 0], [0.0, 0]  # (average, steps)
    self.total = self.consecutive = self.spikes = 0

  def _above(self, x, avg, factor):
    return avg[1] >= self.rule.warmup_steps and x > factor * avg[0]

  def _take_in(self, avg, x):
    n = avg[1] + 1
    d = self.rule.decay
    return [avg[0] + (x - avg[0]) * (1 - d) / (1 - d**n), n]

  def step(self, grads, loss=None) -> bool:
    """Whether the step is applied."""
    leaves = [np.asarray(g, np.float64) for g in grads.values()]
    finite = all(np.isfinite(g).all() for g in leaves)
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in leaves)) if finite else math.nan
    clean = finite and (loss is None or math.isfinite(loss))
    spike = clean and self._above(norm, self.norm, self.rule.factor)
    lf = self.rule.factor if self.rule.loss_factor is None else self.rule.loss_factor
    if loss is not None and clean:
      spike = spike or self._above(loss, self.loss, lf)
    ok = clean and not spike
    self.consecutive = 0 if ok else self.consecutive + 1
    take = ok or (self.max_errors is not None and self.consecutive > self.max_errors)
    self.total += not ok
    self.spikes += spike
    if take and finite:
      self.norm = self._take_in(self.norm, norm)
      if loss is not None and math.isfinite(loss):
        self.loss = self._take_in(self.loss, loss)
    return take


def sequence(rng, steps=24, spikes=(6, 7, 15), loss_spikes=(11,), nan=(9,)):
  """Gradients of norm near 3 (x 40 at `spikes`), losses near 2 (x 10 at `loss_spikes`)."""
  grads, losses = [], []
  for t in range(steps):
    scale = rng.uniform(0.8, 1.25) * (40.0 if t in spikes else 1.0)
    g = {k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in SHAPES.items()}
    if t in nan:
      g["w"] = g["w"].at[0, 0].set(jnp.nan)
    grads.append(g)
    losses.append(float(np.float32(rng.uniform(1.8, 2.2) * (10.0 if t in loss_spikes else 1.0))))
  return grads, losses


def params_of(rng):
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def check_against_reference(tx, ref, params, grads, losses, with_loss=True):
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, v: tx.update(g, s, p, value=v))
  if not with_loss:
    step = jax.jit(lambda g, s, p, v: tx.update(g, s, p))
  taken = []
  for g, loss in zip(grads, losses, strict=True):
    updates, state = step(g, state, params, jnp.float32(loss))
    take = ref.step(g, loss if with_loss else None)
    moved = any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    assert moved == take
    taken.append(take)
    params = optax.apply_updates(params, updates)
    stats = optax_lamb.spike_stats(state)
    counts = optax_lamb.skip_counts(state)
    assert (int(counts.total), int(counts.consecutive)) == (ref.total, ref.consecutive)
    assert (int(stats.skipped), int(stats.norm_steps)) == (ref.spikes, ref.norm[1])
    np.testing.assert_allclose(float(stats.norm_average), ref.norm[0], rtol=1e-5)
    if with_loss:
      assert int(stats.loss_steps) == ref.loss[1]
      np.testing.assert_allclose(float(stats.loss_average), ref.loss[0], rtol=1e-5)
  return params, state, taken


@pytest.mark.parametrize("with_loss", [True, False])
@pytest.mark.parametrize("check_results", [False, True])
def test_decisions_and_averages_match_the_reference(with_loss, check_results, rng):
  grads, losses = sequence(rng)
  params = params_of(rng)
  tx = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), spikes=RULE, check_results=check_results)
  new_params, state, taken = check_against_reference(
    tx, SpikeReference(RULE), params, grads, losses, with_loss
  )
  # The injected norm spikes (after the warm-up), the NaN, and the loss spike when given.
  skipped = [t for t, take in enumerate(taken) if not take]
  assert skipped == ([6, 7, 9, 11, 15] if with_loss else [6, 7, 9, 15])
  # Skipped steps are as if absent: lamb on the accepted gradients alone.
  plain = optax_lamb.lamb(1e-2)
  p, s = params, plain.init(params)
  for g, take in zip(grads, taken, strict=True):
    if take:
      u, s = jax.jit(plain.update)(g, s, p)
      p = optax.apply_updates(p, u)
  assert_trees_close(new_params, p, rtol=1e-6)


def test_warm_up_judges_nothing(rng):
  """Before `warmup_steps` accepted steps, a large norm is taken and enters the average."""
  rule = optax_lamb.SpikeRule(factor=2.0, warmup_steps=4, decay=0.5)
  grads, losses = sequence(rng, steps=10, spikes=(1, 2, 6), loss_spikes=(), nan=())
  tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=rule)
  _, _, taken = check_against_reference(tx, SpikeReference(rule), params_of(rng), grads, losses)
  assert taken[1] and taken[2] and not taken[6]


@pytest.mark.parametrize("cap", [0, 2])
def test_max_consecutive_errors_lets_a_spike_through_into_the_average(cap, rng):
  """With `max_consecutive_errors`, a run of spikes longer than it is applied, and the applied
  step enters the averages (a new level is learnt, not skipped for ever)."""
  grads, losses = sequence(rng, steps=14, spikes=tuple(range(5, 14)), loss_spikes=(), nan=())
  tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=RULE, max_consecutive_errors=cap)
  ref = SpikeReference(RULE, max_errors=cap)
  _, state, taken = check_against_reference(tx, ref, params_of(rng), grads, losses)
  assert taken[5 : 5 + cap] == [False] * cap and taken[5 + cap]


def test_a_skipped_step_keeps_the_state_bit_for_bit(rng):
  grads, losses = sequence(rng, steps=6, spikes=(5,), loss_spikes=(), nan=())
  params = params_of(rng)
  tx = optax_lamb.skip_nonfinite(
    optax_lamb.lamb(1e-2, weight_decay=0.01, master_weights=False), spikes=RULE
  )
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, v: tx.update(g, s, p, value=v))
  for g, loss in zip(grads[:5], losses[:5], strict=True):
    _, state = step(g, state, params, loss)
  updates, after = step(grads[5], state, params, losses[5])
  assert all(not bool(jnp.any(u)) for u in jax.tree.leaves(updates))
  kept = lambda s: (s.inner_state, s.norm_steps, s.norm_average, s.loss_steps, s.loss_average)
  assert_trees_equal(kept(after), kept(state))
  assert (int(state.consecutive), int(after.consecutive)) == (0, 1)
  assert (int(after.total), int(after.spikes)) == (int(state.total) + 1, int(state.spikes) + 1)


def test_without_spikes_the_state_is_as_before(rng):
  """spikes=None: the state is SkipNonFiniteState with its three fields (checkpoints restore)."""
  params = params_of(rng)
  state = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2)).init(params)
  assert type(state) is optax_lamb.SkipNonFiniteState
  assert state._fields == ("total", "consecutive", "inner_state")
  with pytest.raises(ValueError, match="No spike rule"):
    optax_lamb.spike_stats(state)
  with_spikes = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), spikes=RULE)
  with pytest.raises(ValueError, match="SkipSpikesState"):
    with_spikes.update(params, state, params)
  total, consecutive = optax_lamb.skip_counts(with_spikes.init(params))  # two values, as before
  assert (int(total), int(consecutive)) == (0, 0)


def test_scan_and_serialization(rng):
  """Under lax.scan the decisions are the eager ones; the state round-trips flax.serialization."""
  from flax import serialization

  grads, losses = sequence(rng)
  params = params_of(rng)
  tx = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), spikes=RULE)
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *grads)

  def body(carry, xs):
    p, s = carry
    g, v = xs
    u, s = tx.update(g, s, p, value=v)
    return (optax.apply_updates(p, u), s), None

  (p, s), _ = jax.lax.scan(body, (params, tx.init(params)), (stacked, jnp.asarray(losses)))
  p_eager, s_eager, _ = check_against_reference(tx, SpikeReference(RULE), params, grads, losses)
  assert_trees_close(p, p_eager, rtol=1e-6)
  assert tuple(optax_lamb.skip_counts(s)) == tuple(optax_lamb.skip_counts(s_eager))
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(s))
  assert_trees_equal(restored, s)


def test_multisteps_judges_the_accumulated_step(rng):
  """MultiSteps(skip_nonfinite(tx, spikes)): the mean of each window is judged once."""
  grads, losses = sequence(rng, steps=16, spikes=(12, 13), loss_spikes=(), nan=())
  params = params_of(rng)
  tx = optax.MultiSteps(optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=RULE), every_k_schedule=2)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in grads:
    _, state = step(g, state, params)
  means = [jax.tree.map(lambda a, b: (a + b) / 2, *grads[i : i + 2]) for i in range(0, 16, 2)]
  ref = SpikeReference(RULE)
  taken = [ref.step(m) for m in means]
  assert taken == [True] * 6 + [False, True]
  stats, counts = optax_lamb.spike_stats(state), optax_lamb.skip_counts(state)
  assert (int(stats.skipped), int(stats.norm_steps), int(counts.total)) == (1, 7, 1)
  np.testing.assert_allclose(float(stats.norm_average), ref.norm[0], rtol=1e-5)


def test_shard_map_agrees_the_norm_and_the_loss(rng):
  """Inside shard_map with axis_name, every device judges the global norm and the mean loss,
  and takes the decision and averages of the unsharded wrapper."""
  from jax.sharding import PartitionSpec as P

  n = 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
  shapes = {"w": (n * 2, 3)}
  params = {"w": jnp.asarray(rng.normal(size=shapes["w"]), jnp.float32)}
  sharded = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=RULE, axis_name="data")
  full = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=RULE)
  spec = {"w": P("data")}

  def body(g, s, p, v):
    u, s = sharded.update(g, s, p, value=v[0])
    return u, s

  state_spec = jax.tree.map(lambda _: P(), jax.eval_shape(full.init, params))
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, state_spec, spec, P("data")),
                               out_specs=(spec, state_spec), check_vma=False))  # fmt: skip
  s_sharded, s_full = sharded.init(params), full.init(params)
  for t in range(8):
    scale = 30.0 if t == 5 else rng.uniform(0.8, 1.25)
    g = {"w": jnp.asarray(rng.normal(size=shapes["w"]) * scale, jnp.float32)}
    losses = rng.uniform(1.8, 2.2, size=n).astype(np.float32) * (10 if t == 6 else 1)
    u, s_sharded = step(g, s_sharded, params, jnp.asarray(losses))
    u_full, s_full = full.update(g, s_full, params, value=jnp.float32(np.mean(losses)))
    assert bool(jnp.all(u["w"] == 0)) == bool(jnp.all(u_full["w"] == 0)) == (t in (5, 6))
  for a, b in zip(optax_lamb.spike_stats(s_sharded), optax_lamb.spike_stats(s_full), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


@pytest.mark.usefixtures("rows_layout")  # the budget holds for the accelerators' layout
def test_no_parameter_sized_temporary():
  """The spike test adds reductions of the gradients, no copy: a donated step's temporaries
  (XLA:CPU's memory_analysis) stay within 1% of the params (+64 KiB) of the same wrapper's
  without it."""
  shapes = {"odd": (600, 500), "prime": (100_003,), "bias": (768,), "scalar": ()}
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  param_bytes = 4 * sum(math.prod(s) for s in shapes.values())

  def temporaries(tx) -> int:
    def step(p, s, g, v):
      u, s = tx.update(g, s, p, value=v)
      return optax.apply_updates(p, u), s

    state = jax.eval_shape(tx.init, params)
    loss = jax.ShapeDtypeStruct((), jnp.float32)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params, loss)
    return lowered.compile().memory_analysis().temp_size_in_bytes

  for inner in (optax.sgd(0.1), optax_lamb.lamb(1e-3, weight_decay=0.01)):
    plain = temporaries(optax_lamb.skip_nonfinite(inner))
    spiky = temporaries(optax_lamb.skip_nonfinite(inner, spikes=RULE))
    assert spiky <= plain + 0.01 * param_bytes + 64 * 1024, (plain, spiky, param_bytes)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(factor=1.0), ValueError, r"factor must be a finite number > 1, got factor=1.0"),
    (dict(factor=math.nan), ValueError, r"factor=nan"),
    (dict(factor="6"), TypeError, r"factor='6'"),
    (dict(warmup_steps=0), ValueError, r"warmup_steps must be an integer >= 1, got warmup_steps=0"),
    (dict(warmup_steps=2.5), TypeError, r"warmup_steps=2.5"),
    (dict(warmup_steps=True), TypeError, r"warmup_steps=True"),
    (dict(decay=1.0), ValueError, r"decay must be a number in \[0, 1\), got decay=1.0"),
    (dict(decay=-0.1), ValueError, r"decay=-0.1"),
    (dict(loss_factor=0.5), ValueError, r"loss_factor must be None or a finite number > 1"),
    (dict(loss_factor=math.inf), ValueError, r"loss_factor=inf"),
  ],
)
def test_bad_rules_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_lamb.SpikeRule(**kwargs)


def test_bad_spikes_and_bad_loss(rng):
  with pytest.raises(
    TypeError, match=r"spikes must be None or an optax_lamb.SpikeRule, got spikes=6"
  ):
    optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=6)
  tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=RULE)
  params = params_of(rng)
  with pytest.raises(ValueError, match=r"value must be a scalar loss, got shape \(2,\)"):
    tx.update(params, tx.init(params), params, value=jnp.ones(2))


@pytest.mark.parametrize("where", ["around lamb", "after unscale_gradients"])
def test_a_loss_scale_passed_to_update_is_divided_out_of_the_norm(where, rng):
  """With update(..., grad_scale=s) the rule judges the unscaled gradients' norm: a scale
  that changes between steps (a dynamic loss scale) is no spike."""
  grads, losses = sequence(rng)
  params = params_of(rng)
  tx = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), spikes=RULE)
  if where == "after unscale_gradients":
    tx = optax.chain(optax_lamb.unscale_gradients(), tx)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, v, k: tx.update(g, s, p, value=v, grad_scale=k))
  ref = SpikeReference(RULE)
  for t, (g, loss) in enumerate(zip(grads, losses, strict=True)):
    scale = 2.0 ** (4 + 3 * (t % 3))
    scaled = jax.tree.map(lambda x, scale=scale: x * scale, g)
    updates, state = step(scaled, state, params, jnp.float32(loss), jnp.float32(scale))
    moved = any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    assert moved == ref.step(g, loss), t
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(
    float(optax_lamb.spike_stats(state).norm_average), ref.norm[0], rtol=1e-5
  )


@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("master", [False, True])
def test_lamb_skip_spikes_is_the_wrapper_fused(implementation, master, rng):
  """lamb(skip_nonfinite=True, skip_spikes=rule) takes the reference's decisions and computes
  what skip_nonfinite(lamb(...), spikes=rule) computes, on the fused step and on the chain."""
  grads, losses = sequence(rng)
  params = params_of(rng)
  kw = dict(weight_decay=0.01, max_grad_norm=1.0, master_weights=master)
  tx = optax_lamb.lamb(
    1e-2, skip_nonfinite=True, skip_spikes=RULE, implementation=implementation, **kw
  )
  p, s, taken = check_against_reference(tx, SpikeReference(RULE), params, grads, losses)
  assert isinstance(s, optax_lamb.SkipSpikesState)
  wrapped = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2, **kw), spikes=RULE)
  p_wrapped, s_wrapped, taken_wrapped = check_against_reference(
    wrapped, SpikeReference(RULE), params, grads, losses
  )
  assert taken == taken_wrapped
  assert_trees_close(p, p_wrapped, rtol=1e-6)


@pytest.mark.usefixtures("rows_layout")  # the budget holds for the accelerators' layout
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_lamb_skip_spikes_has_no_parameter_sized_temporary(max_grad_norm):
  """Fused into lamb's step, the spike rule keeps lamb's own skip's budget: 1% of the params
  plus 64 KiB (tests/backends/test_memory_budget.py), where the wrapper holds a copy."""
  shapes = {"odd": (600, 500), "prime": (100_003,), "bias": (768,), "scalar": ()}
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  param_bytes = 4 * sum(math.prod(s) for s in shapes.values())
  tx = optax_lamb.lamb(
    1e-3, weight_decay=0.01, max_grad_norm=max_grad_norm, skip_nonfinite=True, skip_spikes=RULE
  )

  def step(p, s, g, v):
    u, s = tx.update(g, s, p, value=v)
    return optax.apply_updates(p, u), s

  state = jax.eval_shape(tx.init, params)
  loss = jax.ShapeDtypeStruct((), jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params, loss)
  temps = lowered.compile().memory_analysis().temp_size_in_bytes
  assert temps <= 0.01 * param_bytes + 64 * 1024, temps / param_bytes


def test_lamb_skip_spikes_needs_skip_nonfinite():
  with pytest.raises(ValueError, match=r"skip_spikes needs skip_nonfinite=True"):
    optax_lamb.lamb(1e-2, skip_spikes=RULE)
  with pytest.raises(TypeError, match=r"skip_spikes must be None or an optax_lamb.SpikeRule"):
    optax_lamb.lamb(1e-2, skip_nonfinite=True, skip_spikes=3.0)


def test_under_inject_hyperparams(rng):
  """The rule is a static argument of inject_hyperparams (not a number); spike_stats finds the
  state inside."""
  grads, losses = sequence(rng, steps=10, spikes=(7,), loss_spikes=(), nan=())
  params = params_of(rng)
  tx = optax.inject_hyperparams(optax_lamb.lamb)(
    learning_rate=1e-2, skip_nonfinite=True, skip_spikes=RULE
  )
  _, state, taken = check_against_reference(tx, SpikeReference(RULE), params, grads, losses)
  assert not taken[7] and int(optax_lamb.spike_stats(state).skipped) == 1


def test_the_first_accepted_value_is_the_average():
  tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=optax_lamb.SpikeRule(decay=0.99))
  params = {"w": jnp.ones(3)}
  _, state = tx.update({"w": jnp.full(3, 2.0)}, tx.init(params), params, value=jnp.float32(1.3))
  stats = optax_lamb.spike_stats(state)
  assert float(stats.loss_average) == np.float32(1.3)
  assert float(stats.norm_average) == float(jnp.sqrt(jnp.float32(12.0)))
