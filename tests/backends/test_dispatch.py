"""The dispatcher: which backend computes a step, and what it says about a fallback.

Observed through the public seams only: the INFO line ``auto`` logs on the
``optax_lamb`` logger when a step is traced, the warnings of an explicit
request, and backend objects passed as ``implementation=``. A GPU is simulated
by patching ``jax.default_backend`` (the steps are only traced, never compiled).
"""

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb
from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend
from optax_lamb.step._registry import AUTO_BASIS

LEAF = jax.ShapeDtypeStruct((64, 32), jnp.float32)


def traced_path(caplog, implementation="auto", params=None, **kwargs) -> str:
  """The log line of the backend chosen when lamb's update is traced over `params`."""
  params = {"w": LEAF} if params is None else params
  tx = optax_lamb.lamb(1e-2, implementation=implementation, **kwargs)
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="optax_lamb"):
    jax.eval_shape(tx.update, params, jax.eval_shape(tx.init, params), params)
  lines = [r.getMessage() for r in caplog.records if r.name == "optax_lamb"]
  assert len(lines) <= 1, lines
  return lines[0] if lines else ""


@pytest.fixture
def on_a_gpu(monkeypatch):
  """The default backend reported as a GPU (nothing is compiled in these tests)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.fixture
def one_device(monkeypatch):
  monkeypatch.setattr(jax, "device_count", lambda: 1)


def test_auto_on_a_cpu_is_the_xla_path(caplog):
  assert jax.default_backend() == "cpu"
  line = traced_path(caplog)
  assert line.startswith("optax_lamb.lamb: the xla path") and "backend 'cpu'" in line


def test_auto_on_one_gpu_is_the_kernels(on_a_gpu, one_device, caplog):
  assert (
    traced_path(caplog)
    == f"optax_lamb.lamb: the pallas_triton path ({AUTO_BASIS['pallas_triton']})"
  )


RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


def _gpu_results() -> dict[str, dict]:
  """The committed GPU benchmark files (benchmarks/results/), by name."""
  files = {}
  for name in sorted(os.listdir(RESULTS)):
    if name.endswith(".json"):
      with open(os.path.join(RESULTS, name)) as f:
        report = json.load(f)
      if report.get("backend") == "gpu":
        files[name] = report
  return files


def test_auto_takes_the_kernels_only_where_they_were_measured_faster():
  """auto's rule against the measurements: in the GPU file auto's log line cites and every one
  measured after it (the earlier ones timed earlier designs), every tree timed with both auto (the
  kernels) and the XLA path shows the kernels faster, device-only and end to end. A GPU run showing
  the XLA path faster fails this until that case is fixed or routed to XLA."""
  files = _gpu_results()
  cited = [name for name in files if name in AUTO_BASIS["pallas_triton"]]
  assert len(cited) == 1, (AUTO_BASIS["pallas_triton"], sorted(files))
  since = files[cited[0]]["date"]
  compared = 0
  for name, report in files.items():
    if report["date"] < since:
      continue
    for tree, case in report["cases"].items():
      auto, xla = case["results"].get("optax_lamb.lamb"), case["results"].get("xla.lamb")
      if not auto or not xla or "error" in auto or "error" in xla:
        continue
      for figure in ("device_ms", "e2e_ms"):
        assert auto[figure] < xla[figure], (name, tree, figure, auto[figure], xla[figure])
      compared += 1
  assert compared >= 2, "the cited file times BERT-base and -large with both paths"


def test_auto_with_several_devices_keeps_jit_sharding(on_a_gpu, monkeypatch, caplog):
  """Outside shard_map a pallas_call would gather sharded leaves: auto takes the XLA path."""
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  line = traced_path(caplog)
  assert line.startswith("optax_lamb.lamb: the xla path") and "outside shard_map" in line


def test_auto_inside_shard_map_is_the_kernels(on_a_gpu, caplog):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  spec = jax.sharding.PartitionSpec("d")
  tx = optax_lamb.lamb(1e-2, axis_name="d")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
  def step(x):
    params = {"w": x}
    updates, _ = tx.update(params, tx.init(params), params)
    return updates["w"]

  with caplog.at_level(logging.INFO, logger="optax_lamb"):
    jax.eval_shape(step, jax.ShapeDtypeStruct((8 * len(jax.devices()),), jnp.float32))
  assert [r.getMessage() for r in caplog.records] == [
    f"optax_lamb.lamb: the pallas_triton path ({AUTO_BASIS['pallas_triton']})"
  ]


def test_without_pallas_triton_auto_and_pallas_take_xla():
  """A jax whose Pallas Triton cannot be imported: checked in a process where the import fails."""
  script = textwrap.dedent(
    """
    import logging, sys, warnings
    sys.modules["jax.experimental.pallas.triton"] = None  # import fails, as on a jax without it
    import jax, jax.numpy as jnp, numpy as np, optax_lamb
    jax.default_backend = lambda: "gpu"
    jax.device_count = lambda: 1
    logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=sys.stdout)
    params = {"w": jnp.arange(12.0).reshape(4, 3)}
    out = {}
    for implementation in ("auto", "pallas", "xla"):
      tx = optax_lamb.lamb(1e-2, implementation=implementation)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out[implementation] = tx.update(params, tx.init(params), params)[0]["w"]
      for w in caught:
        print("WARNING", w.message)
    print("EQUAL", all(np.array_equal(out[k], out["xla"]) for k in out))
    """
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
  )
  assert run.returncode == 0, run.stderr
  lines = run.stdout.splitlines()
  assert "EQUAL True" in lines
  logs = [line for line in lines if line.startswith("LOG optax_lamb.lamb")]
  assert len(logs) == 1 and "the xla path (pallas_triton: Pallas Triton is not available" in logs[0]
  warned = [line for line in lines if line.startswith("WARNING")]
  assert len(warned) == 1 and "Pallas Triton is not available" in warned[0]
  assert warned[0].endswith("it runs on the xla path.")


@pytest.mark.parametrize(
  "capability, moments, path",
  [
    ("9.0", "float32", "the pallas_mosaic_gpu path"),
    ("8.0", "float32", "the xla path"),
    ("9.0", "8-bit", "the xla path"),
  ],
  ids=["hopper", "ampere", "hopper-8bit"],
)
def test_without_pallas_triton_auto_takes_mosaic_gpu_on_hopper(capability, moments, path):
  """A jax whose Pallas Triton cannot be imported (checked in a process where the import fails):
  auto takes the Mosaic GPU kernels on a GPU of compute capability 9.0 or newer, else XLA; 8-bit
  moments, which the Mosaic GPU kernels decline, go on to XLA with that reason in the log."""
  script = textwrap.dedent(
    """
    import logging, sys, types
    sys.modules["jax.experimental.pallas.triton"] = None  # import fails, as on a jax without it
    import jax, jax.numpy as jnp, optax_lamb
    jax.default_backend = lambda: "gpu"
    jax.device_count = lambda: 1
    gpu = types.SimpleNamespace(compute_capability=sys.argv[1], device_kind="a GPU")
    jax.local_devices = lambda *args, **kwargs: [gpu]
    logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=sys.stdout)
    eight_bit = sys.argv[2] == "8-bit"  # a leaf large enough to be stored quantized
    params = {"w": jax.ShapeDtypeStruct((16, 256) if eight_bit else (4, 3), jnp.float32)}
    kwargs = dict(mu_dtype=jnp.int8, nu_dtype=jnp.uint8) if eight_bit else {}
    tx = optax_lamb.lamb(1e-2, **kwargs)
    jax.eval_shape(tx.update, params, jax.eval_shape(tx.init, params), params)
    """
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-c", script, capability, moments],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr
  logs = [line for line in run.stdout.splitlines() if line.startswith("LOG optax_lamb.lamb")]
  assert len(logs) == 1, logs
  assert logs[0].startswith(f"LOG optax_lamb.lamb: {path} (pallas_triton: Pallas Triton is not")
  if moments == "8-bit":
    assert "pallas_mosaic_gpu: 8-bit quantized moments" in logs[0], logs[0]
  assert ("compute capability 8.0" in logs[0]) == (capability == "8.0"), logs[0]


@pytest.mark.parametrize(
  "dtypes, match",
  [
    ({"params": jnp.float64}, "param dtype float64"),
    ({"mu_dtype": jnp.float64}, "mu dtype float64"),
  ],
)
def test_leaves_the_kernels_cannot_take(on_a_gpu, one_device, caplog, dtypes, match):
  with jax.enable_x64(True):
    params = {"w": jax.ShapeDtypeStruct((64, 32), dtypes.get("params", jnp.float32))}
    kwargs = {k: v for k, v in dtypes.items() if k != "params"}
    line = traced_path(caplog, params=params, **kwargs)
  assert line.startswith("optax_lamb.lamb: the xla path") and match in line


def test_narrow_moments_are_taken_by_the_kernels(on_a_gpu, one_device, caplog):
  params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)}
  line = traced_path(caplog, params=params, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  assert line == f"optax_lamb.lamb: the pallas_triton path ({AUTO_BASIS['pallas_triton']})"


QUANTIZED = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32)}  # 16,384 elements: 8-bit
PARTIAL_BLOCKS = {"w": jax.ShapeDtypeStruct((64, 300), jnp.float32)}  # 8-bit, a partial last block


def test_8bit_moments_are_taken_by_the_kernels(on_a_gpu, one_device, caplog):
  line = traced_path(caplog, params=QUANTIZED, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  assert line == f"optax_lamb.lamb: the pallas_triton path ({AUTO_BASIS['pallas_triton']})"


def test_8bit_moments_with_partial_blocks_fall_back_to_xla(on_a_gpu, one_device, caplog):
  """A last axis that is not a multiple of 256: auto takes XLA and says why; an explicit request
  warns and runs on XLA (the registry's convention for every fallback)."""
  kwargs = dict(params=PARTIAL_BLOCKS, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  line = traced_path(caplog, **kwargs)
  assert line.startswith(
    "optax_lamb.lamb: the xla path (pallas_triton: 8-bit quantized moments of a leaf of shape "
    "(64, 300)"
  ), line
  with pytest.warns(UserWarning, match=r"8-bit quantized moments .* it runs on the xla path\."):
    traced_path(caplog, "pallas_triton", **kwargs)


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_xla_and_reference_are_taken_as_asked(on_a_gpu, one_device, caplog, implementation):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert traced_path(caplog, implementation) == ""  # nothing chose for them


def test_a_backend_object_is_taken_as_asked():
  params = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(3, 100)}
  backend = PallasTritonBackend(block_sizes=BlockSizes(block=64, sum_block=16), interpret=True)
  got_tx, want_tx = (optax_lamb.lamb(1e-2, implementation=i) for i in (backend, "xla"))
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    got = got_tx.update(params, got_tx.init(params), params)
  want = want_tx.update(params, want_tx.init(params), params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


@pytest.mark.parametrize("value", ["triton", None, object()])
def test_an_unknown_implementation_is_refused_when_built(value):
  with pytest.raises(ValueError, match=r"implementation must be one of .* got implementation="):
    optax_lamb.lamb(1e-2, implementation=value)


class Refusing:
  """A backend that cannot take any step (as the kernels with a leaf of 2^31 elements)."""

  name = "refusing"
  differentiable = True

  def auto_reason(self):
    return None

  def runs_interpreted(self):
    return False

  def unsupported_reason(self, plan, leaves):
    return "it refuses every step"

  def step(self, plan, leaves, *, apply):
    raise AssertionError("never called")


@pytest.mark.parametrize("wrappers", [{}, {"skip_nonfinite": True, "master_weights": True}])
def test_a_fallback_warning_points_at_the_callers_line(wrappers):
  params = {"w": jnp.ones((4, 3))}
  tx = optax_lamb.lamb(1e-2, implementation=Refusing(), **wrappers)
  state = tx.init(params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    line = sys._getframe().f_lineno + 1
    jax.jit(tx.update)(params, state, params)
  # skip_nonfinite traces the step twice (its two branches): the same warning, the same line
  said = {(w.filename, w.lineno, str(w.message)) for w in caught if "refuses" in str(w.message)}
  assert said == {
    (
      __file__,
      line,
      "optax_lamb.lamb(implementation='refusing'): refusing: it refuses every step; "
      "it runs on the xla path.",
    )
  }


def test_the_fused_apply_is_carried_by_lamb_on_a_backend_with_its_own_wrappers():
  """lamb's own skip and master weights are part of the planned step, so update_and_apply keeps
  its fused apply with them; a build-time loss scale and the chain of stages fall back."""
  for kwargs in ({}, {"skip_nonfinite": True}, {"master_weights": True}):
    assert callable(optax_lamb.lamb(1e-3, **kwargs).fused_apply), kwargs
  for kwargs in ({"grad_scale": 2.0}, {"implementation": "reference"}):
    assert not hasattr(optax_lamb.lamb(1e-3, **kwargs), "fused_apply"), kwargs
  for kwargs in ({"skip_nonfinite": True}, {"master_weights": True}, {"grad_scale": 2.0}):
    tx = optax_lamb.lamb(1e-3, **kwargs)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    got, _ = optax_lamb.update_and_apply(tx, params, state, params)
    updates, _ = tx.update(params, state, params)
    np.testing.assert_array_equal(got["w"], optax.apply_updates(params, updates)["w"])


def test_pallas_is_an_alias_of_pallas_triton():
  """The name before the rename still picks the Triton kernels; the old module still imports."""
  from optax_lamb.step import _registry

  assert _registry.backend("pallas") is _registry.backend("pallas_triton")
  sys.modules.pop("optax_lamb.backends.pallas", None)
  with pytest.warns(DeprecationWarning, match="optax_lamb.backends.pallas_triton"):
    from optax_lamb.backends.pallas import PallasBackend
  from optax_lamb.backends.pallas_triton import PallasTritonBackend

  assert PallasBackend is PallasTritonBackend


def test_the_fused_apply_survives_a_tree_map_of_the_transformation():
  """lamb's transformation is a pytree of (init, update) with its fused apply as static data:
  rebuilt by jax.tree.map (as flax's nnx.Optimizer does) it still carries it, and
  update_and_apply gives the same step."""
  tx = optax_lamb.lamb(1e-3)
  rebuilt = jax.tree.map(lambda f: f, tx)
  assert type(rebuilt) is type(tx) and rebuilt.fused_apply is tx.fused_apply
  params = {"w": jnp.ones((4, 3))}
  grads = {"w": jnp.full((4, 3), 0.5)}
  got = optax_lamb.update_and_apply(rebuilt, grads, rebuilt.init(params), params)
  want = optax_lamb.update_and_apply(tx, grads, tx.init(params), params)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))


def test_auto_without_a_gpu_imports_no_gpu_backend():
  """On a CPU, auto passes the GPU backends by without importing them (their import registers
  lowering rules in jax), and says why in its log line."""
  script = textwrap.dedent(
    """
    import logging, sys
    import jax, jax.numpy as jnp, optax_lamb
    logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=sys.stdout)
    params = {"w": jnp.arange(12.0).reshape(4, 3)}
    tx = optax_lamb.lamb(1e-2)
    tx.update(params, tx.init(params), params)
    gpu = ("optax_lamb.backends.pallas_triton", "optax_lamb.backends.pallas_mosaic_gpu")
    print("IMPORTED", [m for m in gpu if m in sys.modules])
    """
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
  )
  assert run.returncode == 0, run.stderr
  assert "IMPORTED []" in run.stdout.splitlines()
  logs = [line for line in run.stdout.splitlines() if line.startswith("LOG optax_lamb.lamb")]
  assert len(logs) == 1 and "pallas_triton: backend 'cpu': the kernels are for GPUs" in logs[0]
