"""LAMB under data parallelism on the 8 host CPU devices of conftest.

Each mode trains the MLP of `dp_problem` for a few steps on the same global
batches and must end with the parameters of the single-device run:

1. ``jax.pmap``: replicated params with ``lax.pmean``'d gradients, and
   ZeRO/FSDP-style sharded leaves with ``axis_name``;
2. ``jax.jit`` with ``NamedSharding``: params, moments and batch sharded over a
   mesh axis (ZeRO), on an Auto and an Explicit mesh; no silent all-gather of
   the optimizer state;
3. ``jax.shard_map`` with sharded leaves and ``axis_name`` (all leaves sharded,
   weights sharded and biases replicated with a per-leaf ``axis_name``, and a
   2-D mesh with a tuple of axis names).

The last tests show what goes wrong without ``axis_name`` (each shard computes
its own trust ratio and clipping norm) or with one name for leaves of which
some are replicated (their squares are counted once per device).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import dp_problem as prob
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb

N_DEVICES = 8
# float32 training on different reduction orders: a few ulps per step.
ATOL = 2e-5


def check_close(name, got, want):
  """Assert the trained params match the single-device run; print the gap (pytest -s shows it)."""
  diff = prob.max_abs_diff(got, want)
  print(f"\n{name}: max |params - single-device params| = {diff:.3g}")
  assert diff < ATOL, (name, diff)


@pytest.fixture(scope="module")
def reference():
  return prob.reference_run()


@pytest.fixture(scope="module")
def batches():
  return prob.make_batches()


def test_eight_devices():
  assert jax.device_count() == N_DEVICES, "conftest sets --xla_force_host_platform_device_count=8"


def test_problem_exercises_clipping_and_ratios(reference):
  """The reference run clips (grad norm > max_grad_norm) and its ratios are not all 1."""
  params = prob.init_params()
  x, y = prob.make_batches()
  grads = jax.grad(prob.loss_fn)(params, x[0], y[0])
  norm = float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads))))
  assert norm > 2 * prob.MAX_GRAD_NORM
  _, ratios = reference
  assert all(abs(float(r) - 1.0) > 1e-2 for r in jax.tree.leaves(ratios[0]))


# --- 1. pmap ---------------------------------------------------------------------------------

needs_pmap = pytest.mark.skipif(not hasattr(jax, "pmap"), reason="this jax has no jax.pmap")


@needs_pmap
def test_pmap_replicated_params_pmean_grads(reference, batches):
  """Classic data parallel: every device holds all params; grads pmean'd; no axis_name."""
  xs, ys = batches
  tx = prob.make_tx()

  @functools.partial(jax.pmap, axis_name="d")
  def step(params, state, x, y):
    grads = lax.pmean(jax.grad(prob.loss_fn)(params, x, y), "d")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(lambda v: np.broadcast_to(v, (N_DEVICES, *v.shape)), prob.init_params())
  state = jax.pmap(tx.init)(params)
  local = prob.GLOBAL_BATCH // N_DEVICES
  for t in range(prob.STEPS):
    params, state = step(
      params, state, xs[t].reshape(N_DEVICES, local, -1), ys[t].reshape(N_DEVICES, local, -1)
    )
  params = jax.tree.map(np.asarray, params)
  replica0 = jax.tree.map(lambda v: v[0], params)
  assert prob.max_abs_diff(params, jax.tree.map(lambda v: v[:1], params)) == 0.0  # replicas agree
  want, ratios = reference
  check_close("pmap replicated", replica0, want)
  got_ratios = jax.tree.map(lambda r: np.asarray(r)[0], optax_lamb.trust_ratios(state))
  np.testing.assert_allclose(
    np.array(jax.tree.leaves(got_ratios)), np.array(jax.tree.leaves(ratios[-1])), rtol=1e-4
  )


