"""This checkout's LAMB step against an earlier commit's, in the same run: compile time and step time.

    python -m benchmarks.versus --ref a0c5ed4 [--configurations ...] [--rounds 2] [--json PATH]

Both packages are called by the same benchmark code (this checkout's `benchmarks`): the earlier
commit's `optax_lamb/` is extracted with `git archive` into a temporary folder and put first on
`PYTHONPATH` of a worker process; this checkout's runs in another. Every measurement is a fresh
process, and the two versions alternate measurement by measurement, so a shared machine's changing
load falls on both alike: only the same run's ratios mean anything. Per configuration of
`benchmarks.compile_time.CONFIGURATIONS` and version: trace, lower and compile seconds of the
donated step (`compile_time.measure`, caches cleared), then the step's wall time (one jitted,
donated call per step, blocked on, median over `--steps` calls after two warm-up calls) on the
`--tree` (BERT-base by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

if not __package__:  # run as a file: import from the repository root, not from benchmarks/
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = "HEAD (working tree)"


def _worker(tree: str, config_name: str, steps: int) -> dict:
  """One measurement in this process: compile stages, then the step's median wall time."""
  import jax

  import optax_lamb
  from benchmarks import compile_time, trees
  from benchmarks.implementations import update_and_apply, update_then_apply

  shapes = trees.NAMED_TREES[tree]()
  config = compile_time.CONFIGURATIONS[config_name]
  out = compile_time.measure(shapes, config)
  tx = config.make()
  params = trees.random_params(shapes)
  grads = trees.random_grads(shapes)
  state = tx.init(params)
  form = update_and_apply if config.fused else update_then_apply
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # donated buffers the backend cannot reuse
    step = jax.jit(form(tx), donate_argnums=(0, 1))
    times = []
    for i in range(steps + 2):
      t0 = time.perf_counter()
      params, state = jax.block_until_ready(step(params, state, grads))
      if i >= 2:
        times.append(time.perf_counter() - t0)
  out["step_ms"] = 1e3 * statistics.median(times)
  out["step_ms_all"] = [round(1e3 * t, 2) for t in times]
  out["package"] = os.path.dirname(optax_lamb.__file__)
  return out


def _extract(ref: str, into: str) -> str:
  """The package of commit `ref`, extracted into `into`; the folder to put on PYTHONPATH."""
  archive = subprocess.run(
    ["git", "archive", ref, "optax_lamb"], cwd=ROOT, check=True, capture_output=True
  ).stdout
  subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
  return into


def _measure(path: str, tree: str, config: str, steps: int) -> dict:
  """One worker process with `path` first on its import path."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, ROOT]))
  cmd = [sys.executable, "-m", "benchmarks.versus", "--worker", config, "--tree", tree]
  done = subprocess.run(
    [*cmd, "--steps", str(steps)], cwd=ROOT, env=env, check=True, capture_output=True, text=True
  )
  return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
  keys = ("trace_s", "lower_s", "compile_s", "total_s", "step_ms")
  out: dict = {k: statistics.median(r[k] for r in runs) for k in keys}
  out["rounds"] = {k: [round(r[k], 3) for r in runs] for k in keys}
  return out


def compare(
  ref: str, configs: list[str], tree: str, rounds: int, steps: int, done: Callable = print
) -> dict:
  """Both versions' figures per configuration, and the ratios (this checkout over `ref`);
  `done(results)` after each round (a stopped run keeps the rounds it finished)."""
  runs: dict = {c: {ref: [], THIS: []} for c in configs}
  out: dict = {}
  with tempfile.TemporaryDirectory() as tmp:
    paths = {ref: _extract(ref, tmp), THIS: ROOT}
    for round_ in range(rounds):
      order = [ref, THIS] if round_ % 2 == 0 else [THIS, ref]  # neither always goes first
      for config in configs:
        for version in order:
          r = _measure(paths[version], tree, config, steps)
          runs[config][version].append(r)
          print(
            f"round {round_} {config:45s} {version:20s} total {r['total_s']:.2f} s "
            f"step {r['step_ms']:.1f} ms",
            flush=True,
          )
      out = {config: _compared(by_version, ref) for config, by_version in runs.items()}
      done(out)
  return out


def _compared(by_version: dict, ref: str) -> dict:
  old, new = _summary(by_version[ref]), _summary(by_version[THIS])
  ratio = {k: new[k] / old[k] for k in ("total_s", "compile_s", "trace_s", "step_ms")}
  return {ref: old, THIS: new, "ratio": ratio}


def table(results: dict, ref: str) -> str:
  """Markdown: per configuration, compile total and step time of both versions, and the ratios."""
  rows = [
    f"| configuration | compile s, {ref} | compile s, HEAD | ratio | step ms, {ref} | "
    "step ms, HEAD | ratio |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, r in results.items():
    old, new, ratio = r[ref], r[THIS], r["ratio"]
    rows.append(
      f"| `{name}` | {old['total_s']:.1f} | {new['total_s']:.1f} | {ratio['total_s']:.2f} | "
      f"{old['step_ms']:.0f} | {new['step_ms']:.0f} | {ratio['step_ms']:.2f} |"
    )
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
  from benchmarks import compile_time, machine

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ref", default="a0c5ed4", help="the earlier commit")
  parser.add_argument("--configurations", nargs="+", default=list(compile_time.CONFIGURATIONS))
  parser.add_argument("--tree", default="bert-base")
  parser.add_argument("--rounds", type=int, default=2, help="rounds; figures are medians")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
  parser.add_argument("--json", help="where to write the results")
  parser.add_argument("--worker", metavar="CONFIGURATION", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    result = _worker(args.tree, args.worker, args.steps)
    print(json.dumps(result))
    return result
  unknown = set(args.configurations) - set(compile_time.CONFIGURATIONS)
  if unknown:
    parser.error(f"unknown configurations: {sorted(unknown)}")
  results = {
    "device": machine.describe_device(),
    "commit": machine.commit(),
    "ref": args.ref,
    "versions": machine.versions(),
    "date": datetime.date.today().isoformat(),
    "tree": args.tree,
    "steps": args.steps,
  }

  def done(compared: dict) -> None:
    results["configurations"] = compared
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f, indent=1)

  compare(args.ref, args.configurations, args.tree, args.rounds, args.steps, done)
  print(table(results["configurations"], args.ref))
  return results


if __name__ == "__main__":
  main()
