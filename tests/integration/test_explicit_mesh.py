"""``jax.jit(tx.update)`` on meshes of `Explicit` axes (``jax.set_mesh``) at realistic leaf sizes.

jax types every array on such a mesh with its sharding and refuses, at trace time, a reshape
or a slice that would split a sharded axis differently (``ShardingTypeError``). The step
views large leaves in blocks (the norm sums: 16 Ki elements and up; 8-bit moments: blocks of
256 along the last axis), so these trees hold leaves of 16 Ki to 64 Ki elements (1 Mi in the
slow set) sharded on their first axis, their last axis (in whole 256-column blocks, and across
blocks), a flat leaf and stacked leaves sharded on their layer axis or inside their layers,
on 4 and 8 of conftest's CPU devices, for ``lamb``, ``offload(lamb)``, 8-bit moments,
``skip_nonfinite``, ``max_grad_norm`` and ``stacked_axes``, on the ``xla`` and ``reference``
paths and the Pallas kernels interpreted (slow; 8-bit moments on a mesh they leave to the XLA
path, with a warning). Each step must

* equal the one-device step: updates and trust ratios to rtol 1e-5 (the norms are summed per
  shard); the moments and 8-bit codes and scales bit for bit (they do not depend on a
  reduction) except with clipping, whose global norm is summed per shard: there to rtol 1e-5;
* keep the params' shardings on the updates and moments, and move no leaf-sized array between
  devices (no all-gather, all-to-all or collective-permute of that size; 8-bit blocks across
  shards excepted: XLA moves what a block needs);
* with ``skip_nonfinite``, keep the state bit for bit on a gradient with a NaN in one shard.

(The layouts of tests/integration/test_sharded_jit.py have at most 2,048 elements a leaf.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import IMPLEMENTATION_RTOL
from helpers.implementations import EIGHT_BIT_BLOCKS, lamb_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_sharded_jit import moved_arrays

import optax_lamb
from optax_lamb.backends.pallas_triton import PallasTritonBackend

ATOL = 1e-7  # as tests/integration/test_sharded_jit.py: updates of elements near zero
MAX_GRAD_NORM = 1.0

# name: (shape, spec, stacked axes in the "stacked" configuration)
LEAVES = {
  "rows": ((64, 256), P("d"), 0),  # 16 Ki, first axis
  "cols": ((32, 2048), P(None, "d"), 0),  # 64 Ki, last axis: 256 or 512 columns a device
  "flat": ((16384,), P("d"), 0),
  "layers": ((8, 64, 256), P("d"), 1),  # 128 Ki: 16 Ki a layer, sharded on the layer axis
  "inner": ((4, 64, 256), P(None, "d"), 1),  # 64 Ki, sharded inside its layers
  "bias": ((256,), P(), 0),
}
# 16 Ki, its last axis over 8 devices: 128 columns, half a quantization block (the kernels take
# 8-bit moments in whole blocks only: not on the Pallas path)
STRADDLING = {"straddling": ((16, 1024), P(None, "d"), 0)}
BIG = {  # 1 Mi elements each, on the first and on the last axis
  "big_rows": ((1024, 1024), P("d"), 0),
  "big_cols": ((256, 4096), P(None, "d"), 0),
}

CONFIGS = {
  "lamb": {},
  "offload": {},
  "8bit": {"mu_dtype": jnp.int8, "nu_dtype": jnp.uint8},
  "skip": {"skip_nonfinite": True},
  "clip": {"max_grad_norm": MAX_GRAD_NORM},
  "stacked": {},
}


def make_tx(config: str, implementation: str, leaves: dict):
  stacked = {k: v[2] for k, v in leaves.items()} if config == "stacked" else 0
  make = (
    lamb_for(implementation)
    if isinstance(implementation, str)
    else functools.partial(optax_lamb.lamb, implementation=implementation)
  )
  tx = make(
    1e-2,
    weight_decay=0.01,
    mask={k: k != "bias" for k in leaves},
    stacked_axes=stacked,
    **CONFIGS[config],
  )
  return optax_lamb.offload(tx) if config == "offload" else tx


def arrays(leaves: dict, seed: int, positive: bool = False) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  draw = lambda s: np.abs(rng.normal(size=s)) if positive else rng.normal(size=s)
  return {k: draw(shape).astype(np.float32) for k, (shape, _, _) in leaves.items()}


def moments(state) -> tuple:
  return optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")


_ONE_DEVICE: dict = {}


def one_device_step(config: str, implementation: str, leaves: dict):
  """(updates, state) of the step on one device, from a state one step in (non-zero moments)."""
  key = (config, implementation, tuple(leaves))
  if key not in _ONE_DEVICE:
    put = lambda tree: jax.device_put(tree, jax.devices()[0])
    params, grads = put(arrays(leaves, 0)), put(arrays(leaves, 1))
    tx = make_tx(config, implementation, leaves)
    step = jax.jit(tx.update)
    _, state = step(put(arrays(leaves, 2)), tx.init(params), params)
    updates, state = step(grads, state, params)
    _ONE_DEVICE[key] = jax.device_get((updates, state))
  return _ONE_DEVICE[key]


def run_explicit(config: str, implementation: str, leaves: dict, devices: int):
  """The same two steps under jax.jit on an Explicit mesh of `devices` devices, then (skip) a
  third with a NaN in one shard of a gradient: (updates, state, state after the NaN step)."""
  mesh = jax.make_mesh(
    (devices,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:devices]
  )
  tx = make_tx(config, implementation, leaves)
  shardings = {k: NamedSharding(mesh, spec) for k, (_, spec, _) in leaves.items()}
  put = lambda tree: {k: jax.device_put(v, shardings[k]) for k, v in tree.items()}
  with jax.set_mesh(mesh):
    params, grads = put(arrays(leaves, 0)), put(arrays(leaves, 1))
    step = jax.jit(tx.update)
    _, state = step(put(arrays(leaves, 2)), tx.init(params), params)
    compiled = step.lower(grads, state, params).compile()
    updates, state = compiled(grads, state, params)
    after_nan = None
    if config == "skip":
      bad = arrays(leaves, 1)
      first_sharded = next(k for k, (_, spec, _) in leaves.items() if spec != P())
      bad[first_sharded].flat[-1] = np.nan  # in the last device's shard
      after_nan = step(put(bad), state, params)
  for k, sharding in shardings.items():  # the params' shardings kept
    for x in jax.tree.leaves((updates[k], moments(state)[0][k])):
      if x.shape == leaves[k][0]:  # (offload: in host memory)
        want = sharding.with_memory_kind(x.sharding.memory_kind)
        assert x.sharding.is_equivalent_to(want, x.ndim), (k, x.sharding)
  if not (config == "8bit" and "straddling" in leaves):  # (blocks across shards: XLA moves them)
    smallest = min(math.prod(shape) for shape, spec, _ in leaves.values() if spec != P())
    assert moved_arrays(compiled.as_text(), smallest) == []
  return updates, state, after_nan


def assert_equals_one_device(config, got, want, state_after_nan):
  (updates, state), (want_updates, want_state) = got, want
  for k in want_updates:
    np.testing.assert_allclose(
      np.asarray(updates[k]), want_updates[k], rtol=IMPLEMENTATION_RTOL, atol=ATOL, err_msg=k
    )
  ratios = optax_lamb.trust_ratios(jax.device_get(state))  # (offload: from host memory)
  want_ratios = optax_lamb.trust_ratios(want_state)
  for k in want_ratios:
    np.testing.assert_allclose(np.asarray(ratios[k]), want_ratios[k], rtol=IMPLEMENTATION_RTOL)
  got_moments, want_moments = jax.device_get(moments(state)), moments(want_state)
  if config == "clip":  # the clipped gradient's factor is a sum per shard
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=IMPLEMENTATION_RTOL, atol=ATOL),
      got_moments,
      want_moments,
    )
  else:  # codes and scales too
    jax.tree.map(np.testing.assert_array_equal, got_moments, want_moments)
  if state_after_nan is not None:
    nan_updates, nan_state = state_after_nan
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(nan_state.inner_state),
                 jax.device_get(state.inner_state))  # fmt: skip
    assert int(nan_state.consecutive) == 1
    for k, u in nan_updates.items():
      np.testing.assert_array_equal(np.asarray(u), 0, err_msg=k)


def check(config: str, implementation: str, leaves: dict, devices: int):
  updates, state, after_nan = run_explicit(config, implementation, leaves, devices)
  want = one_device_step(config, implementation, leaves)
  assert_equals_one_device(config, (updates, state), want, after_nan)


@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_step_on_an_explicit_mesh_equals_one_device(config, implementation, devices):
  check(config, implementation, LEAVES | STRADDLING, devices)


@pytest.mark.slow  # the kernels interpreted
@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "8bit"])
def test_kernels_on_an_explicit_mesh_equal_one_device(config, devices):
  check(config, "pallas", LEAVES, devices)


def test_kernels_leave_8bit_moments_on_an_explicit_mesh_to_xla_and_say_so():
  """The kernels' per-device step does not shard codes and scales yet: on a mesh outside
  shard_map they decline 8-bit moments with a warning, and the step runs on the XLA path."""
  kernels = PallasTritonBackend(block_sizes=EIGHT_BIT_BLOCKS, interpret=True)
  with pytest.warns(UserWarning, match="8-bit quantized moments on a mesh outside shard_map"):
    updates, state, _ = run_explicit("8bit", kernels, LEAVES, 8)
  assert_equals_one_device("8bit", (updates, state), one_device_step("8bit", "xla", LEAVES), None)


@pytest.mark.slow  # 1 Mi-element leaves
@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_million_element_leaves_on_an_explicit_mesh(config, implementation):
  check(config, implementation, BIG | {"bias": LEAVES["bias"]}, 8)


def test_the_problem_clips_and_adapts():
  """The clipping configuration clips (global norm above MAX_GRAD_NORM) and every ratio adapts."""
  grads = arrays(LEAVES | STRADDLING, 1)
  assert (
    np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads.values()))
    > 10 * MAX_GRAD_NORM
  )
  _, state = one_device_step("clip", "xla", LEAVES | STRADDLING)
  ratios = optax_lamb.trust_ratios(state)
  assert all(np.all(np.abs(ratios[k] - 1) > 1e-3) for k in LEAVES if k != "bias")
