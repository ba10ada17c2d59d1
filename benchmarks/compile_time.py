"""Compile time of one donated LAMB step: trace, lower and XLA compile, each apart.

    python -m benchmarks.compile_time [--trees bert-base] [--repeats 3] [--json PATH]

For each configuration (`CONFIGURATIONS`: optax.lamb, optax_lamb.lamb and its options, a compat
constructor) and step form (``tx.update`` + ``optax.apply_updates`` in one jit, or
``optax_lamb.update_and_apply``) the step ``(params, state, grads) -> (params, state)`` is
jitted with all three donated, on abstract arrays (nothing is allocated), and timed in three
stages: ``jit(step).trace`` (Python and jax building the jaxpr), ``.lower()`` (StableHLO) and
``.compile()`` (the backend's compiler). ``jax.clear_caches()`` runs before each, so every
measurement traces and compiles from nothing. Configurations run interleaved, round by round (a
shared machine's load falls on all of them alike); each figure is the median over the rounds, and
the ratios to optax.lamb are of the medians. Also recorded: the jaxpr's equations (sub-jaxprs
included) and the StableHLO module's operations. The device is whatever jax's default backend is
(a CPU or an accelerator); the JSON (`benchmarks/results/compile-<device>.json` by default) is what
docs/benchmarks.md renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

if not __package__:  # run as a file: import from the repository root, not from benchmarks/
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.extend
import jax.numpy as jnp
import optax

import optax_lamb
from benchmarks import machine, trees
from benchmarks.implementations import update_and_apply, update_then_apply

LR = 1e-3
WD = 0.01
REFERENCE = "optax.lamb"
STAGES = ("trace_s", "lower_s", "compile_s")


@dataclasses.dataclass(frozen=True)
class Configuration:
  """One optimizer configuration: how to build it, and whether the step fuses the apply."""

  make: Callable[[], optax.GradientTransformation]
  fused: bool = False  # optax_lamb.update_and_apply instead of update + apply_updates


def _lamb(**options: Any) -> Callable[[], optax.GradientTransformation]:
  return lambda: optax_lamb.lamb(LR, weight_decay=WD, **options)


_OPTIONS: dict[str, dict[str, Any]] = {
  "lamb": {},
  "lamb, skip_nonfinite, max_grad_norm": {"skip_nonfinite": True, "max_grad_norm": 1.0},
  "lamb, bfloat16 mu": {"mu_dtype": jnp.bfloat16},
  "lamb, 8-bit moments": {"mu_dtype": jnp.int8, "nu_dtype": jnp.uint8},
}


def _configurations() -> dict[str, Configuration]:
  out = {REFERENCE: Configuration(lambda: optax.lamb(LR, weight_decay=WD))}
  for name, options in _OPTIONS.items():
    out[name] = Configuration(_lamb(**options))
    out[f"{name}, update_and_apply"] = Configuration(_lamb(**options), fused=True)
  apex = lambda: optax_lamb.compat.apex_fused_lamb(LR, weight_decay=WD)
  out["compat.apex_fused_lamb"] = Configuration(apex)
  out["compat.apex_fused_lamb, update_and_apply"] = Configuration(apex, fused=True)
  return out


CONFIGURATIONS = _configurations()


def equation_count(jaxpr: Any) -> int:
  """Equations of a jaxpr, those of its sub-jaxprs (branches, loop bodies, calls) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += equation_count(sub)
  return n


def stablehlo_op_count(text: str) -> int:
  """Operations in a StableHLO module's text (one per `stablehlo.`/`func.`/... op name)."""
  return len(re.findall(r"^\s*(?:%\S+ = )?\"?(?:stablehlo|chlo|func|mhlo|sdy)\.", text, re.M))