@needs_pmap
@pytest.mark.parametrize(
  "replicate_biases", [False, True], ids=["all-sharded", "biases-replicated"]
)
def test_pmap_sharded_leaves_axis_name(reference, batches, replicate_biases):
  """ZeRO/FSDP inside pmap: each device holds 1/8 of each (sharded) leaf and of its moments."""
  xs, ys = batches
  sharded = prob.WEIGHTS if replicate_biases else prob.LEAVES
  axis_name = {k: ("d" if k in sharded else None) for k in prob.LEAVES}
  tx = prob.make_tx(axis_name=axis_name)
  step = jax.pmap(prob.fsdp_step(tx, sharded, "d", N_DEVICES), axis_name="d")

  def split(k, v):
    if k in sharded:
      return v.reshape(N_DEVICES, v.shape[0] // N_DEVICES, *v.shape[1:])
    return np.broadcast_to(v, (N_DEVICES, *v.shape))

  params = {k: split(k, v) for k, v in prob.init_params().items()}
  state = jax.pmap(tx.init)(params)
  local = prob.GLOBAL_BATCH // N_DEVICES
  for t in range(prob.STEPS):
    params, state = step(
      params, state, xs[t].reshape(N_DEVICES, local, -1), ys[t].reshape(N_DEVICES, local, -1)
    )
  got = {
    k: np.asarray(v).reshape(-1, *v.shape[2:]) if k in sharded else np.asarray(v)[0]
    for k, v in params.items()
  }
  want, ratios = reference
  check_close(
    f"pmap sharded ({'biases replicated' if replicate_biases else 'all sharded'})", got, want
  )
  # every device applied the same ratio, the one of the whole leaf
  got_ratios = jax.tree.map(np.asarray, optax_lamb.trust_ratios(state))
  for k in prob.LEAVES:
    np.testing.assert_allclose(got_ratios[k], np.full(N_DEVICES, ratios[-1][k]), rtol=1e-4)


# --- 2. jit with NamedSharding (ZeRO) --------------------------------------------------------


def per_device_bytes(x) -> int:
  return x.addressable_shards[0].data.nbytes


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_jit_named_sharding_zero(reference, batches, axis_type):
  """Params, moments and batch sharded over one mesh axis; the compiler inserts the collectives."""
  xs, ys = batches
  explicit = axis_type == "explicit"
  mesh = jax.make_mesh(
    (N_DEVICES,), ("data",), axis_types=(AxisType.Explicit if explicit else AxisType.Auto,)
  )
  sharded = NamedSharding(mesh, P("data"))
  replicated = NamedSharding(mesh, P())
  tx = prob.make_tx()  # no axis_name: under jit the arrays are global

  def loss(params, x, y):
    if explicit:  # explicit sharding: gather the params for the forward pass
      params = jax.tree.map(lambda v: jax.reshard(v, P()), params)
    return prob.loss_fn(params, x, y)

  def step(params, state, x, y):
    grads = jax.grad(loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  host_params = prob.init_params()
  params = jax.device_put(host_params, sharded)
  param_shardings = jax.tree.map(lambda _: sharded, host_params)

  with jax.set_mesh(mesh):
    # init: eagerly (zeros_like keeps each param's sharding) and jitted with out_shardings
    eager_state = tx.init(params)
    shapes = jax.eval_shape(tx.init, params)
    out_shardings = prob.state_shardings(tx, shapes, host_params, param_shardings, replicated)
    state = jax.jit(tx.init, out_shardings=out_shardings)(params)
    for st in (eager_state, state):
      adam = st[1]
      for moments in (adam.mu, adam.nu):
        for k, m in moments.items():
          assert m.sharding.is_equivalent_to(params[k].sharding, m.ndim), k
          assert per_device_bytes(m) * N_DEVICES == m.nbytes, k
    if explicit:  # explicit mesh: even a plain jit of init keeps the shardings
      plain = jax.jit(tx.init)(params)
      for k, m in plain[1].mu.items():
        assert m.sharding.is_equivalent_to(params[k].sharding, m.ndim), k

    x0, y0 = jax.device_put((xs[0], ys[0]), sharded)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x0, y0).compile()
    out_params_sh, out_state_sh = compiled.output_shardings
    for k in prob.LEAVES:
      shape = host_params[k].shape
      per_dev = (shape[0] // N_DEVICES, *shape[1:])
      for sh in (out_params_sh[k], out_state_sh[1].mu[k], out_state_sh[1].nu[k]):
        assert sh.is_equivalent_to(sharded, len(shape)), (k, sh)
        assert sh.shard_shape(shape) == per_dev, (k, sh)
    memory = compiled.memory_analysis()
    if memory is not None:  # per-device output: 1/8 of params + moments, plus a few scalars
      total = 3 * sum(v.nbytes for v in host_params.values())
      assert memory.output_size_in_bytes < total / N_DEVICES + 512, memory

    for t in range(prob.STEPS):
      x, y = jax.device_put((xs[t], ys[t]), sharded)
      params, state = compiled(params, state, x, y)

  for k in prob.LEAVES:
    assert params[k].sharding.is_equivalent_to(sharded, params[k].ndim)
    assert state[1].mu[k].sharding.is_equivalent_to(sharded, params[k].ndim)
    assert per_device_bytes(state[1].nu[k]) * N_DEVICES == state[1].nu[k].nbytes
  want, ratios = reference
  check_close(f"jit NamedSharding ({axis_type})", jax.tree.map(np.asarray, params), want)
  got_ratios = jax.tree.map(np.asarray, optax_lamb.trust_ratios(state))
  np.testing.assert_allclose(
    np.array(jax.tree.leaves(got_ratios)), np.array(jax.tree.leaves(ratios[-1])), rtol=1e-4
  )


# --- 3. shard_map ----------------------------------------------------------------------------


def run_shard_map(mesh_shape, axes, sharded, axis_name, batches, steps=prob.STEPS):
  """Train with the FSDP step inside `jax.shard_map`; return (params, state) as global arrays."""
  xs, ys = batches
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(AxisType.Explicit,) * len(axes))
  shard_axis = axes[0] if len(axes) == 1 else tuple(axes)
  tx = prob.make_tx(axis_name=axis_name)
  host_params = prob.init_params()
  param_specs = {k: P(shard_axis) if k in sharded else P() for k in prob.LEAVES}
  state_specs = prob.state_shardings(tx, tx.init(host_params), host_params, param_specs, P())
  data_spec = P(shard_axis)
  step = jax.jit(
    jax.shard_map(
      prob.fsdp_step(tx, sharded, shard_axis, N_DEVICES, check_vma=True),
      mesh=mesh,
      in_specs=(param_specs, state_specs, data_spec, data_spec),
      out_specs=(param_specs, state_specs),
    )
  )

  def put(tree, specs):
    return jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), tree, specs)

  params = put(host_params, param_specs)
  state = put(tx.init(host_params), state_specs)
  for t in range(steps):
    x, y = jax.device_put((xs[t], ys[t]), NamedSharding(mesh, data_spec))
    params, state = step(params, state, x, y)
  return params, state


