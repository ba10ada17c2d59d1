"""Time one LAMB step (update + apply) of optax.lamb and of optax_lamb's implementations.

Usage:
  python -m benchmarks.step [--skip-large] [--quick] [--json PATH] [--plot PATH]
  python benchmarks/step.py ...

Each step is jitted with params and state donated (arguments ordered
(params, state, grads), outputs (params, state)); inputs are random (never
zeros); warm-up runs are excluded; implementations run interleaved, round by
round, so they share the machine's load; the figure is the median. The same run
measures the memory bandwidth (a large in-place jitted scale: bytes read plus
written) and reports, per case and implementation, the median time, the
effective bytes moved per parameter (time x bandwidth / params), the ratio to
optax.lamb and the ratio to a single-pass floor of 28 bytes per parameter
(read g, m, v, p and write m, v, p once, float32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

if not __package__:  # run as a file: make the repository root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import optax

import optax_lamb

FLOOR_BYTES_PER_PARAM = 28
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01


# ----------------------------------------------------------------------------- trees


def bert_shapes(
  hidden: int, layers: int, ffn: int, vocab: int = 30522, positions: int = 512
) -> dict:
  """Leaf shapes of a BERT encoder with pooler (Devlin et al. 2019), as in Hugging Face's BertModel."""
  h = hidden
  tree = {
    "embeddings": {
      "word_embeddings": (vocab, h),
      "position_embeddings": (positions, h),
      "token_type_embeddings": (2, h),
      "LayerNorm": {"scale": (h,), "bias": (h,)},
    }
  }
  for i in range(layers):
    tree[f"layer_{i:02d}"] = {
      "attention": {
        **{name: {"kernel": (h, h), "bias": (h,)} for name in ("query", "key", "value")},
        "output": {"kernel": (h, h), "bias": (h,)},
        "LayerNorm": {"scale": (h,), "bias": (h,)},
      },
      "intermediate": {"kernel": (h, ffn), "bias": (ffn,)},
      "output": {"kernel": (ffn, h), "bias": (h,)},
      "LayerNorm": {"scale": (h,), "bias": (h,)},
    }
  tree["pooler"] = {"kernel": (h, h), "bias": (h,)}
  return tree


def many_leaves(count: int, size: int) -> dict:
  return {f"leaf_{i:04d}": (size,) for i in range(count)}


def _cases(quick: bool, skip_large: bool) -> dict[str, dict]:
  if quick:
    cases = {"bert-tiny": bert_shapes(32, 1, 128, vocab=1000, positions=64)}
    if not skip_large:
      cases["bert-mini"] = bert_shapes(64, 2, 256, vocab=2000, positions=64)
    cases["30x1000"] = many_leaves(30, 1000)
    cases["huge-256K"] = {"w": (512, 512)}
    return cases
  cases = {"bert-base": bert_shapes(768, 12, 3072)}
  if not skip_large:
    cases["bert-large"] = bert_shapes(1024, 24, 4096)
  cases["1000x1000"] = many_leaves(1000, 1000)
  cases["huge-64M"] = {"w": (8192, 8192)}
  return cases


def case_names(quick: bool = False, skip_large: bool = False) -> list[str]:
  """The cases a run times, in order."""
  return list(_cases(quick, skip_large))


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def random_tree(shapes: dict, seed: int, scale: float) -> dict:
  """Normal(0, scale) float32 leaves of the given shapes (never zeros)."""
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  make = jax.jit(
    lambda k, shape: scale * jax.random.normal(k, shape, jnp.float32), static_argnums=1
  )
  return jax.tree.unflatten(treedef, [make(k, s) for k, s in zip(keys, leaves, strict=True)])


# ------------------------------------------------------------------ implementations


def _update_then_apply(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _update_and_apply(tx):
  def step(params, state, grads):
    return optax_lamb.update_and_apply(tx, grads, state, params)

  return step


# name -> (state family, builder of the transformation, step from transformation). Implementations
# of one family share one state (our implementations all keep the stage chain's state layout).
IMPLEMENTATIONS: dict[str, tuple[str, Callable, Callable]] = {
  "optax.lamb": (
    "optax",
    lambda: optax.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    _update_then_apply,
  ),
  "optax_lamb.lamb": (
    "ours",
    lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    _update_then_apply,
  ),
  "update_and_apply": (
    "ours",
    lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    _update_and_apply,
  ),
  "reference-chain": (
    "ours",
    lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY, implementation="reference"),
    _update_then_apply,
  ),
  # The Pallas kernels (optax_lamb/_pallas.py): update + apply, and update_and_apply. Without a
  # GPU they run in interpret mode, so only with --quick there.
  "pallas.lamb": (
    "ours",
    lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY, implementation="pallas"),
    _update_then_apply,
  ),
  "pallas.apply": (
    "ours",
    lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY, implementation="pallas"),
    _update_and_apply,
  ),
}
DEFAULT_IMPLEMENTATIONS = ("optax.lamb", "optax_lamb.lamb", "update_and_apply")


