"""The step benchmark's report: its JSON entries, the ratios, the table, the results file, the log.

The JSON format is read by committed results and `benchmarks/gpu_session.sh`: keys and their order
stay as they are.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import jax
import optax

from benchmarks import machine
from benchmarks.case import Settings
from benchmarks.implementations import LEARNING_RATE, WEIGHT_DECAY

# A single pass over float32 params: read g, m, v, p and write m, v, p once, 4 bytes each.
FLOOR_BYTES_PER_PARAM = 28
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def log(message: str) -> None:
  """Progress on stderr, so stdout holds only the table."""
  print(message, file=sys.stderr, flush=True)


def new_report(settings: Settings, quick: bool) -> dict:
  """The report's header (machine, versions, settings), with no case yet."""
  return {
    "device": machine.describe_device(),
    "device_kind": jax.devices()[0].device_kind,
    "device_count": jax.device_count(),
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "versions": machine.versions(),
    "commit": machine.commit(),
    "date": datetime.date.today().isoformat(),
    "quick": quick,
    "runs": settings.runs,
    "warmup": settings.warmup,
    "inner_steps": settings.inner_steps,
    "e2e_steps": settings.e2e_steps,
    "compile_threads": settings.compile_threads,
    "floor_bytes_per_param": FLOOR_BYTES_PER_PARAM,
    "hyperparameters": {"learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY},
    "load_average_start": [round(x, 2) for x in os.getloadavg()],
    "cases": {},
  }


def summarise(report: dict) -> None:
  """Add bytes/param and the ratios, from the bandwidth measured over the whole run."""
  gbps = report["bandwidth_gbps"]
  for case in report["cases"].values():
    base = case["results"].get("optax.lamb", {})
    for r in case["results"].values():
      if "error" in r:
        continue
      r["bytes_per_param"] = r["device_ms"] / 1e3 * gbps * 1e9 / case["params"]
      r["ratio_to_optax"] = r["device_ms"] / base["device_ms"] if "device_ms" in base else None
      r["e2e_ratio_to_optax"] = r["e2e_ms"] / base["e2e_ms"] if "e2e_ms" in base else None
      r["ratio_to_floor"] = r["bytes_per_param"] / FLOOR_BYTES_PER_PARAM


def _table_header(report: dict) -> list[str]:
  return [
    f"device: {report['device']}  backend: {report['backend']}  jax {report['jax']}  "
    f"optax {report['optax']}  load avg {report['load_average']}",
    f"bandwidth: {report['bandwidth_gbps']:.1f} GB/s (in-place scale of "
    f"{report['bandwidth_bytes'] / 2**20:.0f} MiB read + written, {report['bandwidth_repeats']} "
    f"per call, median of {len(report['bandwidth_times_ms'])})  runs per figure: {report['runs']}",
    f"device: {report['inner_steps']} steps per call (fori_loop); e2e: {report['e2e_steps']} "
    "calls, one block at the end (sync: a block after each)",
    f"{'case':12s} {'implementation':21s} {'device ms':>10s} {'e2e ms':>9s} {'e2e sync ms':>11s} "
    f"{'B/param':>8s} {'vs optax (device)':>17s} {'vs optax (e2e)':>14s} {'state buffers':>13s} "
    f"{'kernels':>7s}",
  ]


def _table_row(name: str, impl: str, r: dict) -> str:
  if "error" in r:
    return f"{name:12s} {impl:21s} error: {r['error'][:100]}"
  ratio = lambda x: "" if x is None else f"{x:.3f}"
  return (
    f"{name:12s} {impl:21s} {r['device_ms']:10.3f} {r['e2e_ms']:9.3f} {r['e2e_sync_ms']:11.3f} "
    f"{r['bytes_per_param']:8.1f} {ratio(r['ratio_to_optax']):>17s} "
    f"{ratio(r['e2e_ratio_to_optax']):>14s} {r['state_buffers']:13d} {r['kernels']:7d}"
  )


def format_table(report: dict) -> str:
  rows = [
    _table_row(name, impl, r)
    for name, case in report["cases"].items()
    for impl, r in case["results"].items()
  ]
  return "\n".join(_table_header(report) + rows)


def results_path(quick: bool) -> str:
  """benchmarks/results/<device>.json; a quick run gets its own file, never a full run's."""
  return os.path.join(RESULTS_DIR, machine.device_slug() + ("-quick" if quick else "") + ".json")


def write_json(report: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
