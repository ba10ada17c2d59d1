"""Time one LAMB step (update + apply) of optax.lamb and of optax_lamb's implementations.

Usage:
  python -m benchmarks.step [--quick] [--skip-large] [--cases ...] [--impls ...]
                            [--inner-steps K] [--e2e-steps N] [--json PATH | --json-auto]
  python benchmarks/step.py ...

Two figures per case and implementation, measured in the same run:

- device: K steps inside one jitted call (a `fori_loop` over (params, state), grads fixed,
  params and state donated); per step = time of the call / K. Host dispatch is then
  negligible, so this is the time the device spends on a step.
- end to end (e2e): one jitted call per step, as a training loop makes it (params and state
  donated, arguments ordered (params, state, grads), outputs (params, state)), N calls back to
  back and `block_until_ready` after the last; per step = total / N. This adds what the host
  does per step (dispatch, one launch per kernel), which can dominate a step of a few ms on a
  GPU. `e2e sync` blocks after every call, so nothing of the host's work overlaps the device's.

Inputs are random (never zeros); warm-up runs are excluded; implementations run interleaved,
round by round, so they share the machine's load; each figure is the median over runs. The same
run measures the memory bandwidth (a large in-place jitted scale, bytes read plus written, K
times in one call as the device figure's steps) and
reports, per case and implementation, the effective bytes moved per parameter (device time x
bandwidth / params), the ratios to optax.lamb (device and e2e), the ratio to a single-pass floor
of 28 bytes per parameter (read g, m, v, p and write m, v, p once, float32), the number of buffers
in the state and an approximate kernel count of the compiled step. An implementation that fails
is recorded with its error; the others go on.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
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
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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


def _lamb(**options) -> Callable:
  return lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY, **options)


BF16_MOMENTS = {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16}

# name -> (state family, builder of the transformation, step from transformation). Implementations
# of one family share one state, so the state they advance stays realistic without one copy each;
# run_case also checks that their state layouts match (a family whose layouts differ, as the
# bfloat16 moments do, gets one state per layout).
IMPLEMENTATIONS: dict[str, tuple[str, Callable, Callable]] = {
  "optax.lamb": (
    "optax",
    lambda: optax.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    _update_then_apply,
  ),
  # implementation="auto": what a user gets without choosing.
  "optax_lamb.lamb": ("ours", _lamb(), _update_then_apply),
  "update_and_apply": ("ours", _lamb(), _update_and_apply),
  "reference-chain": ("ours", _lamb(implementation="reference"), _update_then_apply),
  "xla.lamb": ("ours", _lamb(implementation="xla"), _update_then_apply),
  "xla.apply": ("ours", _lamb(implementation="xla"), _update_and_apply),
  # The Pallas kernels: update + apply, and update_and_apply. Without a GPU they run in
  # interpret mode, so only with --quick there.
  "pallas.lamb": ("ours", _lamb(implementation="pallas"), _update_then_apply),
  "pallas.apply": ("ours", _lamb(implementation="pallas"), _update_and_apply),
  # bfloat16 moments: 20 instead of 28 bytes per parameter to move at the floor.
  "optax_lamb.lamb-bf16": ("ours-bf16", _lamb(**BF16_MOMENTS), _update_then_apply),
  "update_and_apply-bf16": ("ours-bf16", _lamb(**BF16_MOMENTS), _update_and_apply),
}
DEFAULT_IMPLEMENTATIONS = ("optax.lamb", "optax_lamb.lamb", "update_and_apply")


def _device_loop(step: Callable, steps: int) -> Callable:
  """`steps` steps in one call: (params, state) carried by a fori_loop, grads fixed."""

  def loop(params, state, grads):
    def body(i, carry):
      # The barrier ties the carry and grads to the loop index: XLA can neither hoist work on
      # grads alone (g^2, a cast) out of the loop nor, if it unrolls the loop, fuse one step's last
      # pass with the next one's first. Either would make a step look cheaper than a call of it.
      (params, state), g, _ = jax.lax.optimization_barrier((carry, grads, i))
      return step(params, state, g)

    return jax.lax.fori_loop(0, steps, body, (params, state))

  return loop


# ------------------------------------------------------------------------- timing


def _timed(fn, *args):
  wall, cpu = time.perf_counter(), time.process_time()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - wall, time.process_time() - cpu


def _timed_calls(fn, params, state, grads, calls: int, sync: bool):
  """`calls` steps, one call each, as a training loop makes them; wall and CPU seconds per step."""
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(calls):
    params, state = fn(params, state, grads)
    if sync:
      jax.block_until_ready((params, state))
  jax.block_until_ready((params, state))
  return (params, state), (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


class Bandwidth:
  """Memory bandwidth from an in-place jitted scale of a large float32 array (read + write).

  The scale runs `repeats` times in one call, as the device figure's steps do: on a GPU one call's
  dispatch and sync (about 0.3 ms on an H100) is longer than the scale of 256 MiB itself.
  """

  def __init__(self, elements: int, repeats: int = 1):
    self.x = jnp.full((elements,), 1.5, jnp.float32)
    self.bytes = 2 * self.x.nbytes  # of one scale
    self.repeats = repeats

    def scale(x):
      def body(i, x):
        x, _ = jax.lax.optimization_barrier((x, i))  # one pass per repeat, even if unrolled
        return x * 1.0000001

      return jax.lax.fori_loop(0, repeats, body, x)

    self.fn = jax.jit(scale, donate_argnums=0).lower(self.x).compile()
    self.times: list[float] = []  # seconds per scale

  def run(self, record: bool = True) -> None:
    self.x, wall, _ = _timed(self.fn, self.x)
    if record:
      self.times.append(wall / self.repeats)

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


# Instructions of the ENTRY computation that launch nothing on the device.
_NO_LAUNCH = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
# "%name = <shape> opcode(" (shapes hold no "word(", so the first one is the opcode).
_OPCODE = re.compile(r"=\s*\S.*?\s([a-z][a-z0-9-]*)\(")


def count_kernels(hlo_text: str) -> int:
  """Approximate count of the device launches of one call of a compiled step.

  The instructions of the ENTRY computation of the optimised HLO (`compiled.as_text()`), except
  parameter, constant, tuple, get-tuple-element and bitcast. Approximate: a while loop or
  conditional counts once however many kernels it runs, an async start/done pair twice, a GPU
  command buffer (a `call` that replays several kernels as one CUDA graph) once, and on the CPU
  it counts what XLA would launch, not threads.
  """
  count, in_entry = 0, False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      in_entry = True
    elif in_entry:
      if line.startswith("}"):
        break
      match = _OPCODE.search(line)
      if match and match.group(1) not in _NO_LAUNCH:
        count += 1
  return count


def _layout(tree) -> tuple:
  """What must match for two implementations to share one state: structure, shapes, dtypes."""
  leaves, treedef = jax.tree.flatten(tree)
  return str(treedef), tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def _alive(tree) -> bool:
  return not any(x.is_deleted() for x in jax.tree.leaves(tree))


def _delete(tree) -> None:
  for x in jax.tree.leaves(tree):
    if not x.is_deleted():
      x.delete()


def _error(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"


def run_case(
  name: str,
  shapes: dict,
  impls: list[str],
  runs: int,
  warmup: int,
  bw: Bandwidth,
  log,
  inner_steps: int = 20,
  e2e_steps: int = 50,
) -> dict:
  """Time every implementation on one tree, interleaved round by round."""
  leaves = jax.tree.leaves(shapes, is_leaf=_is_shape)
  n_params = sum(math.prod(s) for s in leaves)
  params = random_tree(shapes, 0, 0.02)
  grads = random_tree(shapes, 1, 1e-3)
  states: dict[tuple, object] = {}  # (family, layout) -> the state its implementations advance
  inits: dict[tuple, Callable] = {}  # to rebuild a state a failed call left deleted
  compiled = {}  # impl -> (state key, device loop, e2e step)
  result = {"params": n_params, "leaves": len(leaves), "results": {}}
  for impl in impls:
    family, make_tx, make_step = IMPLEMENTATIONS[impl]
    try:
      tx = make_tx()
      key = (family, _layout(jax.eval_shape(tx.init, params)))
      if key not in states:
        states[key], inits[key] = tx.init(params), tx.init
      state = states[key]
      step = make_step(tx)
      e2e = jax.jit(step, donate_argnums=(0, 1))
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donated buffers XLA cannot reuse (none for these steps)
        start = time.perf_counter()
        # Compiled through `e2e` itself, so its first call reuses this executable: the e2e figure
        # goes through jit's own dispatch, as a user's call does.
        e2e_compiled = e2e.lower(params, state, grads).compile()
        compile_s = time.perf_counter() - start
        loop = (
          jax.jit(_device_loop(step, inner_steps), donate_argnums=(0, 1))
          .lower(params, state, grads)
          .compile()
        )
      compiled[impl] = (key, loop, e2e)
      result["results"][impl] = {
        "memory": _memory(e2e_compiled),
        "state_buffers": len(jax.tree.leaves(state)),
        "input_buffers": len(jax.tree.leaves((params, state, grads))),
        "kernels": count_kernels(e2e_compiled.as_text()),
        "compile_s": round(compile_s, 3),
        "loop_compile_s": round(time.perf_counter() - start - compile_s, 3),
      }
      log(f"  {name} {impl}: compiled in {time.perf_counter() - start:.1f} s")
    except Exception as e:  # one implementation failing must not end the run
      result["results"][impl] = {"error": _error(e)}
      log(f"  {name} {impl}: {_error(e)}")
  for key in set(states) - {key for key, _, _ in compiled.values()}:
    _delete(states.pop(key))  # made for implementations that then failed to compile
  fields = ("times", "cpu", "e2e", "e2e_cpu", "e2e_sync")
  times = {impl: {f: [] for f in fields} for impl in compiled}
  for round_ in range(warmup + runs):
    for impl in list(compiled):
      key, loop, e2e = compiled[impl]
      try:
        (params, states[key]), wall, cpu = _timed(loop, params, states[key], grads)
        (params, states[key]), e2e_wall, e2e_cpu = _timed_calls(
          e2e, params, states[key], grads, e2e_steps, sync=False
        )
        (params, states[key]), sync_wall, _ = _timed_calls(
          e2e, params, states[key], grads, e2e_steps, sync=True
        )
      except Exception as e:
        result["results"][impl] = {"error": _error(e)}
        log(f"  {name} {impl}: {_error(e)}")
        del compiled[impl], times[impl]
        # A call that failed may have consumed its donated buffers: rebuild those for the others.
        if not _alive(params):
          params = random_tree(shapes, 0, 0.02)
        for k in states:
          if not _alive(states[k]):
            states[k] = inits[k](params)
        continue
      if round_ >= warmup:
        figures = (wall / inner_steps, cpu / inner_steps, e2e_wall, e2e_cpu, sync_wall)
        for f, x in zip(fields, figures, strict=True):
          times[impl][f].append(x)
    bw.run(record=round_ >= warmup)
  # Free this case's arrays and executables before the next case allocates its own.
  for tree in (params, grads, *states.values()):
    _delete(tree)
  del params, grads, states, inits, compiled
  jax.clear_caches()
  gc.collect()
  ms = lambda xs: 1e3 * statistics.median(xs)
  listed = lambda xs: [round(1e3 * x, 4) for x in xs]
  for impl, t in times.items():
    result["results"][impl].update(
      device_ms=ms(t["times"]),
      # Older runs' name for the step time (one blocked call per step then), kept comparable.
      median_ms=ms(t["times"]),
      min_ms=1e3 * min(t["times"]),
      cpu_median_ms=ms(t["cpu"]),
      times_ms=listed(t["times"]),
      e2e_ms=ms(t["e2e"]),
      e2e_cpu_ms=ms(t["e2e_cpu"]),
      e2e_times_ms=listed(t["e2e"]),
      e2e_sync_ms=ms(t["e2e_sync"]),
      e2e_sync_times_ms=listed(t["e2e_sync"]),
    )
  log(f"  {name}: {n_params / 1e6:.1f}M params, {len(leaves)} leaves, timed")
  return result


def _summarise(report: dict) -> None:
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


def format_table(report: dict) -> str:
  lines = [
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
  ratio = lambda x: "" if x is None else f"{x:.3f}"
  for name, case in report["cases"].items():
    for impl, r in case["results"].items():
      if "error" in r:
        lines.append(f"{name:12s} {impl:21s} error: {r['error'][:100]}")
        continue
      lines.append(
        f"{name:12s} {impl:21s} {r['device_ms']:10.3f} {r['e2e_ms']:9.3f} {r['e2e_sync_ms']:11.3f} "
        f"{r['bytes_per_param']:8.1f} {ratio(r['ratio_to_optax']):>17s} "
        f"{ratio(r['e2e_ratio_to_optax']):>14s} {r['state_buffers']:13d} {r['kernels']:7d}"
      )
  return "\n".join(lines)


def plot(report: dict, path: str) -> None:
  """Device step time against parameter count, one line per implementation (log-log)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  impls = list(dict.fromkeys(i for c in report["cases"].values() for i in c["results"]))
  for impl, marker in zip(impls, ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"], strict=False):
    points = sorted(
      (c["params"], c["results"][impl]["device_ms"], name)
      for name, c in report["cases"].items()
      if "device_ms" in c["results"].get(impl, {})
    )
    ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=impl, alpha=0.85)
  for name, case in report["cases"].items():
    timed = [r["device_ms"] for r in case["results"].values() if "device_ms" in r]
    if timed:
      ax.annotate(name, (case["params"], min(timed)), textcoords="offset points",
                  xytext=(4, -12), fontsize=8)  # fmt: skip
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("parameters")
  ax.set_ylabel(f"device step time, ms (median, {report['inner_steps']} steps per call)")
  ax.set_title(
    f"LAMB step, float32 params, params and state donated\n{report['device']}, jax {report['jax']}",
    fontsize=10,
  )
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
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