@pytest.mark.parametrize(
  "mesh_shape,axes,sharded,axis_name",
  [
    ((8,), ("d",), prob.LEAVES, "d"),
    ((8,), ("d",), prob.WEIGHTS, {"w1": "d", "w2": "d", "b1": None, "b2": None}),
    ((8,), ("d",), prob.WEIGHTS, lambda params: {k: "d" if k[0] == "w" else None for k in params}),
    ((4, 2), ("x", "y"), prob.LEAVES, ("x", "y")),
  ],
  ids=["all-sharded", "biases-replicated", "callable", "2d-mesh-tuple"],
)
def test_shard_map_sharded_leaves_axis_name(
  request, reference, batches, mesh_shape, axes, sharded, axis_name
):
  params, state = run_shard_map(mesh_shape, axes, sharded, axis_name, batches)
  want, ratios = reference
  check_close(f"shard_map {request.node.callspec.id}", jax.tree.map(np.asarray, params), want)
  for k in sharded:  # moments stay sharded: each device holds 1/8
    assert per_device_bytes(state[1].mu[k]) * N_DEVICES == state[1].mu[k].nbytes
  got_ratios = jax.tree.map(np.asarray, optax_lamb.trust_ratios(state))
  np.testing.assert_allclose(
    np.array(jax.tree.leaves(got_ratios)), np.array(jax.tree.leaves(ratios[-1])), rtol=1e-4
  )


