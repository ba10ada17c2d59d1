"""The behaviour every implementation of lamb must have, as one base class.

`tests/backends/test_conformance.py` subclasses `Conformance` once per
implementation (a name of `helpers.implementations.IMPLEMENTATIONS`); a new
backend joins by one class of one line there. The option cases run on the
option tree (`helpers.trees`); each (implementation, case) compiles one step,
whose runs the tests share (`runs.py`).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import runs
from helpers import asserts, fast_compile, seeds
from helpers.implementations import lamb_for
from helpers.options import CASES, LR, STEPS, build, lamb_options, reference
from helpers.trees import by_path, make_grads, make_params, paths, random_like, random_tree
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_lamb

CASE_NAMES = list(CASES)
LOW_PRECISION = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
DONATION_KWARGS = {  # every option that shapes the state, for the donation tests
  "learning_rate": optax.linear_schedule(1e-2, 1e-3, 5),
  "weight_decay": optax.linear_schedule(0.1, 0.01, 5),
  "mask": {"w": True, "b": False},
  "max_grad_norm": 1.0,
  "stacked_axes": {"w": 1, "b": 0},
  "mu_dtype": jnp.bfloat16,
}
SHARDED_SHAPES = {"w": (64, 40), "v": (8, 96), "b": (40,)}
WRAPPERS = {"skip_nonfinite": True, "master_weights": True, "grad_scale": lambda count: 4.0}


def _float64(tree) -> dict:
  return {name: np.asarray(x, np.float64) for name, x in by_path(tree).items()}


def _by_name(flat: dict) -> dict:
  return {name: np.asarray(x, np.float64) for name, x in flat.items()}


def _largest(x) -> float:
  return float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0))


TREE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
# per leaf: a shape, a param dtype, and whether it is all zeros (ratio exactly 1)
TREES = st.lists(st.tuples(_SHAPES, st.sampled_from(list(TREE_DTYPES)), st.booleans()),
                 min_size=1, max_size=3)  # fmt: skip
PROPERTY_STEPS = 3


def tiny_trees(implementation: str) -> str:
  """The configuration of an implementation for trees of a few elements."""
  return {"pallas": "pallas-tiny-blocks"}.get(implementation, implementation)


def random_problem(leaves, seed):
  """Params (a leaf may be all zeros) and PROPERTY_STEPS gradients, in the leaf dtypes."""
  rng = np.random.default_rng(seed)
  params, grads = {}, [{} for _ in range(PROPERTY_STEPS)]
  for i, (shape, dtype, zero) in enumerate(leaves):
    params[f"p{i}"] = jnp.asarray((0.0 if zero else 0.5) * rng.standard_normal(shape),
                                  TREE_DTYPES[dtype])  # fmt: skip
    for g in grads:
      g[f"p{i}"] = jnp.asarray(rng.standard_normal(shape), TREE_DTYPES[dtype])
  return params, grads


LOW_PRECISION_DECAY = 0.3
LOW_PRECISION_SHAPES = {"w": (16, 40), "k": (5, 20), "b": (37,)}
LOW_PRECISION_STEPS = 3


class LowPrecisionRun(NamedTuple):
  params: dict
  grads: list
  steps: list  # (updates, params, state) after each step of update + apply_updates
  fused: list  # (params, state) after each step of update_and_apply


@functools.cache
def low_precision_stepper(implementation: str, moments: str):
  """A jitted step: update + apply and update_and_apply, from their own (params, state)."""
  extra = {} if moments == "param-dtype" else {"mu_dtype": jnp.float32, "nu_dtype": jnp.float32}
  tx = lamb_for(implementation)(LR, weight_decay=LOW_PRECISION_DECAY, **extra)

  def step(p, s, fused, g):
    updates, new_s = tx.update(g, s, p)
    fused = optax_lamb.update_and_apply(tx, g, fused[1], fused[0])
    return (updates, optax.apply_updates(p, updates), new_s), fused

  return tx, fast_compile.jit(step)


@functools.lru_cache(maxsize=32)
def low_precision_run(implementation: str, dtype: str, moments: str, seed: int) -> LowPrecisionRun:
  """Three steps on params of scale 2 (the decay a large part of the direction, so its value shows)."""
  low = LOW_PRECISION[dtype]
  keys = jax.random.split(jax.random.PRNGKey(seed), len(LOW_PRECISION_SHAPES))
  params = {name: (2.0 * jax.random.normal(k, shape)).astype(low)
            for k, (name, shape) in zip(keys, LOW_PRECISION_SHAPES.items(), strict=True)}  # fmt: skip
  grads = [make_grads(params, seed + 1 + t) for t in range(LOW_PRECISION_STEPS)]
  tx, step = low_precision_stepper(implementation, moments)
  p, s = params, tx.init(params)
  fused, steps, fused_steps = (params, s), [], []
  for g in grads:
    out, fused = step(p, s, fused, g)
    steps.append(out)
    fused_steps.append(fused)
    _, p, s = out
  return LowPrecisionRun(params, grads, steps, fused_steps)


def first_step_ratios(params, grads, weight_decay, eps=1e-6):
  """The trust ratios of step 1 in float64: u = m^ / (sqrt(v^) + eps) + wd p, r = |p| / |u|."""
  ratios = {}
  for name, p in params.items():
    p, g = np.asarray(p, np.float64), np.asarray(grads[name], np.float64)
    u = g / (np.abs(g) + eps) + weight_decay * p  # bias-corrected moments of step 1: g and g^2
    ratios[name] = np.linalg.norm(p) / np.linalg.norm(u)
  return ratios


def assert_moment_close(ref, field: str, name: str, moment, rtol: float, at: str) -> None:
  """A float32 moment against the reference's: rtol on the terms summed (m's may cancel)."""
  want = (ref.m if field == "mu" else ref.v)[name]
  terms = ref.m_terms[name] if field == "mu" else np.abs(want)
  asserts.assert_close_to_reference(moment, want, rtol=rtol, atol=rtol * terms, err_msg=at)


def assert_within_one_rounding(got, want, dtype, msg):
  """Each element equal or one ulp of `dtype` apart (float32 values within rtol 1e-5 may round
  apart), and few that differ."""
  differ = total = 0
  for name in paths(want):
    a, b = by_path(got)[name], by_path(want)[name]
    asserts.assert_within_ulps(a, b, dtype, 1, err_msg=f"{name} {msg}")
    differ += int(np.sum(np.asarray(a, np.float64) != np.asarray(b, np.float64)))
    total += a.size
  assert differ <= 0.01 * total, f"{differ} of {total} differ; {msg}"


class Conformance:
  IMPLEMENTATION: str  # a name of helpers.implementations.IMPLEMENTATIONS

  @pytest.fixture(autouse=True, scope="class")
  @classmethod
  def _fresh_compilation_caches_per_class(cls):
    """Drop jax's compiled executables after each implementation's class, as conftest does after
    each module: test_conformance.py holds every class, and with the Mosaic GPU class one process
    compiled enough programs for XLA:CPU to crash (a segfault serializing an executable, once in
    the slow set, 2026-12-02)."""
    yield
    jax.clear_caches()

  def run(self, case, seed):
    return runs.run(self.IMPLEMENTATION, case, seed)

  def other(self) -> str:
    """The implementation this one is compared with: the stage chain, or xla for the chain."""
    return "xla" if self.IMPLEMENTATION == "reference" else "reference"

  # ------------------------------------------------------------- the float64 NumPy LAMB

  @pytest.mark.parametrize("case", CASE_NAMES)
  def test_each_step_matches_the_float64_reference(self, case, seed):
    """From this run's own params and moments, each step is the float64 step to float32 accuracy."""
    run = self.run(case, seed)
    ref = reference(CASES[case].reference)
    for t in range(STEPS):
      if t > 0:  # the reference steps from our params and moments: no drift compounds
        ref.m, ref.v = (_float64(optax.tree_utils.tree_get(run.states[t], f)) for f in ("mu", "nu"))
      before = _float64(run.params[t])
      want = ref.step(before, _float64(run.grads[t]))
      got, state = by_path(run.params[t + 1]), run.states[t + 1]
      ratios = by_path(optax_lamb.trust_ratios(state))
      stored = {f: by_path(optax.tree_utils.tree_get(state, f)) for f in ("mu", "nu")}
      for name, w in want.items():
        at = f"{case} {name} step {t + 1}"
        rtol = asserts.IMPLEMENTATION_RTOL * ref.ratio_condition[name] + ref.float32_constants_rtol
        atol = rtol * _largest(w - before[name]) + asserts.FLOAT32_EPS * _largest(w)
        asserts.assert_close_to_reference(got[name], w, rtol=rtol, atol=atol, err_msg=at)
        assert ratios[name].dtype == jnp.float32, at
        asserts.assert_close_to_reference(
          ratios[name], ref.ratios[name], rtol=rtol, atol=0, err_msg=at
        )
        for field in ("mu", "nu"):
          moment = stored[field][name]
          if np.dtype(moment.dtype).itemsize < 4:  # rounded from float32: one ulp
            want_moment = (ref.m if field == "mu" else ref.v)[name]
            # (before rounding: float32 m, whose terms may cancel, against float64 m)
            terms = ref.m_terms[name] if field == "mu" else np.abs(want_moment)
            unrounded = asserts.FEW_ROUNDINGS * terms
            asserts.assert_within_ulps(moment, want_moment, moment.dtype, 1, at, unrounded)
          else:  # (the clipping factor's norm, summed in float32, is within the README's rtol)
            assert_moment_close(ref, field, name, moment, asserts.IMPLEMENTATION_RTOL, at)

  @pytest.mark.parametrize("case", CASE_NAMES)
  def test_ends_at_the_float64_reference(self, case, seed):
    """Ten steps on their own, against ten float64 steps on the same gradients."""
    run, ref_run = self.run(case, seed), runs.reference_run(case, seed)
    got = by_path(run.params[-1])
    for name, want in ref_run.params.items():
      atol = runs.params_atol(ref_run, name, asserts.IMPLEMENTATION_RTOL, float64=True)
      asserts.assert_close_to_reference(
        got[name], want, rtol=asserts.IMPLEMENTATION_RTOL, atol=atol, err_msg=f"{case} {name}"
      )
    for name, r in by_path(optax_lamb.trust_ratios(run.states[-1])).items():
      rtol = runs.ratio_rtol(ref_run, name, asserts.IMPLEMENTATION_RTOL, float64=True)
      want = ref_run.ref.ratios[name]
      asserts.assert_close_to_reference(r, want, rtol=rtol, atol=0, err_msg=name)

  # ------------------------------------------------------------- the other implementations

  @pytest.mark.parametrize("case", CASE_NAMES)
  def test_agrees_with_the_stage_chain(self, case, seed):
    """Params and state (structure, shapes, dtypes, values) as the plain chain of stages gives."""
    mine, theirs = self.run(case, seed), runs.run(self.other(), case, seed)
    ref_run = runs.reference_run(case, seed)
    assert_finite = asserts.assert_all_finite
    assert_finite((mine.params[-1], mine.states[-1], mine.fused))
    runs.assert_runs_agree(
      (mine.params[-1], mine.states[-1]),
      (theirs.params[-1], theirs.states[-1]),
      ref_run,
      asserts.IMPLEMENTATION_RTOL,
    )

  @pytest.mark.parametrize("case", CASE_NAMES)
  def test_update_and_apply_equals_update_then_apply(self, case, seed):
    """The fused apply (p + u in the last pass; an FMA the compiler may contract) changes nothing else."""
    run = self.run(case, seed)
    runs.assert_runs_agree(
      run.fused, (run.params[-1], run.states[-1]), runs.reference_run(case, seed),
      asserts.FEW_ROUNDINGS,
    )  # fmt: skip

  def test_state_interchangeable(self, seed):
    """Steps of this implementation and of the other one, in any order, on one state."""
    other = self.other()
    steps = {name: runs.stepper(name, "combined")[1] for name in (self.IMPLEMENTATION, other)}
    params, grads = runs.inputs("combined", seed, steps=6)
    start = (params, runs.stepper(other, "combined")[0].init(params))
    ref_run = runs.reference_run("combined", seed)
    want = start
    for g in grads:
      want = steps[other](want, want, g)[0]
    for order in ((self.IMPLEMENTATION, other), (other, self.IMPLEMENTATION)):
      got = start
      for t, g in enumerate(grads):
        got = steps[order[t // 3]](got, got, g)[0]
      runs.assert_runs_agree(got, want, ref_run, asserts.IMPLEMENTATION_RTOL)

  # ------------------------------------------------------------- compiled steps

  @pytest.mark.parametrize("fused", [True, False], ids=["update_and_apply", "update"])
  def test_donated_step_equals_undonated(self, fused, rng):
    """Donated params and state (init's own arrays), with every wrapper for update: bit-identical."""
    kwargs = DONATION_KWARGS | ({} if fused else WRAPPERS)
    tx = lamb_for(self.IMPLEMENTATION)(**kwargs)
    p = {"w": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32), "b": jnp.zeros(5)}
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), p)
             for _ in range(2)]  # fmt: skip

    def step(p, state, g):
      if fused:
        return optax_lamb.update_and_apply(tx, g, state, p)
      return runs.update_then_apply(tx, p, state, g)

    # XLA's default options, as users compile: with the fast-compile ones (-O0 and the legacy
    # emitters together) the two programs of the Pallas interpret path differed in the last bit
    # of one element (2026-11-27), a compiler artifact of those options alone.
    plain = jax.jit(step)
    donated = jax.jit(step, donate_argnums=(0, 1))
    want = (p, tx.init(p))
    got = first = (jax.tree.map(jnp.copy, p), tx.init(p))
    again = (jax.tree.map(jnp.copy, p), tx.init(p))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # donated buffers the CPU backend cannot reuse
      for g in grads:
        want = plain(*want, g)
        got = donated(*got, g)
        again = donated(*again, g)
    asserts.assert_trees_equal(got, want)
    asserts.assert_trees_equal(again, got)  # deterministic
    # the donation took place: the params and moments handed in were consumed
    moments = [optax.tree_utils.tree_get(first[1], f) for f in ("mu", "nu")]
    assert all(x.is_deleted() for x in jax.tree.leaves((first[0], moments)))

  def test_schedules_and_injected_hyperparams_do_not_recompile(self, seed):
    params = make_params(seed)
    grads = make_grads(params, seed + 1)
    scheduled = build(CASES["schedules"].lamb, self.IMPLEMENTATION)
    injected = optax.inject_hyperparams(lamb_for(self.IMPLEMENTATION))(
      learning_rate=LR, weight_decay=0.01
    )
    for tx, values in ((scheduled, (None,) * 3), (injected, (1e-2, 3e-3, 1e-3))):

      def update_then_apply(p, s, g, tx=tx):
        return runs.update_then_apply(tx, p, s, g)

      chex.clear_trace_counter()
      step = jax.jit(chex.assert_max_traces(update_then_apply, n=1))
      p, s = params, tx.init(params)
      for lr in values:
        if lr is not None:  # a learning rate injected as an array: new values, one trace
          s.hyperparams["learning_rate"] = jnp.asarray(lr)
        p, s = step(p, s, grads)
      asserts.assert_all_finite(p)

  def test_under_inject_hyperparams_and_multisteps(self, seed):
    """Hyper-parameters arrive as arrays (inject_hyperparams); the state nests (MultiSteps)."""
    params, grads = runs.inputs("defaults", seed, steps=6)
    results = {}
    for impl in (self.IMPLEMENTATION, self.other()):
      tx = optax.inject_hyperparams(lamb_for(impl))(
        learning_rate=LR, weight_decay=0.01, min_trust_ratio=0.1
      )
      multi = optax.MultiSteps(tx, 2)
      step = fast_compile.jit(functools.partial(runs.update_then_apply, multi))
      p, s = params, multi.init(params)
      for g in grads:
        p, s = step(p, s, g)
      results[impl] = (p, optax_lamb.trust_ratios(s))
    (p, ratios), (p_other, ratios_other) = results.values()
    for name, a in by_path(p).items():
      b = by_path(p_other)[name]
      atol = asserts.FLOAT32_EPS * _largest(b)
      asserts.assert_close_to_reference(a, b, rtol=asserts.FEW_ROUNDINGS, atol=atol, err_msg=name)
    asserts.assert_trees_close(ratios, ratios_other, rtol=asserts.FEW_ROUNDINGS)

  @pytest.mark.parametrize("replicated", [(), ("b",)], ids=["one-name", "per-leaf"])
  def test_sharded_leaves_match_unsharded(self, replicated, rng):
    """Inside shard_map with axis_name, the norms are psum'd (not a replicated leaf's)."""
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
      pytest.skip("needs 8 devices (tests/conftest.py sets them for the CPU)")
    mesh = jax.sharding.Mesh(devices, ("d",))
    params = random_tree(rng, SHARDED_SHAPES)
    grads = [random_like(rng, params) for _ in range(2)]
    kwargs = {"weight_decay": 0.01, "max_grad_norm": 1.0, "min_trust_ratio": 0.1}
    axis_name = {k: None if k in replicated else "d" for k in params} if replicated else "d"
    spec = {k: jax.sharding.PartitionSpec(*(() if k in replicated else ("d",))) for k in params}
    whole = lamb_for("reference")(LR, **kwargs)
    want = (params, whole.init(params))
    for g in grads:
      want = runs.update_then_apply(whole, *want, g)
    tx = lamb_for(self.IMPLEMENTATION)(LR, axis_name=axis_name, **kwargs)

    def train(params, *grads):  # each device: its shards, init and the steps
      fused = lambda run, g: optax_lamb.update_and_apply(tx, g, run[1], run[0])
      return functools.reduce(fused, grads, (params, tx.init(params)))[0]

    sharded = jax.shard_map(train, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    got = jax.jit(sharded)(params, *grads)
    for name, a in by_path(got).items():
      b = by_path(want[0])[name]
      atol = asserts.FLOAT32_EPS * _largest(b)
      asserts.assert_close_to_reference(
        a, b, rtol=asserts.IMPLEMENTATION_RTOL, atol=atol, err_msg=name
      )

  # ------------------------------------------------------------- low-precision params

  @pytest.mark.parametrize("moments", ["param-dtype", "float32"])
  @pytest.mark.parametrize("dtype", list(LOW_PRECISION))
  def test_low_precision_params(self, dtype, moments, seed):
    """bfloat16/float16 params (float32 scalars, decay 0.3 not rounded): against xla and float64."""
    run = low_precision_run(self.IMPLEMENTATION, dtype, moments, seed)
    xla = low_precision_run("xla", dtype, moments, seed)
    low = LOW_PRECISION[dtype]
    for t, (mine, theirs) in enumerate(zip(run.steps, xla.steps, strict=True)):
      at = f"step {t + 1} {dtype} {moments}"
      updates, new_params, state = mine
      assert all(u.dtype == low for u in jax.tree.leaves((updates, new_params))), at
      ratios, want = optax_lamb.trust_ratios(state), optax_lamb.trust_ratios(theirs[2])
      asserts.assert_trees_close(ratios, want)
      if t == 0:  # ratios of step 1 from float64 with the decay exactly 0.3
        exact = first_step_ratios(run.params, run.grads[0], LOW_PRECISION_DECAY)
        for name, r in ratios.items():
          asserts.assert_close_to_reference(
            r, exact[name], rtol=asserts.IMPLEMENTATION_RTOL, atol=0, err_msg=at
          )
      assert_within_one_rounding(updates, theirs[0], low, at)
      runs.assert_moments_agree(state, theirs[2], asserts.IMPLEMENTATION_RTOL)
      assert_within_one_rounding(run.fused[t][0], new_params, low, f"update_and_apply {at}")
      asserts.assert_trees_close(optax_lamb.trust_ratios(run.fused[t][1]), ratios)

  @pytest.mark.parametrize("dtype", list(LOW_PRECISION))
  def test_low_precision_params_track_the_float64_reference(self, dtype, rng):
    """Each step with float32 moments: one rounding of the update to the param dtype."""
    low = LOW_PRECISION[dtype]
    shapes = {"w": (16, 8), "b": (8,), "s": ()}
    params = {k: jnp.asarray(rng.standard_normal(s), low) for k, s in shapes.items()}
    params["b"] = jnp.zeros(8, low)
    tx = lamb_for(self.IMPLEMENTATION)(1e-2, weight_decay=0.01, mu_dtype=jnp.float32,
                                       nu_dtype=jnp.float32)  # fmt: skip
    state = tx.init(params)
    ref = reference({"weight_decay": 0.01})
    step = fast_compile.jit(tx.update)
    for t in range(4):
      grads = {k: jnp.asarray(rng.standard_normal(s), low) for k, s in shapes.items()}
      if t:
        ref.m, ref.v = (_by_name(optax.tree_utils.tree_get(state, f)) for f in ("mu", "nu"))
      before = _by_name(params)
      want = ref.step(before, _by_name(grads))
      updates, state = step(grads, state, params)
      for name, w in want.items():
        at = f"{dtype} {name} step {t + 1}"
        # one rounding of the float32 update (float32 error << a low-precision ulp)
        asserts.assert_within_ulps(updates[name], w - before[name], low, 1, err_msg=at)
        for field in ("mu", "nu"):
          moment = optax.tree_utils.tree_get(state, field)[name]
          assert_moment_close(ref, field, name, moment, asserts.FEW_ROUNDINGS, f"{field} {at}")
        moments = [optax.tree_utils.tree_get(state, f)[name] for f in ("mu", "nu")]
        assert all(m.dtype == jnp.float32 for m in moments), at
      params = optax.apply_updates(params, updates)
      assert all(p.dtype == low for p in jax.tree.leaves(params))

  # ------------------------------------------------------------- random options (property test)

  @settings(max_examples=seeds.examples(25))
  @given(kwargs=lamb_options(), leaves=TREES, tree_seed=st.integers(0, 2**31 - 1))
  def test_agrees_with_xla_step_by_step_on_random_options(self, kwargs, leaves, tree_seed):
    """Random options, shapes and param dtypes; each step from the same params and state as xla."""
    if self.IMPLEMENTATION.startswith("xla"):  # (the case tests run the other XLA design)
      pytest.skip("an XLA design: the property test compares the other paths with it")
    params, grads = random_problem(leaves, tree_seed)
    txs = [lamb_for(impl)(**kwargs) for impl in (tiny_trees(self.IMPLEMENTATION), "xla")]

    @fast_compile.jit
    def step(params, state, g):
      out = []
      for tx in txs:
        updates, new_state = tx.update(g, state, params)
        out.append((updates, optax.apply_updates(params, updates), new_state))
      return out

    state = txs[1].init(params)
    for g in grads:
      mine, xla = step(params, state, g)
      asserts.assert_trees_within_ulps(mine, xla)
      asserts.assert_trees_close(optax_lamb.trust_ratios(mine[2]), optax_lamb.trust_ratios(xla[2]))
      _, params, state = xla
