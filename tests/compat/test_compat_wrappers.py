"""optax_lamb.compat with lamb's machinery: update_and_apply, the wrappers, trust_ratios,
axis_name under shard_map, stacked_axes and checkpoints.

Each test runs a compat constructor in one of those settings and checks it against the
library's recorded trajectory, its NumPy reference or the plain run, at the tolerance of
test_compat_libraries (1e-4 of each leaf's largest value) unless it says otherwise.
"""

from __future__ import annotations

import warnings

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import problem
import pytest
import run_references
from compat_runs import (
  CONSTRUCTORS,
  IMPLEMENTATIONS,
  compat_kwargs,
  initial_params,
  stacked_gradients,
  trajectory,
)
from helpers import fast_compile as _fast_compile
from helpers.two_leaves import assert_close, run_steps
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_compat_libraries import TOLERANCE, _expected
from test_references import worst_difference

import optax_lamb

# Cases whose options differ most from lamb's: L2; decay before the step under a schedule;
# bias correction on the step size with a clamp on ||p||; Keras' decay under a schedule.
FUSED = [
  ("apex", "l2"),
  ("timm", "decoupled_corrected_warmup"),
  ("torch_optimizer", "debias"),
  ("keras", "decay_warmup"),
]


def _build(library, case, **extra):
  return CONSTRUCTORS[library](**compat_kwargs(library, case), **extra)


def _assert_reproduces(library, case, ours, when="final", tolerance=TOLERANCE):
  for source, theirs in _expected(library, case).items():
    worst, leaf = worst_difference(ours, theirs[when])
    assert worst <= tolerance, f"{library} {case} vs {source}: {worst:.2e} on {leaf}"


@pytest.fixture(autouse=True)
def _quiet_interpret_mode():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    warnings.filterwarnings("ignore", message=".*runs on the xla path")
    yield


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("library,case", FUSED)
def test_update_and_apply_reproduces_library(library, case, implementation):
  tx = _build(library, case, implementation=IMPLEMENTATIONS[implementation])
  assert getattr(tx, "fused_apply", None) is not None
  ours = trajectory(tx, fused=True)
  _assert_reproduces(library, case, ours["final"])


def _run(tx, params, grads):
  """problem.STEPS steps of tx from params; grads: per leaf, a leading step axis."""

  def run(params, grads):
    def step(carry, g):
      p, s = carry
      updates, s = tx.update(g, s, p)
      return (optax.apply_updates(p, updates), s), None

    return jax.lax.scan(step, (params, tx.init(params)), grads)[0]

  return _fast_compile.jit(run)(params, grads)


@pytest.mark.parametrize("library,case", [("timm", "caution"), ("keras", "decay_warmup")])
def test_skip_nonfinite_skips_the_bad_step(library, case):
  """A NaN gradient at step 5 changes nothing: the run equals the one without that step."""
  grads = stacked_gradients()
  bad = jax.tree.map(lambda g: g.at[5].set(jnp.nan), grads)
  tx = _build(library, case, implementation="xla", skip_nonfinite=True)
  params, state = _run(tx, initial_params(), bad)
  assert int(optax_lamb.skip_counts(state).total) == 1
  without = jax.tree.map(lambda g: jnp.concatenate([g[:5], g[6:]]), grads)
  want, _ = _run(_build(library, case, implementation="xla"), initial_params(), without)
  worst, leaf = worst_difference(jax.device_get(params), jax.device_get(want))
  assert worst <= 1e-6, f"{worst:.1e} on {leaf}"


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_grad_scale_divides_the_scaled_gradients(implementation):
  library, case = "timm", "caution"
  scale = 1024.0
  scaled = jax.tree.map(lambda g: g * scale, stacked_gradients())
  tx = _build(library, case, implementation=implementation, grad_scale=scale)
  params, _ = _run(tx, initial_params(), scaled)
  _assert_reproduces(library, case, jax.device_get(params))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_master_weights_follow_the_library_for_bfloat16_params(implementation):
  """bfloat16 params, float32 master copies: the masters follow the float32 trajectory."""
  library, case = "keras", "decay_warmup"
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), initial_params())
  tx = _build(library, case, implementation=IMPLEMENTATIONS[implementation], master_weights=True)
  bf16_params, state = _run(tx, params, stacked_gradients())
  masters = jax.device_get(optax_lamb.master_weights(state))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_params))
  # The masters start from the bfloat16-rounded params: 2^-9 of the largest value at most.
  _assert_reproduces(library, case, masters, tolerance=4e-3)
  start = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  want, _ = _run(_build(library, case, implementation="xla"), start, stacked_gradients())
  worst, leaf = worst_difference(masters, jax.device_get(want))
  assert worst <= 1e-5, f"masters vs the float32 run from the rounded params: {worst:.1e} on {leaf}"


