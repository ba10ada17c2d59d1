"""The benchmark script runs end to end in --quick mode and writes a complete JSON (no timing checks)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_benchmark_writes_every_case_and_implementation(tmp_path):
  sys.path.insert(0, ROOT)
  try:
    from benchmarks import step
  finally:
    sys.path.remove(ROOT)
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
      "--json",
      str(out),
    ],
    cwd=ROOT,
    env=env,
    check=True,
    timeout=600,
  )
  report = json.loads(out.read_text())
  assert list(report["cases"]) == step.case_names(quick=True)
  assert report["bandwidth_gbps"] > 0
  for name, case in report["cases"].items():
    assert case["params"] > 0 and case["leaves"] > 0, name
    assert list(case["results"]) == list(step.DEFAULT_IMPLEMENTATIONS), name
    for impl, r in case["results"].items():
      assert r["median_ms"] > 0 and all(t > 0 for t in r["times_ms"]), (name, impl)
      assert len(r["times_ms"]) == 2
      assert r["bytes_per_param"] > 0 and r["ratio_to_optax"] > 0, (name, impl)