# --- what goes wrong without axis_name -------------------------------------------------------


def test_without_axis_name_each_shard_uses_its_own_ratio(reference, batches):
  """Sharded leaves but no axis_name: each device computes ||p_shard|| / ||u_shard||.

  The per-shard ratios differ from device to device and from the true ratio of
  the whole leaf, the clipping norm is per shard too, and training diverges
  from the single-device run. The same step with ``axis_name`` is exact.
  """
  xs, ys = batches
  mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
  host_params = prob.init_params()
  specs = {k: P("d") for k in prob.LEAVES}

  def one_step(axis_name):
    tx = prob.make_tx(axis_name=axis_name)
    inner = prob.fsdp_step(tx, prob.LEAVES, "d", N_DEVICES)

    def step(params, state, x, y):
      params, state = inner(params, state, x, y)
      ratios = jax.tree.map(lambda r: r[None], optax_lamb.trust_ratios(state))  # one per device
      return params, ratios

    state = tx.init(host_params)
    state_specs = prob.state_shardings(tx, state, host_params, specs, P())
    f = jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, state_specs, P("d"), P("d")),
      out_specs=(specs, specs),
      check_vma=False,  # the per-shard ratios are not replicated: that is the point
    )
    params = jax.device_put(host_params, NamedSharding(mesh, P("d")))
    state = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), state, state_specs)
    x, y = jax.device_put((xs[0], ys[0]), NamedSharding(mesh, P("d")))
    params, ratios = jax.jit(f)(params, state, x, y)
    return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, ratios)

  want_params, _ = prob.reference_run(steps=1)
  _, want_ratios = reference
  want_ratios = want_ratios[0]

  wrong_params, wrong_ratios = one_step(None)
  for k in prob.LEAVES:
    per_shard = wrong_ratios[k]
    assert per_shard.shape == (N_DEVICES,)
    assert np.ptp(per_shard) > 1e-2 * want_ratios[k], (k, per_shard)  # devices disagree
    assert np.max(np.abs(per_shard - want_ratios[k])) > 1e-2 * want_ratios[k], k
  wrong = prob.max_abs_diff(wrong_params, want_params)
  print(f"\nshard_map without axis_name, one step: max |params - single-device| = {wrong:.3g}")
  assert wrong > 1e-3

  right_params, right_ratios = one_step("d")
  for k in prob.LEAVES:
    np.testing.assert_allclose(right_ratios[k], np.full(N_DEVICES, want_ratios[k]), rtol=1e-5)
  check_close("shard_map one step with axis_name", right_params, want_params)


