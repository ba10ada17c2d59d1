"""Runs as JSON records, and the machine and times of the sessions that trained them."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import time

import numpy as np


def _thin(xs, n=100):
  """At most ``n`` evenly spaced (index, value) pairs of a per-step series."""
  idx = np.unique(np.linspace(0, len(xs) - 1, min(n, len(xs))).round().astype(int))
  return idx.tolist(), [xs[i] for i in idx]


def _finite_or_none(xs):
  return [x if x is not None and math.isfinite(x) else None for x in xs]


def final(run: dict, split: str) -> float:
  """The last evaluation of ``split`` ("validation" or "test"); inf for a diverged run."""
  x = run[split][-1]
  return math.inf if x is None else x


def curve(run: dict, split: str, missing: float = math.nan) -> np.ndarray:
  """Every evaluation of ``split``, ``missing`` where the loss was not finite (stored as None)."""
  return np.array([missing if x is None else x for x in run[split]], float)


def record(res, factor: float, seed: int, group_seconds: float, keep_ratios: bool) -> dict:
  d = {
    "seed": seed,
    "family": res.family,
    "batch": res.batch,
    "factor": factor,
    "peak_lr": res.peak_lr,
    "steps": len(res.lr),
    "samples": res.samples,
    "validation": _finite_or_none(res.held_out),
    "test": _finite_or_none(res.test),
    "train": _finite_or_none(res.train),
    "phase_ends": res.phase_ends,
    "group_seconds": group_seconds,
  }
  d["lr_steps"], d["lr"] = _thin(res.lr)
  if res.test_per_sequence is not None:  # 5 decimals: far below the intervals' resolution
    d["test_per_sequence"] = [round(x, 5) for x in res.test_per_sequence]
  if keep_ratios and res.trust_ratios is not None:
    d["trust_ratios"] = {}
    for k, v in res.trust_ratios.items():
      d["trust_ratio_steps"], d["trust_ratios"][k] = _thin(v)
  if keep_ratios and res.relative_steps is not None:
    d["relative_steps"] = {}
    for k, v in res.relative_steps.items():
      d["relative_step_steps"], d["relative_steps"][k] = _thin(v)
  return d


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """``argparse``'s defaults in the help, but not where there is none (``None`` or ``False``)."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    if action.default in (None, False):
      return action.help
    return super()._get_help_string(action)


def run_resumable(argv, doc: str, epilog: str, choices, default_out, run, report) -> dict:
  """The command line of a job that resumes its results file: ``--preset`` (default
  `presets.default_preset` of ``choices``), ``--out``, ``--restart``. Calls ``run(preset, out, previous)``
  (previous: the results found at ``out``, or None), prints ``report(results)`` and returns them."""
  from optax_lamb_recipes import presets

  parser = argparse.ArgumentParser(
    description=doc.split("\n")[0],
    formatter_class=DefaultsHelpFormatter,
    epilog=epilog,
  )
  parser.add_argument(
    "--preset", choices=sorted(choices), default=presets.default_preset(choices), help="the preset"
  )
  parser.add_argument("--out", help="results JSON, resumed when it exists (default: per preset)")
  parser.add_argument("--restart", action="store_true", help="ignore an existing --out")
  args = parser.parse_args(argv)
  out = args.out or default_out[args.preset]
  previous = None
  if os.path.exists(out) and not args.restart:
    with open(out) as f:
      previous = json.load(f)
    done = f": {len(previous['runs'])} runs done" if "runs" in previous else ""
    print(f"resuming {out}{done}")
  results = run(args.preset, out, previous)
  print(report(results))
  print(f"\nresults: {out}")
  return results


def input_results(path: str, make_ci) -> dict:
  """The results a job builds on: the committed JSON at ``path``, or ``make_ci()`` (the ci
  presets, which make theirs in seconds) where ``path`` is empty."""
  if not path:
    return make_ci()
  with open(path) as f:
    return json.load(f)


def write_json(results: dict, path: str) -> None:
  """Replace ``path`` in one step, so that a killed run leaves the previous file whole."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f)
  os.replace(tmp, path)


def compute_used(results: dict) -> str:
  """``N min wall and M min CPU in K session(s) on C CPUs (cpu), first date[ to last date]``."""
  sessions = results["sessions"]
  m = sessions[-1]["machine"]
  dates = sorted({s["date"] for s in sessions if s.get("date")})
  when = f", {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "") if dates else ""
  return (
    f"{results['wall_seconds'] / 60:.0f} min wall and {results['cpu_seconds'] / 60:.0f} min CPU "
    f"in {len(sessions)} session(s) on {m['cpus']} CPUs ({m['cpu']}){when}"
  )


def session(start: float) -> dict:
  """Wall and CPU time of this process since ``start``, and the machine."""
  return {
    "wall_seconds": time.perf_counter() - start,
    # CPU time of this process: with other jobs on the machine, wall time overstates the cost
    "cpu_seconds": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
    "machine": machine(),
    "date": datetime.date.today().isoformat(),
  }


def machine() -> dict:
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {
    "platform": platform.platform(),
    "cpu": cpu,
    "cpus": os.cpu_count(),
    "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
  }
