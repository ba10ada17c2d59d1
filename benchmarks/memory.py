"""Memory of one donated LAMB step, from the compiler: state bytes and temporaries per parameter.

    python -m benchmarks.memory [--trees bert-base bert-large] [--json PATH]

For each tree and configuration (`CONFIGURATIONS`: optax.lamb, optax_lamb.lamb and its options,
compat constructors, host offload) the step ``(params, state, grads) -> (params, state)`` is
jitted with params and state donated, lowered on abstract arrays (nothing is allocated) and
compiled; XLA's ``memory_analysis()`` gives its temporaries. The state's bytes come from
``jax.eval_shape(tx.init, params)``, split by memory kind (device or host). Everything is per
parameter and, for the temporaries, as a multiple of the params' bytes. The norms' sums take
the layout `auto` takes on accelerators ("rows", what this measures for), unless
``--norm-blocks columns`` (the CPU's: one accumulator of 1/16 of each large leaf per norm). The JSON
(`benchmarks/results/memory.json` by default) is what docs/benchmarks.md and the README render.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

if not __package__:  # run as a file: import from the repository root, not from benchmarks/
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import optax

import optax_lamb
from benchmarks import machine, trees
from optax_lamb.core import _ratios

LR = 1e-3
DEFAULT_OUT = os.path.join("benchmarks", "results", "memory", "cpu-2core.json")


@dataclasses.dataclass(frozen=True)
class Configuration:
  """One optimizer configuration: how to build it, its params' dtype, how a step applies it."""

  make: Callable[[], optax.GradientTransformation]
  param_dtype: Any = jnp.float32
  fused: bool = False  # optax_lamb.update_and_apply instead of update + apply_updates


def _decay_mask(params: Any) -> Any:
  return jax.tree.map(lambda p: p.ndim > 1, params)


CONFIGURATIONS: dict[str, Configuration] = {
  "optax.lamb": Configuration(lambda: optax.lamb(LR, weight_decay=0.01)),
  "lamb": Configuration(lambda: optax_lamb.lamb(LR, weight_decay=0.01)),
  "lamb, update_and_apply": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01), fused=True
  ),
  "lamb, skip_nonfinite": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, skip_nonfinite=True)
  ),
  "lamb, max_grad_norm, mask": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, max_grad_norm=1.0, mask=_decay_mask)
  ),
  "lamb, bfloat16 moments": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  ),
  "lamb, bfloat16 mu": Configuration(  # optax's mu_dtype alone: nu float32
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=jnp.bfloat16)
  ),
  "lamb, 8-bit moments": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  ),
  "update_and_apply, bfloat16 moments": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    fused=True,
  ),
  "update_and_apply, bfloat16 mu": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=jnp.bfloat16), fused=True
  ),
  "update_and_apply, 8-bit moments": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=jnp.int8, nu_dtype=jnp.uint8),
    fused=True,
  ),
  "lamb, bfloat16 params, master weights": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, master_weights=True), param_dtype=jnp.bfloat16
  ),
  "lamb, skip_nonfinite, master weights": Configuration(
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, skip_nonfinite=True, master_weights=True),
    param_dtype=jnp.bfloat16,
  ),
  "lamb, offload (device compute)": Configuration(
    lambda: optax_lamb.offload(optax_lamb.lamb(LR, weight_decay=0.01), compute="device")
  ),
  "lamb, offload (host compute)": Configuration(
    lambda: optax_lamb.offload(optax_lamb.lamb(LR, weight_decay=0.01), compute="host")
  ),
  "skip_nonfinite(optax.adamw) (generic wrapper)": Configuration(
    lambda: optax_lamb.skip_nonfinite(optax.adamw(LR))
  ),
  "skip_nonfinite(lamb, check_results=True)": Configuration(
    lambda: optax_lamb.skip_nonfinite(optax_lamb.lamb(LR), check_results=True)
  ),
  "keras_lamb": Configuration(lambda: optax_lamb.compat.keras_lamb(LR, weight_decay=0.01)),
  "timm_lamb, decoupled_decay": Configuration(
    lambda: optax_lamb.compat.timm_lamb(LR, weight_decay=0.01, decoupled_decay=True)
  ),
}


def _step(tx: optax.GradientTransformation, fused: bool) -> Callable:
  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    if fused:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # grads too: in a train step they are its own. A state in host memory is donated as well.
  return jax.jit(step, donate_argnums=(0, 1, 2))


def _bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """Bytes of the leaves of `tree` (ShapeDtypeStructs or arrays), by memory kind."""
  out = {"device": 0, "host": 0}
  for x in jax.tree.leaves(tree):
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    out["host" if kind in ("pinned_host", "unpinned_host") else "device"] += (
      x.size * x.dtype.itemsize
    )
  return out


