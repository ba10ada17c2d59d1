"""Multi-process data parallelism: two processes on 127.0.0.1, two CPU devices each.

The test starts two copies of `mp_worker.py` that join one jax.distributed
cluster (coordinator on a free local port, CPU collectives over gloo), train
the `dp_problem` MLP on the cluster's 4 devices (jit with NamedSharding, and
shard_map FSDP with a per-leaf axis_name) and save their final parameters.
Both processes must end with the single-process, single-device parameters.
Children are bounded in time and killed if anything goes wrong.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import dp_problem as prob
import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # processes of their own: CI runs them (pytest -m slow)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NUM_PROCESSES = 2
LOCAL_DEVICES = 2
TIMEOUT_S = 150
ATOL = 2e-5


def load_example():
  """examples/data_parallel.py as a module (for its train function)."""
  spec = importlib.util.spec_from_file_location(
    "data_parallel_example", os.path.join(ROOT, "examples", "data_parallel.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(local_devices: int) -> dict[str, str]:
  """The parent's environment with its own device count (not conftest's 8) and the repo on the path."""
  env = dict(os.environ)
  flags = [
    f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
  ]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
  return env


def run_cluster(
  tmp_path, script_args, num_processes=NUM_PROCESSES, timeout_s=TIMEOUT_S, launch=None, procs=None
):
  """Start the workers (`launch`: which process ids, default all), wait for them (bounded), and
  kill every one still running on a failure or timeout. Returns their outputs."""
  coordinator = f"127.0.0.1:{free_port()}"
  env = child_env(LOCAL_DEVICES)
  procs = [] if procs is None else procs
  logs = []
  try:
    for pid in range(num_processes) if launch is None else launch:
      log = open(tmp_path / f"worker{pid}.log", "w+")
      logs.append(log)
      cmd = [
        sys.executable,
        *script_args(pid),
        "--coordinator",
        coordinator,
        "--num-processes",
        str(num_processes),
        "--process-id",
        str(pid),
      ]
      procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    for proc in procs:
      proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      if proc.returncode != 0:
        break
  except subprocess.TimeoutExpired:
    pass
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
      log.close()
  codes = [proc.returncode for proc in procs]
  if any(code != 0 for code in codes):
    report = "\n".join(
      f"--- worker {i} (exit {c}) ---\n{o[-3000:]}"
      for i, (c, o) in enumerate(zip(codes, outputs, strict=True))
    )
    pytest.fail(f"workers failed or timed out after {timeout_s}s: exit codes {codes}\n{report}")
  return outputs


def test_two_processes_match_single_device(tmp_path):
  outs = [tmp_path / f"params{pid}.npz" for pid in range(NUM_PROCESSES)]
  run_cluster(tmp_path, lambda pid: [os.path.join(HERE, "mp_worker.py"), "--out", str(outs[pid])])
  want, _ = prob.reference_run()
  for pid, out in enumerate(outs):
    got = dict(np.load(out))
    assert int(got["process_count"]) == NUM_PROCESSES
    assert int(got["local_device_count"]) == LOCAL_DEVICES
    assert int(got["device_count"]) == NUM_PROCESSES * LOCAL_DEVICES
    for mode in ("jit", "shard_map"):
      params = {k: got[f"{mode}/{k}"] for k in prob.LEAVES}
      diff = prob.max_abs_diff(params, want)
      print(f"\nprocess {pid}, {mode}: max |params - single-device params| = {diff:.3g}")
      assert diff < ATOL, (pid, mode, diff)


def test_example_two_processes_match_one_device(tmp_path):
  """examples/data_parallel.py launched as 2 processes x 2 devices ends where 1 device does

  (the single-device run is the example's train function in this process, on one device).
  """
  pytest.importorskip("flax")
  example = os.path.join(ROOT, "examples", "data_parallel.py")
  common = ["--steps", "8", "--log-every", "4", "--shard-params"]
  outputs = run_cluster(
    tmp_path, lambda pid: [example, *common, "--save", str(tmp_path / "two.npz")]
  )
  assert "2 process(es), 4 devices (2 local)" in outputs[0]
  assert "trust ratios:" in outputs[0]
  example_module = load_example()
  want = example_module.train(example_module.parse_args(common), devices=jax.devices()[:1])
  got = dict(np.load(tmp_path / "two.npz"))
  assert sorted(want) == sorted(got)
  diff = prob.max_abs_diff(got, want)
  print(f"\nexample, 2 processes vs 1 device: max |params difference| = {diff:.3g}")
  assert diff < ATOL


def test_a_missing_peer_times_out_and_is_killed(tmp_path):
  """Only process 0 of 2 starts: it waits for its peer; the bound kills it and reports."""
  procs = []
  with pytest.raises(pytest.fail.Exception, match="timed out"):
    run_cluster(
      tmp_path,
      lambda pid: [os.path.join(HERE, "mp_worker.py"), "--out", str(tmp_path / "x.npz")],
      timeout_s=5,
      launch=[0],
      procs=procs,
    )
  assert len(procs) == 1 and procs[0].poll() is not None  # killed, not left running
  assert not (tmp_path / "x.npz").exists()