# ------------------------------------------------------------------------- timing


def _timed(fn, *args):
  wall, cpu = time.perf_counter(), time.process_time()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - wall, time.process_time() - cpu


class Bandwidth:
  """Memory bandwidth from an in-place jitted scale of a large float32 array (read + write)."""

  def __init__(self, elements: int):
    self.x = jnp.full((elements,), 1.5, jnp.float32)
    self.bytes = 2 * self.x.nbytes
    self.fn = jax.jit(lambda x: x * 1.0000001, donate_argnums=0).lower(self.x).compile()
    self.times: list[float] = []

  def run(self, record: bool = True) -> None:
    self.x, wall, _ = _timed(self.fn, self.x)
    if record:
      self.times.append(wall)

  def gbps(self) -> float:
    return self.bytes / statistics.median(self.times) / 1e9


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    return {}
  return {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
  }


def run_case(
  name: str, shapes: dict, impls: list[str], runs: int, warmup: int, bw: Bandwidth, log
) -> dict:
  """Time every implementation on one tree, interleaved round by round."""
  leaves = jax.tree.leaves(shapes, is_leaf=_is_shape)
  n_params = sum(math.prod(s) for s in leaves)
  params = random_tree(shapes, 0, 0.02)
  grads = random_tree(shapes, 1, 1e-3)
  states: dict[str, object] = {}
  steps = {}
  result = {"params": n_params, "leaves": len(leaves), "results": {}}
  for impl in impls:
    family, make_tx, make_step = IMPLEMENTATIONS[impl]
    tx = make_tx()
    if family not in states:
      states[family] = tx.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # donated buffers XLA cannot reuse (none for these steps)
      compiled = (
        jax.jit(make_step(tx), donate_argnums=(0, 1)).lower(params, states[family], grads).compile()
      )
    steps[impl] = (family, compiled)
    result["results"][impl] = {"memory": _memory(compiled)}
  times = {impl: ([], []) for impl in impls}
  for round_ in range(warmup + runs):
    for impl in impls:
      family, compiled = steps[impl]
      (params, states[family]), wall, cpu = _timed(compiled, params, states[family], grads)
      if round_ >= warmup:
        times[impl][0].append(wall)
        times[impl][1].append(cpu)
    bw.run(record=round_ >= warmup)
  del params, states, grads
  for impl in impls:
    wall, cpu = times[impl]
    result["results"][impl].update(
      median_ms=1e3 * statistics.median(wall),
      min_ms=1e3 * min(wall),
      cpu_median_ms=1e3 * statistics.median(cpu),
      times_ms=[round(1e3 * t, 3) for t in wall],
    )
  log(f"  {name}: {n_params / 1e6:.1f}M params, {len(leaves)} leaves, timed")
  return result


def _summarise(report: dict) -> None:
  """Add bytes/param and the ratios, from the bandwidth measured over the whole run."""
  gbps = report["bandwidth_gbps"]
  for case in report["cases"].values():
    base = case["results"].get("optax.lamb", {}).get("median_ms")
    for r in case["results"].values():
      seconds = r["median_ms"] / 1e3
      r["bytes_per_param"] = seconds * gbps * 1e9 / case["params"]
      r["ratio_to_optax"] = r["median_ms"] / base if base else None
      r["ratio_to_floor"] = r["bytes_per_param"] / FLOOR_BYTES_PER_PARAM


