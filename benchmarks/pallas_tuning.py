"""Tune the Pallas path's launch configuration on a GPU: device-only step time per variant.

Usage (on a GPU; without one the kernels would run in interpret mode):
  python -m benchmarks.pallas_tuning [--cases bert-large 1000x1000] [--json PATH]

For each tree and each `BlockSizes` variant it times K steps inside one jit
(`lax.fori_loop`, so host dispatch is out; the step benchmark's device loop) of ``tx.update`` +
``optax.apply_updates`` and of ``optax_lamb.update_and_apply``, and counts the
fusions and custom calls of the compiled loop. optax.lamb and the XLA path are timed
in the same run as the baselines. Prints a table; never asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import jax

from benchmarks import hlo, timing, trees
from benchmarks.implementations import (
  IMPLEMENTATIONS,
  optax_lamb_builder,
  update_and_apply,
  update_then_apply,
)
from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend

VARIANTS = {
  "default": {},
  "pass2-all-xla": {"xla_pass2_min_size": 0},
  "pass2-all-kernel": {"xla_pass2_min_size": 2**40},
  "block-8192": {"block": 8192},
  "block-2048": {"block": 2048},
  "leaves-64": {"max_leaves_per_call": 64},
  "warps-4": {"num_warps": 4},
}
# Row name -> the step benchmark's implementation timed as a baseline.
BASELINES = {"optax.lamb": "optax.lamb", "xla.update": "xla.lamb", "xla.apply": "xla.apply"}
_WARMUP = 2


def device_ms(make_step, params, state, grads, inner, runs):
  """Median time per step of `inner` steps in one jitted, donated fori_loop call, and kernels."""
  compiled = timing.compile_device_loop(make_step, inner, (params, state, grads))
  times = []
  for r in range(runs + _WARMUP):
    (params, state), wall, _ = timing.timed(compiled, params, state, grads)
    if r >= _WARMUP:
      times.append(wall / inner)
  hlo_text = compiled.as_text()  # the loop body is one step: its fusions and kernel calls
  fusions, customs = hlo.count_opcode(hlo_text, "fusion"), hlo.count_opcode(hlo_text, "custom-call")
  return 1e3 * statistics.median(times), fusions, customs, (params, state)


def _runs(variants: list[str]) -> list[tuple[str, str | None, object, Callable]]:
  """(row name, variant, transformation, step from it): the baselines, then each variant's two."""
  runs = []
  for row, impl in BASELINES.items():
    _, make_tx, make_step = IMPLEMENTATIONS[impl]
    runs.append((row, None, make_tx(), make_step))
  for variant in variants:
    backend = PallasTritonBackend(block_sizes=BlockSizes(**VARIANTS[variant]))
    tx = optax_lamb_builder(implementation=backend)()
    runs.append(("pallas.update", variant, tx, update_then_apply))
    runs.append(("pallas.apply", variant, tx, update_and_apply))
  return runs


def _time_case(name: str, args: argparse.Namespace, log: Callable) -> list[dict]:
  """One row per run that worked on the tree `name`; a run that fails is logged and left out."""
  shapes = trees.NAMED_TREES[name]()
  params, grads = trees.random_params(shapes), trees.random_grads(shapes)
  rows = []
  for impl, variant, tx, make_step in _runs(args.variants):
    if not trees.alive(params):  # a failed run may have consumed the donated params
      params = trees.random_params(shapes)
    try:
      ms, fusions, customs, (params, _) = device_ms(
        make_step(tx), params, tx.init(params), grads, args.inner, args.runs
      )
    except Exception as e:  # record and go on
      log(f"{name} {impl} {variant}: {type(e).__name__}: {str(e)[:300]}")
      continue
    row = dict(case=name, impl=impl, variant=variant, ms=ms, fusions=fusions,
               custom_calls=customs)  # fmt: skip
    log(row)
    rows.append(row)
  trees.delete((params, grads))
  return rows


def _print_table(rows: list[dict]) -> None:
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(
    f"{'case':11s} {'implementation':14s} {'variant':17s} {'ms/step':>8s} {'fusions':>8s} {'custom':>7s}"
  )
  for r in rows:
    print(
      f"{r['case']:11s} {r['impl']:14s} {r['variant'] or '':17s} {r['ms']:8.3f} "
      f"{r['fusions']:8d} {r['custom_calls']:7d}"
    )


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--cases", nargs="+", default=["bert-large", "1000x1000"], choices=list(trees.NAMED_TREES)
  )
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--inner", type=int, default=10)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  log = lambda *a: print(*a, file=sys.stderr, flush=True)
  rows = [row for name in args.cases for row in _time_case(name, args, log)]
  _print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1
      )


if __name__ == "__main__":
  main()
