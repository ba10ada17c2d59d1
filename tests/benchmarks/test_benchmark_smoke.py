"""The benchmark script runs end to end in --quick mode and writes a complete JSON (no timing checks)."""

import importlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _benchmarks_module(name: str):
  """`benchmarks.<name>`, imported from the repository root (benchmarks/ is not installed)."""
  sys.path.insert(0, ROOT)
  try:
    return importlib.import_module(f"benchmarks.{name}")
  finally:
    sys.path.remove(ROOT)


def test_quick_benchmark_writes_every_case_and_implementation(tmp_path):
  trees = _benchmarks_module("trees")
  implementations = _benchmarks_module("implementations")
  out = tmp_path / "quick.json"
  env = dict(os.environ)
  # The benchmark runs on the default device setup, not the tests' 8 host devices.
  flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.step",
      "--quick",
      "--runs",
      "2",
      "--warmup",
      "1",
      "--compile-threads",  # executables compiled two at a time, as gpu_session.sh does with 8
      "2",
      "--json",
      str(out),
    ],
    cwd=ROOT,
    env=env,
    check=True,
    timeout=600,
  )
  report = json.loads(out.read_text())
  assert list(report["cases"]) == trees.case_names(quick=True)
  assert report["bandwidth_gbps"] > 0
  assert report["device_kind"] and report["versions"]["jax"] and report["versions"]["optax"]
  head = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
  )
  assert report["commit"] == (head.stdout.strip() or "unknown")  # which code the figures are of
  assert report["inner_steps"] > 1 and report["e2e_steps"] > 1 and report["compile_threads"] == 2
  for name, case in report["cases"].items():
    assert case["params"] > 0 and case["leaves"] > 0, name
    assert list(case["results"]) == list(implementations.DEFAULT_IMPLEMENTATIONS), name
    for impl, r in case["results"].items():
      where = (name, impl)
      assert "error" not in r, where
      assert r["device_ms"] > 0 and r["median_ms"] == r["device_ms"], where
      assert r["e2e_ms"] > 0 and r["e2e_sync_ms"] > 0, where
      for key in ("times_ms", "e2e_times_ms", "e2e_sync_times_ms"):
        assert len(r[key]) == 2 and all(t > 0 for t in r[key]), (*where, key)
      assert r["compile_s"] > 0 and r["loop_compile_s"] > 0, where
      for key in ("state_buffers", "input_buffers", "kernels"):
        assert isinstance(r[key], int) and r[key] > 0, (*where, key)
      # params and grads hold one buffer per leaf each, besides the state's
      assert r["input_buffers"] == r["state_buffers"] + 2 * case["leaves"], where
      assert r["bytes_per_param"] > 0, where
      assert r["ratio_to_optax"] > 0 and r["e2e_ratio_to_optax"] > 0, where


def test_kernel_count_reads_the_entry_computation_only():
  hlo_module = _benchmarks_module("hlo")
  hlo = """HloModule jit_step, is_scheduled=true

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %multiply.0 = f32[8]{0} multiply(%param_0, %param_0)
}

ENTRY %main.5 (p: f32[8], g: f32[8]) -> (f32[8], f32[]) {
  %p = f32[8]{0} parameter(0), metadata={op_name="params[\\'w\\']"}
  %g = f32[8]{0} parameter(1)
  %constant.1 = f32[] constant(0)
  %fusion = f32[8]{0} fusion(%p, %g), kind=kLoop, calls=%fused_computation
  %bitcast.2 = f32[2,4]{1,0} bitcast(%fusion)
  %reduce.3 = f32[] reduce(%bitcast.2, %constant.1), dimensions={0,1}, to_apply=%add
  %copy.4 = f32[8]{0} copy(%p)
  %gte = f32[8]{0} get-tuple-element(%t), index=0
  ROOT %tuple = (f32[8]{0}, f32[]) tuple(%fusion, %reduce.3)
}
"""
  assert hlo_module.count_kernels(hlo) == 3  # fusion, reduce, copy


def test_results_file_is_named_after_the_device():
  machine = _benchmarks_module("machine")
  assert machine.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
  assert machine.slugify("NVIDIA H200") == "nvidia-h200"


def _raise_in_callback(_):
  raise RuntimeError("deliberate failure while running")


def test_failing_implementations_are_recorded_and_the_others_still_timed(monkeypatch):
  import jax

  case = _benchmarks_module("case")
  implementations = _benchmarks_module("implementations")
  bandwidth = _benchmarks_module("bandwidth")

  def fails_to_compile(tx):
    def step(params, state, grads):
      raise ValueError("deliberate failure while tracing")

    return step

  def fails_at_run(tx):  # after its donated params and state are consumed
    step = implementations.update_then_apply(tx)

    def failing(params, state, grads):
      jax.debug.callback(_raise_in_callback, grads["w"])
      return step(params, state, grads)

    return failing

  ours = implementations.IMPLEMENTATIONS["optax_lamb.lamb"][1]
  monkeypatch.setitem(
    implementations.IMPLEMENTATIONS, "fails-to-compile", ("x", ours, fails_to_compile)
  )
  # The same state family as optax_lamb.lamb: their shared state must be rebuilt for it.
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "fails-at-run", ("ours", ours, fails_at_run))
  impls = ["fails-to-compile", "fails-at-run", "optax_lamb.lamb", "optax.lamb"]
  settings = case.Settings(impls, runs=2, warmup=1, inner_steps=2, e2e_steps=2)
  shapes = {"w": (16, 4), "b": (4,)}
  result = case.run_case("tiny", shapes, settings, bandwidth.Bandwidth(1024, 2), lambda _: None)
  results = result["results"]
  assert list(results) == impls
  assert results["fails-to-compile"] == {"error": "ValueError: deliberate failure while tracing"}
  assert set(results["fails-at-run"]) == {"error"}
  for impl in ("optax_lamb.lamb", "optax.lamb"):
    assert "error" not in results[impl], impl
    assert len(results[impl]["times_ms"]) == 2 and results[impl]["device_ms"] > 0, impl


def test_versus_compares_an_earlier_commit_with_this_checkout(tmp_path):
  """benchmarks.versus measures both packages (each from its own folder) and records the ratios
  of their medians; HEAD against itself here (the figures, not their values, are checked)."""
  versus = _benchmarks_module("versus")
  out = tmp_path / "versus.json"
  args = ["--ref", "HEAD", "--tree", "bert-tiny", "--configurations", "lamb", "--rounds", "1"]
  versus.main([*args, "--steps", "1", "--json", str(out)])
  results = json.loads(out.read_text())["configurations"]["lamb"]
  old, new = results["HEAD"], results[versus.THIS]
  assert old["rounds"]["step_ms"] and new["rounds"]["step_ms"]
  for key, ratio in results["ratio"].items():
    assert ratio == pytest.approx(new[key] / old[key])
