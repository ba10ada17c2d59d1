"""compat.onnxruntime_lamb against the float64 transcription of ONNX Runtime's LambOptimizer.

ORT's kernels need CUDA, so (as for apex and DeepSpeed) the float64 NumPy transcription in
`references/onnxruntime.py` is the only check: every step of problem.py's 20, including its
per-element rules for non-finite gradients and weights and its ``do_update`` input, on the
xla and reference implementations (the Pallas kernels decline the per-element rules).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import problem
import pytest
from compat_runs import PALLAS
from references import onnxruntime
from test_references import worst_difference

import optax_lamb
from optax_lamb import compat
from optax_lamb.backends.xla import XlaBackend

TOLERANCE = 1e-4  # of each leaf's largest value: float32 against float64 (test_compat_libraries)
LR = 0.01
# The fused XLA step keeps u of small leaves (all of problem.py's) in memory; materialize 0
# recomputes u in pass 2 from g and the old moments, the path of larger leaves.
IMPLEMENTATIONS = {
  "xla": "xla",
  "xla_recompute": XlaBackend(materialize_u_max_size=0),
  "reference": "reference",
}
_MASK = {name: name in problem.DECAYED for name in problem.NAMES}
_LAMBDA = {name: (0.1 if name in problem.DECAYED else 0.0) for name in problem.NAMES}


def _schedule(count):
  return LR * jnp.minimum(1.0, (count + 1) / 5)


def _poisoned_gradients() -> list[dict[str, np.ndarray]]:
  """problem.gradients() with non-finite elements at some steps (NaN, +inf, -inf)."""
  steps = [{n: g.copy() for n, g in grads.items()} for grads in problem.gradients()]
  steps[2]["encoder/kernel"][3, 4] = np.nan
  steps[5]["conv/kernel"][1, 2, 0] = np.inf
  steps[5]["encoder/bias"][1] = -np.inf
  steps[9]["temperature"] = np.array(np.nan, np.float32)
  steps[13]["norm/scale"][0] = np.inf
  steps[13]["encoder/kernel"][0, 0] = np.nan
  return steps


# name -> (onnxruntime_lamb's keywords, the transcription's, run options)
CASES = {
  "defaults": ({}, {}, {}),
  "lambda_masked": (
    {"lambda_coef": 0.1, "weight_decay_mask": _MASK},
    {"lambda_": _LAMBDA},
    {},
  ),
  "no_clip": ({"max_norm_clip": None}, {}, {"no_norm": True}),
  "clip_5": ({"max_norm_clip": 5.0}, {"max_norm_clip": 5.0}, {}),
  "ratio_bounds": ({"ratio_min": 0.5, "ratio_max": 2.0}, {"ratio_min": 0.5, "ratio_max": 2.0}, {}),
  "ratio_min_above_max": (
    {"ratio_min": 1.5, "ratio_max": 0.5},
    {"ratio_min": 1.5, "ratio_max": 0.5},
    {},
  ),
  "no_bias_correction": ({"do_bias_correction": False}, {"do_bias_correction": 0}, {}),
  "alpha_beta_epsilon": (
    {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-8},
    {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-8},
    {},
  ),
  "loss_scale": ({"loss_scale": 1024.0}, {}, {"loss_scale": 1024.0}),
  "nonfinite_gradients": ({}, {}, {"poisoned": True}),
  "nonfinite_gradients_no_clip": ({"max_norm_clip": None}, {}, {"poisoned": True, "no_norm": True}),
  "nonfinite_gradients_lambda": (
    {"lambda_coef": 0.1, "weight_decay_mask": _MASK, "ratio_max": 5.0},
    {"lambda_": _LAMBDA, "ratio_max": 5.0},
    {"poisoned": True},
  ),
  "do_update": ({}, {}, {"skipped": (0, 3, 4, 11)}),
  "nan_weight": ({}, {}, {"nan_weight": True}),
}


def _initial_params(run: dict) -> dict[str, np.ndarray]:
  params = problem.initial_params()
  if run.get("nan_weight"):
    params["encoder/kernel"] = params["encoder/kernel"].copy()
    params["encoder/kernel"][2, 5] = np.nan
  return params


def _reference_run(kwargs: dict, run: dict) -> list[dict[str, np.ndarray]]:
  """The transcription's params after each step (ORT's trainer: update_count 1 at the first)."""
  opt = onnxruntime.LambOptimizer(_initial_params(run), **kwargs)
  grads = _poisoned_gradients() if run.get("poisoned") else problem.gradients()
  scale, skipped, after = run.get("loss_scale"), run.get("skipped", ()), []
  taken = 0  # the schedule of lr reads the count of steps taken, as lamb's does
  for t, g in enumerate(grads):
    scaled = {n: np.asarray(x, np.float64) * (scale or 1.0) for n, x in g.items()}
    norm = None if run.get("no_norm") else _global_norm(scaled)
    with np.errstate(all="ignore"):  # inf / inf where an infinite gradient is clipped
      opt.step(scaled, eta=LR * problem.lr_factor(taken), loss_scale=scale, grad_norm=norm,
               do_update=t not in skipped)  # fmt: skip
    taken += t not in skipped
    after.append({n: p.copy() for n, p in opt.params.items()})
  return after


def _global_norm(tree: dict) -> float:
  with np.errstate(all="ignore"):
    return float(np.sqrt(sum(np.sum(x * x) for x in tree.values())))


def _ours(tx, run: dict) -> list[dict[str, np.ndarray]]:
  grads = _poisoned_gradients() if run.get("poisoned") else problem.gradients()
  scale, skipped = run.get("loss_scale"), run.get("skipped", ())
  params = {n: jnp.asarray(p) for n, p in _initial_params(run).items()}
  state = tx.init(params)

  @jax.jit
  def step(params, state, g, do_update):
    updates, state = tx.update(g, state, params, do_update=do_update)
    return optax.apply_updates(params, updates), state

  after = []
  for t, g in enumerate(grads):
    g = {n: jnp.asarray(x * np.float32(scale or 1.0)) for n, x in g.items()}
    params, state = step(params, state, g, jnp.asarray(t not in skipped))
    after.append(jax.device_get(params))
  return after


def _assert_close(ours: list, theirs: list, what: str) -> None:
  for t, (a, b) in enumerate(zip(ours, theirs, strict=True)):
    for name in problem.NAMES:  # NaN where the transcription has NaN (a frozen NaN weight)
      np.testing.assert_array_equal(np.isnan(a[name]), np.isnan(b[name]), err_msg=f"{what} {t}")
    finite = {n: np.where(np.isnan(b[n]), 0.0, b[n]) for n in problem.NAMES}
    ours_finite = {n: np.where(np.isnan(a[n]), 0.0, a[n]) for n in problem.NAMES}
    worst, leaf = worst_difference(ours_finite, finite)
    assert worst <= TOLERANCE, f"{what}, after step {t + 1}: {worst:.2e} on {leaf}"


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_lamb_reproduces_the_transcription(case, implementation):
  ours_kwargs, ort_kwargs, run = CASES[case]
  impl = IMPLEMENTATIONS[implementation]
  tx = compat.onnxruntime_lamb(_schedule, **ours_kwargs, implementation=impl)
  _assert_close(_ours(tx, run), _reference_run(ort_kwargs, run), f"{case} on {implementation}")


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_nonfinite_element_keeps_its_moments_and_weight(implementation):
  """The rule itself, on one step: the NaN and inf elements' moments and weights unchanged, the
  others stepped; the step count advances (the step was taken)."""
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  tx = compat.onnxruntime_lamb(LR, implementation=IMPLEMENTATIONS[implementation])
  state = tx.init(params)
  grads = {n: jnp.asarray(g) for n, g in problem.gradients()[0].items()}
  state = tx.update(grads, state, params)[1]
  bad = dict(grads, **{"conv/kernel": grads["conv/kernel"].at[0, 1, 2].set(jnp.nan)})
  bad["conv/kernel"] = bad["conv/kernel"].at[2, 2, 3].set(-jnp.inf)
  updates, new = tx.update(bad, state, params)
  u, m, v = updates["conv/kernel"], new[1].mu["conv/kernel"], new[1].nu["conv/kernel"]
  for index in ((0, 1, 2), (2, 2, 3)):
    assert u[index] == 0
    assert m[index] == state[1].mu["conv/kernel"][index]
    assert v[index] == state[1].nu["conv/kernel"][index]
  assert int(jnp.sum(u != 0)) == u.size - 2
  assert int(new[1].count) == 2
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(updates))


def test_do_update_false_keeps_the_state_bit_identical():
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  tx = compat.onnxruntime_lamb(optax.linear_schedule(LR, 0.0, 10), implementation="xla")
  grads = {n: jnp.asarray(g) for n, g in problem.gradients()[0].items()}
  state = tx.update(grads, tx.init(params), params)[1]
  for flag in (False, jnp.asarray(False), jnp.asarray(0)):
    updates, new = jax.jit(lambda g, s, p, f: tx.update(g, s, p, do_update=f))(
      grads, state, params, flag
    )
    assert all(not np.any(u) for u in jax.tree.leaves(updates))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "options",
  [
    {"skip_nonfinite": True, "loss_scale": optax.constant_schedule(4.0)},
    {"skip_nonfinite": True, "master_weights": True, "implementation": "reference"},
  ],
)
def test_do_update_false_keeps_the_wrapped_states_bit_identical(options):
  """A false do_update closes the planned step: the skip's counters (after a skipped step), the
  loss-scale schedule's count and the master weights stay as they were, with the moments."""
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  tx = compat.onnxruntime_lamb(LR, **{"implementation": "xla", **options})
  grads = {n: jnp.asarray(g) for n, g in problem.gradients()[0].items()}
  poisoned = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  state = tx.update(grads, tx.init(params), params)[1]
  state = tx.update(poisoned, state, params)[1]
  assert int(optax_lamb.skip_counts(state).total) == 1
  updates, new = jax.jit(lambda g, s, p: tx.update(g, s, p, do_update=jnp.asarray(False)))(
    grads, state, params
  )
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_pallas_declines_with_a_stated_reason():
  """The kernels do not implement the per-element rules: the step runs on XLA, saying why."""
  tx = compat.onnxruntime_lamb(LR, implementation=PALLAS)
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  grads = {n: jnp.asarray(g) for n, g in problem.gradients()[0].items()}
  with pytest.warns(UserWarning, match="ONNX Runtime's per-element rules"):
    ours, _ = tx.update(grads, tx.init(params), params)
  want, _ = compat.onnxruntime_lamb(LR, implementation="xla").update(grads, tx.init(params), params)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