def test_trust_ratios_are_deepspeeds_clamped_coefficients():
  """DeepSpeed's lamb_coeffs after step 1: clamped to [min_coeff, max_coeff], 1 on zero norms."""
  library, case = "deepspeed", "tight_clamps"
  reference = run_references.build(library, case)
  run_references.step(library, case, reference, 0, problem.gradients()[0])
  names = list(problem.DECAYED) + list(problem.NOT_DECAYED)  # the order of the groups
  want = dict(zip(names, reference.lamb_coeffs, strict=True))
  for implementation in IMPLEMENTATIONS:
    tx = _build(library, case, implementation=IMPLEMENTATIONS[implementation])
    params = initial_params()
    grads = {k: jnp.asarray(v) for k, v in problem.gradients()[0].items()}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    got = jax.device_get(optax_lamb.trust_ratios(state))
    for name in problem.NAMES:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  # the zero-initialised leaf keeps 1 (unclamped); the clamp at max_coeff=0.2 acts on another
  assert want["encoder/bias"] == 1.0 and 0.2 in want.values()


def test_apex_undecayed_leaves_get_no_ratio_unless_nvlamb():
  for case, adapted in (("decay", set(problem.DECAYED)), ("nvlamb", set(problem.NAMES))):
    tx = _build("apex", case, implementation="xla")
    params = initial_params()
    grads = {k: jnp.asarray(v) for k, v in problem.gradients()[0].items()}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    ratios = jax.device_get(optax_lamb.trust_ratios(state))
    for name in problem.NAMES:
      nonzero = bool(np.any(problem.initial_params()[name]))
      assert (ratios[name] != 1.0) == (name in adapted and nonzero), (case, name, ratios[name])


# --- shard_map with axis_name -----------------------------------------------------------------

SHARDED = ("encoder/kernel", "encoder/bias", "norm/scale")  # split along axis 0 over 2 devices


@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("library,case", [("timm", "caution"), ("tfa", "lr_alias_clipnorm1")])
def test_axis_name_under_shard_map_reproduces_library(library, case, implementation):
  """Leaves split over 2 devices: clip norms, caution's mean and the ratios are psum'd."""
  mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
  names = {name: "d" if name in SHARDED else None for name in problem.NAMES}
  tx = _build(library, case, implementation=implementation, axis_name=names)
  params = initial_params()
  specs = {name: P("d") if name in SHARDED else P() for name in problem.NAMES}
  state_specs = optax.tree_map_params(
    tx,
    lambda v, p, s: s if jnp.shape(v) == jnp.shape(p) else P(),
    tx.init(params),
    params,
    specs,
    transform_non_params=lambda _: P(),
  )
  grad_specs = {name: P(None, *s) for name, s in specs.items()}

  def run(params, state, grads):
    def step(carry, g):
      p, s = carry
      updates, s = tx.update(g, s, p)
      return (optax.apply_updates(p, updates), s), None

    return jax.lax.scan(step, (params, state), grads)[0]

  f = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(specs, state_specs, grad_specs),
      out_specs=(specs, state_specs),
    )
  )
  put = lambda tree, s: jax.tree.map(
    lambda x, y: jax.device_put(x, NamedSharding(mesh, y)), tree, s
  )
  out, _ = f(
    put(params, specs), put(tx.init(params), state_specs), put(stacked_gradients(), grad_specs)
  )
  _assert_reproduces(library, case, jax.device_get(out))