def measure(shapes: dict, config: Configuration) -> dict:
  """The state's bytes by memory kind and the compiled step's temporaries, for one tree."""
  params = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, config.param_dtype), shapes, is_leaf=trees._is_shape
  )
  tx = config.make()
  # The state as init places it: eval_shape carries no memory kind, the compiled init's output
  # shardings do (pinned_host for an offloaded state), and the step is lowered on them.
  placed = jax.jit(tx.init).lower(params).compile().output_shardings
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(tx.init, params), placed,
  )  # fmt: skip
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # donated buffers the backend cannot reuse
    step = _step(tx, config.fused)
    compiled = step.lower(params, state, params).compile()
  analysis = compiled.memory_analysis()
  count = trees.param_count(shapes)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  state_bytes = _bytes_by_memory_kind(state)
  return {
    "params": count,
    "param_bytes": param_bytes,
    "state_device_bytes_per_param": state_bytes["device"] / count,
    "state_host_bytes_per_param": state_bytes["host"] / count,
    "temp_bytes": int(analysis.temp_size_in_bytes),
    "temp_bytes_per_param": analysis.temp_size_in_bytes / count,
    "temp_over_param_bytes": analysis.temp_size_in_bytes / param_bytes,
  }


def summary(results: dict, tree: str = "bert-base") -> str:
  """One line: the temporaries of a few configurations on `tree`, as multiples of the params."""
  r = results["trees"][tree]
  cells = ", ".join(
    f"{name} {r[name]['temp_over_param_bytes']:.3f}x" for name in ("optax.lamb", "lamb",
    "lamb, skip_nonfinite", "lamb, bfloat16 params, master weights") if name in r
  )  # fmt: skip
  return (
    f"Compiled temporaries of one donated step ({tree}, {results['device']}, commit "
    f"{', '.join(commits(results))}, {results['date']}), as a multiple of the params' bytes: "
    f"{cells}."
  )


def table(results: dict) -> str:
  """Markdown: one row per configuration, per tree its state and temporaries per parameter."""
  names = list(results["trees"])
  head = "| configuration | " + " | ".join(
    f"{t}: state B/param (device, host) | {t}: temporaries B/param (x params)" for t in names
  )
  rows = [head + " |", "|---|" + "---:|---:|" * len(names)]
  for config in results["configurations"]:
    cells = []
    for t in names:
      r = results["trees"][t].get(config)
      if r is None:
        cells += ["not measured", "not measured"]
        continue
      state = f"{r['state_device_bytes_per_param']:.2f}, {r['state_host_bytes_per_param']:.2f}"
      temp = f"{r['temp_bytes_per_param']:.3f} ({r['temp_over_param_bytes']:.3f}x)"
      cells += [state, temp]
    rows.append(f"| `{config}` | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def commits(results: dict) -> list[str]:
  """The commits the entries were measured at (a merged file may hold several)."""
  return sorted({commit for commit, _, _ in runs(results)})


def runs(results: dict) -> list[tuple[str, str, str]]:
  """(commit, date, device) of each run the entries come from, oldest first."""
  entries = [r for t in results["trees"].values() for r in t.values()]
  keys = ("commit", "date", "device")
  return sorted({tuple(r.get(k, results[k]) for k in keys) for r in entries}, key=lambda x: x[1])


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--trees", nargs="+", default=["bert-base", "bert-large"])
  parser.add_argument("--configurations", nargs="+", default=list(CONFIGURATIONS))
  parser.add_argument("--json", default=DEFAULT_OUT, help="where to write the results")
  parser.add_argument(
    "--merge", action="store_true",
    help="add to (or replace in) the results already at --json; each entry keeps its commit",
  )  # fmt: skip
  parser.add_argument(
    "--norm-blocks", choices=["rows", "columns"], default="rows",
    help="the norms' layout (optax_lamb.core._ratios.NORM_BLOCKS); rows: the accelerators' default",
  )  # fmt: skip
  args = parser.parse_args(argv)
  _ratios.NORM_BLOCKS = args.norm_blocks
  results: dict = {"trees": {}}
  if args.merge and os.path.exists(args.json):
    with open(args.json) as f:
      results = json.load(f)
  commit = machine.commit()
  results.update(device=machine.describe_device(), commit=commit, versions=machine.versions(),
                 date=datetime.date.today().isoformat())  # fmt: skip
  for name in args.trees:
    shapes = trees.NAMED_TREES[name]()
    measured = results["trees"].setdefault(name, {})
    for config in args.configurations:
      measured[config] = {
        **measure(shapes, CONFIGURATIONS[config]),
        "commit": commit,  # each entry its own: a merged file holds several runs
        "date": results["date"],
        "device": results["device"],
        "norm_blocks": args.norm_blocks,
      }
      print(f"{name:10s} {config:40s} {measured[config]['temp_over_param_bytes']:.4f}x", flush=True)
      _write(results, args.json)  # as it goes: a stopped run keeps what it measured
  results["configurations"] = [
    c for c in CONFIGURATIONS if any(c in t for t in results["trees"].values())
  ]
  _write(results, args.json)
  print(table(results))
  return results


def _write(results: dict, path: str | None) -> None:
  if path:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