def test_update_and_apply_and_trust_ratios():
  """update_and_apply's fused step computes what update + apply_updates does; trust_ratios reads
  the state through the do_update wrapper."""
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  tx = compat.onnxruntime_lamb(LR, lambda_coef=0.01, implementation="xla")
  grads = {n: jnp.asarray(g) for n, g in _poisoned_gradients()[2].items()}
  state = tx.init(params)
  fused, fused_state = jax.jit(lambda g, s, p: optax_lamb.update_and_apply(tx, g, s, p))(
    grads, state, params
  )
  updates, plain_state = jax.jit(tx.update)(grads, state, params)
  plain = optax.apply_updates(params, updates)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  ratios = optax_lamb.trust_ratios(fused_state)
  assert set(ratios) == set(problem.NAMES)


@pytest.mark.parametrize(
  "kwargs,error,name",
  [
    ({"max_norm_clip": 0.0}, RuntimeError, "max_norm_clip"),
    ({"max_norm_clip": -1.0}, ValueError, "max_norm_clip"),
    ({"max_norm_clip": math.nan}, ValueError, "max_norm_clip"),
    ({"do_bias_correction": 2}, RuntimeError, "do_bias_correction"),
    ({"alpha": 1.0}, ValueError, "alpha"),
    ({"beta": -0.1}, ValueError, "beta"),
    ({"lambda_coef": -0.1}, ValueError, "lambda_coef"),
    ({"epsilon": 0.0}, ValueError, "epsilon"),
    ({"ratio_max": -1.0}, ValueError, "ratio_max"),
    ({"ratio_min": math.inf}, ValueError, "ratio_min"),
    ({"ratio_min": math.nan}, ValueError, "ratio_min"),
    ({"lr": -1.0}, ValueError, "lr"),
    ({"loss_scale": 0.0}, ValueError, "loss_scale"),
    ({"loss_scale": 8.0, "grad_scale": 8.0}, ValueError, "loss_scale"),
  ],
)
def test_argument_errors_name_ort_spelling(kwargs, error, name):
  with pytest.raises(error, match=rf"\b{name}\b"):
    compat.onnxruntime_lamb(**kwargs)