# --- stacked layers ---------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_stacked_axes_equal_separate_layers(implementation):
  """Two layers stacked in one leaf with stacked_axes=1 step as the two leaves apart.

  timm with caution and decoupled decay: one trust ratio and one caution mean per layer.
  """
  rng = np.random.default_rng(7)
  layers = rng.standard_normal((2, 6, 4)).astype(np.float32)
  grads = rng.standard_normal((problem.STEPS, 2, 6, 4)).astype(np.float32)
  grads[:, 1] *= 5.0  # the layers get different ratios and clip shares
  kwargs = dict(lr=0.01, weight_decay=0.1, caution=True, decoupled_decay=True)
  impl = IMPLEMENTATIONS[implementation]
  stacked_tx = CONSTRUCTORS["timm"](**kwargs, stacked_axes=1, implementation=impl)
  separate_tx = CONSTRUCTORS["timm"](**kwargs, implementation=impl)
  stacked, _ = _run(stacked_tx, {"w": jnp.asarray(layers)}, {"w": jnp.asarray(grads)})
  separate, _ = _run(
    separate_tx,
    {"a": jnp.asarray(layers[0]), "b": jnp.asarray(layers[1])},
    {"a": jnp.asarray(grads[:, 0]), "b": jnp.asarray(grads[:, 1])},
  )
  np.testing.assert_allclose(stacked["w"][0], separate["a"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stacked["w"][1], separate["b"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ctor", ["keras_lamb", "tfa_lamb"])
def test_per_variable_clipnorm_clips_each_stacked_layer(ctor, device_count_seen):
  """With stacked_axes, Keras' and TF Addons' per-variable clipnorm computes what a model with
  one variable per layer computes: each stacked slice is clipped by its own norm."""
  rng = np.random.default_rng(2)
  layers = 3
  stacked = {"w": jnp.asarray(rng.normal(size=(layers, 4, 3)), jnp.float32)}
  grads = []
  for _ in range(3):  # layers with gradient norms far apart, so a shared clip differs
    g = rng.normal(size=(layers, 4, 3)) * np.array([0.01, 1.0, 30.0])[:, None, None]
    grads.append({"w": jnp.asarray(g, jnp.float32)})
  split = lambda tree: {f"w{i}": tree["w"][i] for i in range(layers)}
  with_stacking = getattr(optax_lamb.compat, ctor)(clipnorm=0.1, stacked_axes={"w": 1})
  per_layer = getattr(optax_lamb.compat, ctor)(clipnorm=0.1)
  got = split(run_steps(with_stacking, stacked, grads))
  want = run_steps(per_layer, split(stacked), [split(g) for g in grads])
  assert_close(got, want)


# --- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_moves_between_implementations():
  """10 steps on XLA, the state through flax.serialization, 10 more on the reference chain."""
  library, case = "timm", "decoupled_corrected_warmup"
  grads = stacked_gradients()
  half = problem.STEPS // 2
  first = jax.tree.map(lambda g: g[:half], grads)
  second = jax.tree.map(lambda g: g[half:], grads)
  xla_tx = _build(library, case, implementation="xla")

  def run(tx, params, state, grads):
    def step(carry, g):
      p, s = carry
      updates, s = tx.update(g, s, p)
      return (optax.apply_updates(p, updates), s), None

    return jax.lax.scan(step, (params, state), grads)[0]

  params = initial_params()
  params, state = jax.jit(lambda p, s, g: run(xla_tx, p, s, g))(params, xla_tx.init(params), first)
  data = flax.serialization.to_bytes(state)
  reference_tx = _build(library, case, implementation="reference")
  restored = flax.serialization.from_bytes(reference_tx.init(params), data)
  params, _ = jax.jit(lambda p, s, g: run(reference_tx, p, s, g))(params, restored, second)
  _assert_reproduces(library, case, jax.device_get(params))


def test_state_is_lambs_stage_tuple():
  """The state's structure is lamb's: clip, Adam, decay (a schedule count here), ratio, lr."""
  tx = _build("timm", "decoupled_corrected_warmup", implementation="xla")
  state = tx.init(initial_params())
  assert isinstance(state, tuple) and len(state) == 5
  assert isinstance(state[1], optax.ScaleByAdamState)
  assert isinstance(state[3], optax_lamb.ScaleByTrustRatioState)
  # decay s = lr_t^2 / lr0 follows the lr schedule: its count advances with the lr's
  assert jax.tree.leaves(state[2]) and jax.tree.leaves(state[4])