def test_one_axis_name_for_replicated_leaves_overcounts_the_global_norm():
  """Biases replicated but axis_name="d" for every leaf: their squares are psum'd 8 times.

  The trust ratio of a replicated leaf survives (both of its norms grow by the
  same factor) but the global clipping norm is wrong; a per-leaf axis_name with
  None for the replicated leaves is exact.
  """
  mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(3)
  grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in prob.init_params().items()}
  specs = {k: P("d") if k in prob.WEIGHTS else P() for k in prob.LEAVES}
  want = jax.tree.map(np.asarray, optax_lamb.clip_by_global_norm(1.0).update(grads, None)[0])

  def clipped(axis_name):
    tx = optax_lamb.clip_by_global_norm(1.0, axis_name=axis_name)
    f = jax.shard_map(
      lambda g: tx.update(g, optax.EmptyState())[0],
      mesh=mesh,
      in_specs=(specs,),
      out_specs=specs,
    )
    g = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), grads, specs)
    return jax.tree.map(np.asarray, jax.jit(f)(g))

  per_leaf = {"w1": "d", "w2": "d", "b1": None, "b2": None}
  assert prob.max_abs_diff(clipped(per_leaf), want) < 1e-6
  assert prob.max_abs_diff(clipped("d"), want) > 1e-3


# --- axis_name resolution ---------------------------------------------------------------------


FULL_FORMS = [  # (a short form of axis_name, the per-leaf tree it means)
  (None, {"a": {"w": None, "b": None}, "c": None}),
  ("x", {"a": {"w": "x", "b": "x"}, "c": "x"}),
  (("x", "y"), {"a": {"w": ("x", "y"), "b": ("x", "y")}, "c": ("x", "y")}),
  ({"a": ("x", "y"), "c": None}, {"a": {"w": ("x", "y"), "b": ("x", "y")}, "c": None}),
  (lambda p: {"a": {"w": "x", "b": None}, "c": "x"}, {"a": {"w": "x", "b": None}, "c": "x"}),
]


def test_axis_name_forms_name_the_same_leaves():
  """Each form of axis_name psums the norms of the leaves its per-leaf tree names, on a 2x4 mesh."""
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(0)
  params = {"a": {"w": rng.normal(size=4), "b": rng.normal(size=4)}, "c": rng.normal(size=4)}
  params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)

  def updates(axis_name):  # leaves split over x, replicated over y
    tx = optax_lamb.lamb(1e-2, weight_decay=0.1, max_grad_norm=0.1, axis_name=axis_name)
    step = lambda p: tx.update(p, tx.init(p), p)[0]
    specs = dict(in_specs=P("x"), out_specs=P("x"), check_vma=False)  # y: replicated, psum too
    return jax.jit(jax.shard_map(step, mesh=mesh, **specs))(params)

  results = [(updates(short), updates(full)) for short, full in FULL_FORMS]
  for short, full in results:
    assert prob.max_abs_diff(short, full) == 0.0
  # the names change the result: local norms (None) against the leaf's (x), and in part (last)
  assert prob.max_abs_diff(results[0][0], results[1][0]) > 1e-4
  assert prob.max_abs_diff(results[1][0], results[-1][0]) > 1e-4


def test_axis_name_that_does_not_fit_the_params():
  params = {"a": {"w": jnp.ones(2), "b": jnp.ones(2)}, "c": jnp.ones(2)}
  tx = optax_lamb.lamb(1e-2, axis_name={"a": "d"})
  with pytest.raises(ValueError, match=r"structure of axis_name does not match params"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(TypeError, match=r"axis_name must be None, .*got axis_name\['a'\]=3"):
    optax_lamb.lamb(1e-2, axis_name={"a": 3, "c": None})


# --- the example -------------------------------------------------------------------------------


@pytest.mark.slow  # the example script in its own process (10 s): CI runs it
def test_example_runs_on_eight_devices():
  """examples/data_parallel.py on the 8 fake CPU devices, a few steps, in a subprocess."""
  pytest.importorskip("flax")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ)  # carries conftest's XLA_FLAGS (8 devices)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
  result = subprocess.run(
    [sys.executable, os.path.join(root, "examples", "data_parallel.py"), "--steps", "12"]
    + ["--log-every", "4", "--shard-params"],
    env=env,
    cwd=root,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "1 process(es), 8 devices (8 local)" in out
  losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
  assert len(losses) == 4 and losses[-1] < losses[0], out
  assert "fc1/kernel=" in out and "norm/scale=" in out