def test_ratio_bounds_and_clip_off_map_to_none():
  """The schema's defaults (-inf, inf) and an infinite clip compute the unbounded, unclipped step."""
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  grads = {n: jnp.asarray(g) for n, g in problem.gradients()[0].items()}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    a = compat.onnxruntime_lamb(LR, max_norm_clip=math.inf, implementation="xla")
    b = compat.onnxruntime_lamb(LR, max_norm_clip=None, ratio_min=-1.0, implementation="xla")
    ua = a.update(grads, a.init(params), params)[0]
    ub = b.update(grads, b.init(params), params)[0]
  for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
    np.testing.assert_array_equal(x, y)


def test_do_update_under_inject_hyperparams():
  """optax.inject_hyperparams hands do_update on to the update; a false one changes nothing but
  the wrapper's own count."""
  params = {n: jnp.asarray(p) for n, p in problem.initial_params().items()}
  grads = {n: jnp.asarray(g) for n, g in problem.gradients()[0].items()}
  tx = optax.inject_hyperparams(compat.onnxruntime_lamb)(lr=LR, implementation="xla")
  state = tx.init(params)
  updates, new = jax.jit(lambda g, s, p: tx.update(g, s, p, do_update=jnp.asarray(False)))(
    grads, state, params
  )
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  for a, b in zip(
    jax.tree.leaves(new.inner_state), jax.tree.leaves(state.inner_state), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  updates, _ = tx.update(grads, state, params)
  want, _ = compat.onnxruntime_lamb(LR, implementation="xla").update(
    grads, state.inner_state, params
  )
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.usefixtures("rows_layout")  # the budget holds for the accelerators' layout
@pytest.mark.parametrize("max_norm_clip,copies", [(1.0, 4), (None, 3)])
def test_memory_cost_of_the_per_element_rules_is_held(max_norm_clip, copies):
  """What a donated step costs on XLA:CPU today, held so that a regression still fails: the
  per-element rules keep the old moments until the direction is known, so the moments are
  recomputed in pass 2 (XLA:CPU copies them, as for narrow moments: 2 copies), and the guards add
  one more (measured, not yet traced to its buffer); the clip, applied to the gradients before the
  step (not inside it, as lamb's), keeps the clipped gradients (1). lamb's own step keeps none
  (tests/backends/test_memory_budget.py)."""
  shapes = {"odd": (600, 500), "stacked": (4, 512, 64), "bias": (768,), "scalar": ()}
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  tx = compat.onnxruntime_lamb(LR, max_norm_clip=max_norm_clip, implementation="xla")
  state = jax.eval_shape(tx.init, params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params).compile()
  param_bytes = sum(math.prod(s) for s in shapes.values()) * 4
  temps = compiled.memory_analysis().temp_size_in_bytes
  assert temps <= (copies + 0.01) * param_bytes + 64 * 1024, temps / param_bytes


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_sharded_leaves_with_axis_name_compute_the_unsharded_step(implementation):
  """Inside shard_map with axis_name, the clip's global norm (inf with an inf element) and the
  trust ratios are summed over the shards: the step equals the unsharded one."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  rng = np.random.default_rng(3)
  params = {"w": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), "b": jnp.zeros(8)}
  grads = [
    {"w": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=8))}
    for _ in range(3)
  ]
  grads[1]["w"] = grads[1]["w"].at[5, 1].set(jnp.nan)
  grads[2]["b"] = grads[2]["b"].at[6].set(jnp.inf)
  impl = IMPLEMENTATIONS[implementation]
  want = _run_steps(compat.onnxruntime_lamb(LR, implementation=impl), params, grads)
  tx = compat.onnxruntime_lamb(LR, axis_name="d", implementation=impl)
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  spec = lambda x: P("d") if jnp.ndim(x) and jnp.shape(x)[0] == 8 else P()  # noqa: E731
  state = tx.init(params)
  state_specs = jax.tree.map(spec, state)
  step = jax.jit(
    jax.shard_map(
      lambda p, s, g: (optax.apply_updates(p, tx.update(g, s, p)[0]), tx.update(g, s, p)[1]),
      mesh=mesh,
      in_specs=(P("d"), state_specs, P("d")),
      out_specs=(P("d"), state_specs),
    )
  )
  got = params
  for g in grads:
    got, state = step(got, state, g)
  for name in params:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def _run_steps(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, params)
    params = optax.apply_updates(params, updates)
  return params
