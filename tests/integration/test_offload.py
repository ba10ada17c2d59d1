"""optax_lamb.offload: the state in host memory (pinned_host) between steps, the values unchanged.

On the CPU host and device memory are the same memory, so these tests check placement and
values (bit for bit against the same transformation without offload), with the params and the
host-memory state donated; the speed needs an accelerator (benchmarks/gpu_session.sh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers.asserts import assert_trees_equal
from helpers.trees import make_grads, make_params
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb

INNERS = {
  "lamb": lambda: optax_lamb.lamb(1e-2, weight_decay=0.01, max_grad_norm=1.0),
  "lamb skip, master": lambda: optax_lamb.lamb(1e-2, skip_nonfinite=True, master_weights=True),
  "apex": lambda: optax_lamb.compat.apex_fused_lamb(1e-2),
  "adamw": lambda: optax.adamw(1e-2),
}


def _kinds(tree) -> set:
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _run(tx, params, steps):
  params = jax.tree.map(jnp.copy, params)  # donated below
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: _apply(tx, p, s, g), donate_argnums=(0, 1))
  kinds = [_kinds(state)]
  for g in steps:
    params, state = step(params, state, g)
    kinds.append(_kinds(state))
  return params, state, kinds


def _apply(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("compute", ["device", "host"])
@pytest.mark.parametrize(  # skip + master weights: 6-7 s each, CI runs them (-m slow)
  "inner", [pytest.param(n, marks=pytest.mark.slow) if "master" in n else n for n in INNERS]
)
def test_offloaded_state_stays_on_the_host_and_gives_the_same_steps(inner, compute):
  params = make_params()
  steps = [make_grads(params, t) for t in range(3)]
  want_params, want_state, _ = _run(INNERS[inner](), params, steps)
  got_params, got_state, kinds = _run(optax_lamb.offload(INNERS[inner](), compute=compute), params,
                                      steps)  # fmt: skip
  assert all(k == {"pinned_host"} for k in kinds), kinds
  assert _kinds(got_params) == {"device"}
  assert_trees_equal(got_params, want_params)
  assert_trees_equal(got_state, want_state)


@pytest.mark.parametrize("compute", ["device", "host"])
def test_a_skipped_step_keeps_the_offloaded_state(compute):
  params = make_params()
  tx = optax_lamb.offload(optax_lamb.lamb(1e-2, skip_nonfinite=True), compute=compute)
  state = tx.init(params)
  bad = jax.tree.map(
    lambda g: g.at[(0,) * g.ndim].set(jnp.nan) if g.size else g, make_grads(params, 0)
  )
  updates, new_state = jax.jit(tx.update)(bad, state, params)
  assert int(optax_lamb.skip_counts(new_state).total) == 1
  assert_trees_equal(new_state.inner_state, state.inner_state)
  assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
  assert _kinds(new_state) == {"pinned_host"}


@pytest.mark.parametrize(  # device: 7 s, CI runs it (-m slow)
  "compute", [pytest.param("device", marks=pytest.mark.slow), "host"]
)
def test_multisteps_inside_an_offload(compute):
  params = make_params()
  grads = [make_grads(params, t) for t in range(4)]
  want = optax.MultiSteps(optax_lamb.lamb(1e-2), every_k_schedule=2)
  got = optax_lamb.offload(optax.MultiSteps(optax_lamb.lamb(1e-2), every_k_schedule=2),
                           compute=compute)  # fmt: skip
  want_params, want_state, _ = _run(want, params, grads)
  got_params, got_state, kinds = _run(got, params, grads)
  assert all(k == {"pinned_host"} for k in kinds), kinds
  assert_trees_equal(got_params, want_params)
  assert_trees_equal(got_state, want_state)


@pytest.mark.parametrize("compute", ["device", "host"])
def test_sharded_params_keep_their_shardings_in_host_memory(compute):
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  params = {"w": jnp.arange(64.0 * 8).reshape(64, 8) / 512, "b": jnp.ones(8)}
  specs = {"w": P("d"), "b": P()}
  params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})
  grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
  tx = optax_lamb.offload(optax_lamb.lamb(1e-2, weight_decay=0.01), compute=compute)
  state = tx.init(params)
  new_params, state = jax.jit(lambda p, s, g: _apply(tx, p, s, g))(params, state, grads)
  assert _kinds(state) == {"pinned_host"}
  mu = state[1].mu
  assert mu["w"].sharding.spec == P("d") and mu["b"].sharding.spec == P()
  want, _ = _apply(optax_lamb.lamb(1e-2, weight_decay=0.01), params,
                   optax_lamb.lamb(1e-2, weight_decay=0.01).init(params), grads)  # fmt: skip
  np.testing.assert_allclose(new_params["w"], want["w"], rtol=1e-6)


@pytest.mark.parametrize(  # device: 8 s, CI runs it (-m slow)
  "compute", [pytest.param("device", marks=pytest.mark.slow), "host"]
)
def test_8bit_moments_keep_the_params_shardings_in_host_memory(compute):
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  params = {"w": jnp.arange(64.0 * 1024).reshape(64, 1024) / 65536, "b": jnp.ones(8)}
  specs = {"w": P(None, "d"), "b": P()}  # 256 columns a device: whole blocks
  params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})
  grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
  make = lambda: optax_lamb.lamb(1e-2, weight_decay=0.01, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  tx = optax_lamb.offload(make(), compute=compute)
  state = tx.init(params)
  for _ in range(2):
    new_params, state = jax.jit(lambda p, s, g: _apply(tx, p, s, g))(params, state, grads)
  assert _kinds(state) == {"pinned_host"}
  for moment in (state[1].mu["w"], state[1].nu["w"]):
    assert moment.codes.sharding.spec == P(None, "d") and moment.scales.sharding.spec == P(
      None, "d"
    )
  want, want_state = params, make().init(params)
  for _ in range(2):
    want, want_state = _apply(make(), params, want_state, grads)
  np.testing.assert_allclose(new_params["w"], want["w"], rtol=1e-6, atol=1e-8)  # sums per shard
  np.testing.assert_array_equal(state[1].mu["w"].codes, want_state[1].mu["w"].codes)


def test_an_orbax_checkpoint_restores_into_host_memory(tmp_path):
  params = {k: v for k, v in make_params().items() if k != "empty"}  # orbax saves no empty array
  tx = optax_lamb.offload(optax_lamb.lamb(1e-2))
  _, state, _ = _run(tx, params, [make_grads(params, 0)])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  # The target's shardings carry the memory kind: those of a fresh init's state.
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tx.init(params))  # fmt: skip
  restored = checkpointer.restore(tmp_path / "state", target)
  assert _kinds(restored) == {"pinned_host"}
  assert_trees_equal(restored, state)


def test_a_backend_without_host_memory_is_named(monkeypatch):
  class Device:
    def addressable_memories(self):
      return [type("Memory", (), {"kind": "device"})()]

  monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
  with pytest.raises(ValueError, match="optax_lamb.offload needs host memory"):
    optax_lamb.offload(optax_lamb.lamb(1e-2))


def test_compute_is_checked():
  with pytest.raises(ValueError, match="compute must be one of"):
    optax_lamb.offload(optax_lamb.lamb(1e-2), compute="gpu")
