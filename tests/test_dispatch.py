"""The dispatcher: which backend computes a step, and the reason it gives for a fallback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lamb
from optax_lamb import _dispatch

LEAF = jax.ShapeDtypeStruct((64, 32), jnp.float32)
LEAVES = ([LEAF], [LEAF], [LEAF], [LEAF])


@pytest.fixture
def on_a_gpu(monkeypatch):
  """choose() as on a GPU backend (only choose(): nothing is compiled)."""
  monkeypatch.setattr(_dispatch.jax, "default_backend", lambda: "gpu")


def test_auto_on_a_cpu_is_the_xla_path(monkeypatch):
  monkeypatch.setattr(_dispatch.jax, "default_backend", lambda: "cpu")
  choice = _dispatch.choose("auto", *LEAVES)
  assert choice.backend == "xla" and "'cpu'" in choice.reason


def test_auto_on_one_gpu_is_the_kernels(on_a_gpu, monkeypatch):
  monkeypatch.setattr(_dispatch.jax, "device_count", lambda: 1)
  assert _dispatch.choose("auto", *LEAVES) == _dispatch.Choice("pallas", None)


def test_auto_with_several_devices_keeps_jit_sharding(on_a_gpu, monkeypatch):
  """Outside shard_map a pallas_call would gather sharded leaves: auto takes the XLA path."""
  monkeypatch.setattr(_dispatch.jax, "device_count", lambda: 8)
  choice = _dispatch.choose("auto", *LEAVES)
  assert choice.backend == "xla" and "outside shard_map" in choice.reason


def test_auto_inside_shard_map_is_the_kernels(on_a_gpu):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  spec = jax.sharding.PartitionSpec("d")
  seen = []

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
  def step(x):
    seen.append(_dispatch.choose("auto", [x], [x], [x], [x]))
    return x

  jax.eval_shape(step, jax.ShapeDtypeStruct((8 * len(jax.devices()),), jnp.float32))
  assert seen == [_dispatch.Choice("pallas", None)]


def test_without_pallas_triton_auto_and_pallas_take_xla(on_a_gpu, monkeypatch):
  monkeypatch.setattr(_dispatch, "pallas_import_error", lambda: "Pallas Triton is not available")
  monkeypatch.setattr(_dispatch.jax, "device_count", lambda: 1)
  for implementation in ("auto", "pallas"):
    choice = _dispatch.choose(implementation, *LEAVES)
    assert choice == _dispatch.Choice("xla", "Pallas Triton is not available")


def test_without_pallas_triton_a_pallas_request_warns_and_runs_xla(monkeypatch, fresh_rng):
  monkeypatch.setattr(_dispatch, "pallas_import_error", lambda: "no Pallas Triton here")
  _dispatch._REPORTED.clear()
  params = {"w": jnp.asarray(fresh_rng.standard_normal((4, 3)), jnp.float32)}
  pallas, xla = (optax_lamb.lamb(1e-2, implementation=i) for i in ("pallas", "xla"))
  with pytest.warns(UserWarning, match="no Pallas Triton here; it runs on the XLA path"):
    got = pallas.update(params, pallas.init(params), params)
  want = xla.update(params, xla.init(params), params)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize(
  "field, dtype, match",
  [("params", jnp.float64, "param dtype float64"), ("grads", jnp.bfloat16, "gradient dtype")],
)
def test_leaves_the_kernels_cannot_take(on_a_gpu, monkeypatch, field, dtype, match):
  monkeypatch.setattr(_dispatch.jax, "device_count", lambda: 1)
  odd = jax.ShapeDtypeStruct((64, 32), dtype)
  leaves = {"grads": [LEAF], "mu": [LEAF], "nu": [LEAF], "params": [LEAF]}
  leaves[field] = [odd]
  choice = _dispatch.choose("auto", *leaves.values())
  assert choice.backend == "xla" and match in choice.reason


def test_narrow_moments_are_taken_by_the_kernels(on_a_gpu, monkeypatch):
  monkeypatch.setattr(_dispatch.jax, "device_count", lambda: 1)
  narrow = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
  assert _dispatch.choose("auto", [LEAF], [narrow], [narrow], [narrow]).backend == "pallas"


def test_xla_and_reference_are_taken_as_asked(on_a_gpu):
  for implementation in ("xla", "reference"):
    assert _dispatch.choose(implementation, *LEAVES) == _dispatch.Choice(implementation, None)


def test_the_fused_apply_is_carried_by_lamb_only_without_wrappers():
  plain = optax_lamb.lamb(1e-3)
  assert callable(plain.update.fused_apply)
  for kwargs in ({"skip_nonfinite": True}, {"master_weights": True}, {"grad_scale": 2.0}):
    assert not hasattr(optax_lamb.lamb(1e-3, **kwargs).update, "fused_apply"), kwargs
