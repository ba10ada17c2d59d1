"""Tune the Pallas path's launch configuration on a GPU: device-only step time per variant.

Usage (on a GPU; without one the kernels would run in interpret mode):
  python -m benchmarks.pallas_tuning [--cases bert-large 1000x1000] [--json PATH]

For each tree and each `BlockSizes` variant it times K steps inside one jit
(`lax.fori_loop`, so host dispatch is out) of ``tx.update`` +
``optax.apply_updates`` and of ``optax_lamb.update_and_apply``, and counts the
kernels of one step in the compiled HLO. optax.lamb and the XLA path are timed
in the same run as the baselines. Prints a table; never asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import jax
import optax

import optax_lamb
from benchmarks import step as bench
from optax_lamb.backends.pallas import BlockSizes, PallasBackend

LR, WD = 1e-3, 0.01
VARIANTS = {
  "default": {},
  "pass2-all-xla": {"xla_pass2_min_size": 0},
  "pass2-all-kernel": {"xla_pass2_min_size": 2**40},
  "block-8192": {"block": 8192},
  "block-2048": {"block": 2048},
  "leaves-64": {"max_leaves_per_call": 64},
  "warps-4": {"num_warps": 4},
}


def device_ms(make_step, params, state, grads, inner, runs):
  """Median time per step of `inner` steps in one jitted, donated fori_loop call, and kernels."""

  def loop(params, state, grads):
    body = lambda i, carry: make_step(*carry, grads)
    return jax.lax.fori_loop(0, inner, body, (params, state))

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    compiled = jax.jit(loop, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  times = []
  for r in range(runs + 2):
    start = time.perf_counter()
    params, state = jax.block_until_ready(compiled(params, state, grads))
    if r >= 2:
      times.append((time.perf_counter() - start) / inner)
  hlo = compiled.as_text()  # the loop body is one step: its fusions and kernel calls
  fusions, customs = hlo.count(" fusion("), hlo.count(" custom-call(")
  return 1e3 * statistics.median(times), fusions, customs, (params, state)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", default=["bert-large", "1000x1000"])
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--inner", type=int, default=10)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  cases = {
    "bert-large": bench.bert_shapes(1024, 24, 4096),
    "bert-base": bench.bert_shapes(768, 12, 3072),
    "1000x1000": bench.many_leaves(1000, 1000),
    "bert-tiny": bench.bert_shapes(32, 1, 128, vocab=1000, positions=64),  # a smoke run
  }
  rows = []
  log = lambda *a: print(*a, file=sys.stderr, flush=True)
  for name in args.cases:
    params = bench.random_tree(cases[name], 0, 0.02)
    grads = bench.random_tree(cases[name], 1, 1e-3)
    baselines = {
      "optax.lamb": (optax.lamb(LR, weight_decay=WD), bench._update_then_apply),
      "xla.update": (
        optax_lamb.lamb(LR, weight_decay=WD, implementation="xla"),
        bench._update_then_apply,
      ),
      "xla.apply": (
        optax_lamb.lamb(LR, weight_decay=WD, implementation="xla"),
        bench._update_and_apply,
      ),
    }
    runs = [(impl, None, tx, make) for impl, (tx, make) in baselines.items()]
    for variant in args.variants:
      backend = PallasBackend(block_sizes=BlockSizes(**VARIANTS[variant]))
      tx = optax_lamb.lamb(LR, weight_decay=WD, implementation=backend)
      runs += [("pallas.update", variant, tx, bench._update_then_apply)]
      runs += [("pallas.apply", variant, tx, bench._update_and_apply)]
    for impl, variant, tx, make in runs:
      state = tx.init(params)
      try:
        ms, fusions, customs, (params, _) = device_ms(
          make(tx), params, state, grads, args.inner, args.runs
        )
      except Exception as e:  # record and go on
        log(f"{name} {impl} {variant}: {type(e).__name__}: {str(e)[:300]}")
        continue
      row = dict(case=name, impl=impl, variant=variant, ms=ms, fusions=fusions,
                 custom_calls=customs)  # fmt: skip
      log(row)
      rows.append(row)
    del params, grads
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(
    f"{'case':11s} {'implementation':14s} {'variant':17s} {'ms/step':>8s} {'fusions':>8s} {'custom':>7s}"
  )
  for r in rows:
    print(
      f"{r['case']:11s} {r['impl']:14s} {r['variant'] or '':17s} {r['ms']:8.3f} "
      f"{r['fusions']:8d} {r['custom_calls']:7d}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1
      )


if __name__ == "__main__":
  main()