def measure(shapes: dict, config: Configuration) -> dict:
  """Seconds of trace, lower and compile of the donated step on `shapes` (float32), from
  cleared caches, and the sizes of its jaxpr and StableHLO module."""
  params = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=trees._is_shape
  )
  tx = config.make()
  state = jax.eval_shape(tx.init, params)
  form = update_and_apply if config.fused else update_then_apply
  jax.clear_caches()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # donated buffers the backend cannot reuse
    step = jax.jit(form(tx), donate_argnums=(0, 1, 2))
    t0 = time.perf_counter()
    traced = step.trace(params, state, params)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
  return {
    "trace_s": t1 - t0,
    "lower_s": t2 - t1,
    "compile_s": t3 - t2,
    "total_s": t3 - t0,
    "jaxpr_equations": equation_count(traced.jaxpr.jaxpr),
    "stablehlo_ops": stablehlo_op_count(lowered.as_text()),
  }


def summarize(runs: list[dict]) -> dict:
  """Medians over the rounds of each figure, and the rounds themselves."""
  keys = (*STAGES, "total_s")
  out: dict = {k: statistics.median(r[k] for r in runs) for k in keys}
  out["rounds"] = {k: [round(r[k], 3) for r in runs] for k in keys}
  out["jaxpr_equations"] = runs[-1]["jaxpr_equations"]
  out["stablehlo_ops"] = runs[-1]["stablehlo_ops"]
  return out


def with_ratios(measured: dict) -> dict:
  """Each configuration's medians over optax.lamb's (total and per stage), where measured."""
  ref = measured.get(REFERENCE)
  if ref is None:
    return measured
  for r in measured.values():
    r["ratio"] = {k: r[k] / ref[k] for k in (*STAGES, "total_s")}
  return measured


def table(results: dict, tree: str = "bert-base") -> str:
  """Markdown: per configuration, the median seconds of each stage, the total, its ratio."""
  rows = [
    "| configuration | trace s | lower s | compile s | total s | x optax.lamb | jaxpr eqns | "
    "StableHLO ops |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, r in results["trees"][tree].items():
    ratio = r.get("ratio", {}).get("total_s")
    cells = [f"{r[k]:.2f}" for k in (*STAGES, "total_s")]
    cells += ["" if ratio is None else f"{ratio:.2f}x", f"{r['jaxpr_equations']:,}"]
    cells += [f"{r['stablehlo_ops']:,}"]
    rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def default_path() -> str:
  return os.path.join("benchmarks", "results", f"compile-{machine.device_slug()}.json")


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--trees", nargs="+", default=["bert-base"])
  parser.add_argument("--configurations", nargs="+", default=list(CONFIGURATIONS))
  parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians")
  parser.add_argument(
    "--json", help="where to write the results (default: results/compile-<device>)"
  )
  args = parser.parse_args(argv)
  unknown = set(args.configurations) - set(CONFIGURATIONS)
  if unknown:
    parser.error(f"unknown configurations: {sorted(unknown)}")
  path = args.json or default_path()
  results: dict = {
    "device": machine.describe_device(),
    "commit": machine.commit(),
    "versions": machine.versions(),
    "date": datetime.date.today().isoformat(),
    "repeats": args.repeats,
    "trees": {},
  }
  for tree in args.trees:
    shapes = trees.NAMED_TREES[tree]()
    runs: dict[str, list[dict]] = {c: [] for c in args.configurations}
    for round_ in range(args.repeats):  # interleaved: every configuration once per round
      for config in args.configurations:
        runs[config].append(measure(shapes, CONFIGURATIONS[config]))
        r = runs[config][-1]
        figures = " ".join(f"{k} {r[k]:.2f}" for k in (*STAGES, "total_s"))
        print(f"{tree} round {round_} {config:45s} {figures}", flush=True)
      results["trees"][tree] = with_ratios({c: summarize(v) for c, v in runs.items() if v})
      _write(results, path)  # as it goes: a stopped run keeps the rounds it finished
    print(table(results, tree))
  return results


def _write(results: dict, path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
