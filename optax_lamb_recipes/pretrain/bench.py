"""Throughput of phase 1 per optimizer: tokens/s per device, MFU, and the optimizer's share.

    python -m optax_lamb_recipes.pretrain.bench --preset base --opts lamb adamw --json out.json
    python -m optax_lamb_recipes.pretrain.bench --preset smoke --steps 3    # a CPU dry run

Each optimizer trains phase 1's model (the run's own jitted step, ``run.build``) at one
micro-batch per device per step (no accumulation: the optimizer's largest share), timing each
step to completion; the optimizer alone (update and apply, same shardings) is timed the same
way. Its share is the median optimizer time over the median step time. ``--require-gpu`` skips
(exit 0, "skipped" in the JSON) where jax has no GPU, as benchmarks/gpu_session.sh runs it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import numpy as np
import optax

from optax_lamb_recipes.data import num_predictions
from optax_lamb_recipes.pretrain import config, optim, run, step
from optax_lamb_recipes.pretrain import model as model_lib


def bench_config(preset: str, opt: str, n_devices: int, pairs) -> config.RunConfig:
  """Phase 1 of ``preset`` at one micro-batch per device, with ``opt``."""
  cfg = config.preset(preset, opt)
  micro = cfg.phases[0].micro_batch
  base = [("phases", 1), ("phase1.batch", micro * n_devices)]
  return config.override(cfg, base + list(pairs))


def _median_seconds(fn, steps: int) -> float:
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure(cfg: config.RunConfig, steps: int, warmup: int = 2, peak_tflops=None) -> dict:
  """Median step and optimizer time of ``cfg``'s phase 1, and what follows from them."""
  with tempfile.TemporaryDirectory() as out:
    built = run.build(cfg, run.Options(out=out, peak_tflops=peak_tflops))
    built.ckpt.close()
    phase, st, model = cfg.phases[0], built.steps[0], built.model
    k = phase.accumulation(built.mesh.size)
    local, _ = run.Batches(built, 0).next()
  batch = step.global_batch(local, k, st.batch_sharding, jax.process_index(), jax.process_count())
  box = {"params": model.init()}
  box["state"] = st.init(box["params"])

  def train_step() -> dict:
    box["params"], box["state"], raw = st.update(box["params"], box["state"], batch, np.int32(0))
    return raw

  state_sh = jax.tree.map(lambda a: a.sharding, st.state_abstract)
  apply = jax.jit(
    lambda g, s, p: _apply(st.tx, g, s, p),
    in_shardings=(model.shardings, state_sh, model.shardings),
    out_shardings=(model.shardings, state_sh),
    donate_argnums=(1, 2),
  )
  grads = jax.tree.map(lambda p: p * 1e-3, box["params"])

  def optimizer_step() -> dict:
    box["params"], box["state"] = apply(grads, box["state"], box["params"])
    return box["params"]

  _median_seconds(train_step, warmup)  # compiles
  step_s = _median_seconds(train_step, steps)
  _median_seconds(optimizer_step, warmup)
  opt_s = _median_seconds(optimizer_step, steps)
  flops = phase.batch * model_lib.train_flops(
    built.model_cfg, phase.seq_len, num_predictions(phase.seq_len)
  )
  n = built.mesh.size
  out = {
    "step_s": step_s,
    "optimizer_s": opt_s,
    "optimizer_share": opt_s / step_s,
    "tokens_per_s_per_device": phase.batch * phase.seq_len / step_s / n,
  }
  if built.peak is not None:
    out["mfu"] = flops / step_s / n / built.peak
  return out


def _apply(tx: optax.GradientTransformation, grads, state, params) -> tuple:
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def gpu_missing() -> str | None:
  """Why there is no GPU to benchmark (None: there is one)."""
  try:
    backend = jax.default_backend()
  except Exception as e:  # noqa: BLE001  (JAX_PLATFORMS=cuda without a GPU: various errors)
    return f"no GPU backend ({type(e).__name__}: {str(e)[:200]})"
  return None if backend == "gpu" else f"backend is {backend}"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(config.PRESETS), default="base")
  p.add_argument("--opts", nargs="+", choices=optim.NAMES, default=["lamb", "adamw"])
  p.add_argument("--steps", type=int, default=30, help="timed steps per optimizer")
  p.add_argument("--set", action="append", metavar="KEY=VALUE", help="as pretrain's --set")
  p.add_argument("--peak-tflops", type=float)
  p.add_argument("--json", help="write the results here")
  p.add_argument("--require-gpu", action="store_true", help="skip (exit 0) without a GPU")
  args = p.parse_args(argv)
  reason = gpu_missing() if args.require_gpu else None
  report: dict = {"preset": args.preset}
  if reason is not None:
    print(f"skipped: {reason}")
    report["skipped"] = reason
  else:
    n = jax.device_count()
    report |= {"device": jax.devices()[0].device_kind, "devices": n, "jax": jax.__version__}
    pairs = config.parse_pairs(args.set)
    for name in args.opts:
      cfg = bench_config(args.preset, name, n, pairs)
      report[name] = measure(cfg, args.steps, peak_tflops=args.peak_tflops)
      report["phase1"] = config.json_ready(cfg.to_json()["phases"][0])
      print(name, json.dumps(report[name]), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