def slugify(device_kind: str) -> str:
  """ "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3" (runs of other characters: one '-')."""
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def device_slug() -> str:
  """File name of this machine's results: the device kind, or cpu-<cores>core on a CPU."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return f"cpu-{os.cpu_count()}core"
  return slugify(device.device_kind)


def versions() -> dict:
  found = {"python": platform.python_version(), "optax_lamb": optax_lamb.__version__}
  for dist in (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "optax",
    "numpy",
    "triton",
  ):
    try:
      found[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small trees, a few runs (seconds)")
  parser.add_argument(
    "--skip-large",
    action="store_true",
    help="skip the BERT-large tree (it needs about 11 GB of memory)",
  )
  output = parser.add_mutually_exclusive_group()
  output.add_argument("--json", metavar="PATH", help="write the results as JSON")
  output.add_argument(
    "--json-auto",
    action="store_true",
    help="write the results to benchmarks/results/<device>.json (<device>-quick.json with --quick)",
  )
  parser.add_argument("--plot", metavar="PATH", help="write a PNG of device step time vs params")
  parser.add_argument("--runs", type=int, help="timed runs per figure (default 7, quick 3)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
  parser.add_argument(
    "--inner-steps", type=int, help="K, steps per call of the device figure (default 20, quick 3)"
  )
  parser.add_argument(
    "--e2e-steps", type=int, help="N, calls per run of the e2e figures (default 50, quick 5)"
  )
  parser.add_argument("--cases", nargs="+", help="only these cases")
  parser.add_argument(
    "--impls",
    nargs="+",
    default=list(DEFAULT_IMPLEMENTATIONS),
    choices=list(IMPLEMENTATIONS),
    help="implementations to time (optax.lamb gives the ratios)",
  )
  args = parser.parse_args(argv)
  if not args.quick and jax.default_backend() != "gpu":
    if any(impl.startswith("pallas") for impl in args.impls):
      parser.error("the pallas implementations run in interpret mode without a GPU: use --quick")
  runs = args.runs or (3 if args.quick else 7)
  inner_steps = args.inner_steps or (3 if args.quick else 20)
  e2e_steps = args.e2e_steps or (5 if args.quick else 50)
  cases = _cases(args.quick, args.skip_large)
  if args.cases:
    unknown = set(args.cases) - set(cases)
    if unknown:
      parser.error(f"unknown cases {sorted(unknown)}; choose from {list(cases)}")
    cases = {k: v for k, v in cases.items() if k in args.cases}
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  report = {
    "device": describe_device(),
    "device_kind": jax.devices()[0].device_kind,
    "device_count": jax.device_count(),
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "versions": versions(),
    "date": datetime.date.today().isoformat(),
    "quick": args.quick,
    "runs": runs,
    "warmup": args.warmup,
    "inner_steps": inner_steps,
    "e2e_steps": e2e_steps,
    "floor_bytes_per_param": FLOOR_BYTES_PER_PARAM,
    "hyperparameters": {"learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY},
    "load_average_start": [round(x, 2) for x in os.getloadavg()],
    "cases": {},
  }
  bw = Bandwidth((1 << 20) if args.quick else (64 << 20), repeats=inner_steps)
  for _ in range(2):
    bw.run(record=False)
  log(
    f"timing {list(cases)} x {args.impls}, {runs} runs after {args.warmup} warm-up; "
    f"device: {inner_steps} steps per call, e2e: {e2e_steps} calls"
  )
  for name, shapes in cases.items():
    report["cases"][name] = run_case(
      name, shapes, args.impls, runs, args.warmup, bw, log, inner_steps, e2e_steps
    )
  report["bandwidth_gbps"] = bw.gbps()
  report["bandwidth_bytes"] = bw.bytes
  report["bandwidth_repeats"] = bw.repeats
  report["bandwidth_times_ms"] = [round(1e3 * t, 4) for t in bw.times]
  report["load_average"] = [round(x, 2) for x in os.getloadavg()]
  _summarise(report)
  path = args.json
  if args.json_auto:
    # A quick run gets its own file, so it never overwrites a full run's results.
    path = os.path.join(RESULTS_DIR, device_slug() + ("-quick" if args.quick else "") + ".json")
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(report, f, indent=1)
    log(f"wrote {path}")
  if args.plot:
    plot(report, args.plot)
  print(format_table(report))  # last, so the table ends the output
  return report


if __name__ == "__main__":
  main()