def format_table(report: dict) -> str:
  lines = [
    f"device: {report['device']}  backend: {report['backend']}  jax {report['jax']}  "
    f"optax {report['optax']}  load avg {report['load_average']}",
    f"bandwidth: {report['bandwidth_gbps']:.1f} GB/s (in-place scale of "
    f"{report['bandwidth_bytes'] / 2**20:.0f} MiB read + written, median of "
    f"{len(report['bandwidth_times_ms'])})  runs per figure: {report['runs']}",
    f"{'case':12s} {'implementation':18s} {'median ms':>10s} {'cpu ms':>9s} {'B/param':>8s} "
    f"{'vs optax':>8s} {'vs 28B':>7s} {'temp MB':>8s}",
  ]
  for name, case in report["cases"].items():
    for impl, r in case["results"].items():
      ratio = "" if r["ratio_to_optax"] is None else f"{r['ratio_to_optax']:.3f}"
      temp = r["memory"].get("temp_bytes")
      lines.append(
        f"{name:12s} {impl:18s} {r['median_ms']:10.2f} {r['cpu_median_ms']:9.2f} "
        f"{r['bytes_per_param']:8.1f} {ratio:>8s} {r['ratio_to_floor']:7.2f} "
        f"{'' if temp is None else f'{temp / 1e6:8.1f}'}"
      )
  return "\n".join(lines)


def plot(report: dict, path: str) -> None:
  """Step time against parameter count, one line per implementation (log-log)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  impls = list(next(iter(report["cases"].values()))["results"])
  for impl, marker in zip(impls, ["o", "s", "^", "D", "v", "P"], strict=False):
    points = sorted(
      (c["params"], c["results"][impl]["median_ms"], name)
      for name, c in report["cases"].items()
      if impl in c["results"]
    )
    ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=impl, alpha=0.85)
  for name, case in report["cases"].items():
    ax.annotate(name, (case["params"], min(r["median_ms"] for r in case["results"].values())),
                textcoords="offset points", xytext=(4, -12), fontsize=8)  # fmt: skip
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("parameters")
  ax.set_ylabel("step time, ms (median)")
  ax.set_title(
    f"LAMB step, float32, params and state donated\n{report['device']}, jax {report['jax']}",
    fontsize=10,
  )
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def describe_device() -> str:
  device = jax.devices()[0]
  if device.platform != "cpu":
    return device.device_kind
  model = platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"CPU: {model}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small trees, a few runs (seconds)")
  parser.add_argument(
    "--skip-large",
    action="store_true",
    help="skip the BERT-large tree (it needs about 11 GB of memory)",
  )
  parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
  parser.add_argument("--plot", metavar="PATH", help="write a PNG of step time vs params")
  parser.add_argument("--runs", type=int, help="timed runs per figure (default 7, quick 3)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
  parser.add_argument("--cases", nargs="+", help="only these cases")
  parser.add_argument(
    "--impls",
    nargs="+",
    default=list(DEFAULT_IMPLEMENTATIONS),
    choices=list(IMPLEMENTATIONS),
    help="implementations to time (optax.lamb first gives the ratios)",
  )
  args = parser.parse_args(argv)
  if not args.quick and jax.default_backend() != "gpu":
    if any(impl.startswith("pallas") for impl in args.impls):
      parser.error("the pallas implementations run in interpret mode without a GPU: use --quick")
  runs = args.runs or (3 if args.quick else 7)
  cases = _cases(args.quick, args.skip_large)
  if args.cases:
    unknown = set(args.cases) - set(cases)
    if unknown:
      parser.error(f"unknown cases {sorted(unknown)}; choose from {list(cases)}")
    cases = {k: v for k, v in cases.items() if k in args.cases}
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  report = {
    "device": describe_device(),
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "date": datetime.date.today().isoformat(),
    "quick": args.quick,
    "runs": runs,
    "warmup": args.warmup,
    "floor_bytes_per_param": FLOOR_BYTES_PER_PARAM,
    "hyperparameters": {"learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY},
    "load_average_start": [round(x, 2) for x in os.getloadavg()],
    "cases": {},
  }
  bw = Bandwidth((1 << 20) if args.quick else (64 << 20))
  for _ in range(2):
    bw.run(record=False)
  log(f"timing {list(cases)} x {args.impls}, {runs} runs after {args.warmup} warm-up")
  for name, shapes in cases.items():
    report["cases"][name] = run_case(name, shapes, args.impls, runs, args.warmup, bw, log)
  report["bandwidth_gbps"] = bw.gbps()
  report["bandwidth_bytes"] = bw.bytes
  report["bandwidth_times_ms"] = [round(1e3 * t, 3) for t in bw.times]
  report["load_average"] = [round(x, 2) for x in os.getloadavg()]
  _summarise(report)
  print(format_table(report))
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  if args.plot:
    plot(report, args.plot)
  return report


if __name__ == "__main__":
  main()
