"""The main job: a batch-size sweep of the BERT large-batch recipe, LAMB against AdamW.

    python -m optax_lamb_recipes.sweep                 # the quick sweep (3 to 6 min on 2 CPU cores)
    python -m optax_lamb_recipes.sweep --preset claim  # the tuning grid of the claim study
    LAMB_QUICK=1 python -m optax_lamb_recipes.sweep    # the CI preset (synthetic data, seconds)

Every run of a seed sees the same samples in the same order (the same number of samples at
every batch size; more than one epoch when the budget asks for it, reshuffled and re-masked).
The first seed trains every learning-rate factor of the grids at every batch; each arm
(``report.ARMS``: each optimizer tuned at the smallest batch, at the largest, or at each) picks
its factors on the validation split, and the other seeds train only what the arms picked.
Arms are reported on a separate test split, as the mean and spread over the seeds. Prints a
table, writes the results as JSON and a PNG figure; ``study`` then compares the arms paired.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from optax_lamb_recipes import presets, records, report, splits
from optax_lamb_recipes.presets import FAMILIES, PRESETS, SweepConfig

# Measured on the 2-core machine of the committed results (see each results file's sessions).
DURATIONS = {
  "ci": "about a minute",
  "quick": "6.3 CPU-minutes, 3 to 6 minutes on a quiet machine",
  "claim": "about 93 minutes",
}
# A run "learned" when its final test loss ends this far below the context-free (token-frequency)
# baseline: beyond the test set's sampling error of one run's mean loss (a 95% half-width of
# 0.07 to 0.08 nats over the claim study's 768 test sequences, about 0.09 over 512).
LEARNED_BY = 0.1


def learned_line(results: dict, margin: float = LEARNED_BY) -> str:
  """Whether every cell of the table learned (`report.not_learned`), as one sentence."""
  base = report.context_free(results)
  if base is None:
    return "No context-free baseline for this data: whether each run learned is not checked."
  missed = report.not_learned(results, margin)
  if not missed:
    return (
      f"Every run in the table learned: its final test loss ends at least {margin} nats below the "
      f"context-free baseline ({base:.3f})."
    )
  said = ", ".join(
    f"{arm} at B={b} ({'diverged' if loss is None else f'{loss:.3f}'})" for arm, b, loss in missed
  )
  return (
    f"NOT LEARNED (final test loss less than {margin} nats below the context-free baseline, "
    f"{base:.3f}): {said}."
  )


def caveats(results: dict) -> str:
  """What the table shows and what it cannot, from its configuration."""
  cfg = results["config"]
  b_min, b_max = min(cfg["batches"]), max(cfg["batches"])
  steps = {r["batch"]: r["steps"] for r in results["summary"]}
  seeds = len(cfg["seeds"])
  grids = f"{len(cfg['lamb_grid'])} (LAMB) and {len(cfg['adamw_grid'])} (AdamW)"
  return (
    f"What it shows: with the same {cfg['samples']:,} sequences per run at every batch, how each "
    f"optimizer's final test loss changes as the batch grows from {b_min} to {b_max} and the "
    f"steps fall from {steps[b_min]:,} to {steps[b_max]:,}; columns of one optimizer differ where "
    f"its tuning protocols chose different learning rates (from grids of {grids} factors, on "
    f"validation, seed {cfg['seeds'][0]}). What it cannot show: "
    + (
      "a difference between optimizers beyond the seed-to-seed spread (one seed, no interval; "
      "docs/recipe.md gives the study over 3 to 5 seeds with t-intervals); "
      if seeds == 1
      else f"an interval ({seeds} seeds: mean and standard deviation only); "
    )
    + f"batches of large-batch training proper (the paper's 512 to 32K: this is {b_min} to "
    f"{b_max}, on a model of {_params(cfg['model']) / 1e6:.2f}M parameters, laptop scale); "
    "learning rates tuned finer than the grids."
  )


def _params(model: dict) -> int:
  """The model's parameter count."""
  import jax

  from optax_lamb_recipes import model as model_lib

  _, params = model_lib.init_params(model_lib.BertConfig(**model))
  return sum(x.size for x in jax.tree.leaves(params))


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


def _todo(cfg: SweepConfig, seed: int, factors, have) -> dict[tuple[str, int], list[float]]:
  """``(family, batch) -> factors`` still to train for ``seed``: the grids for the first seed,
  what the arms chose for the others."""
  if factors is None:
    todo = {(fam, b): list(presets.grid(cfg, fam)) for b in cfg.batches for fam in FAMILIES}
  else:
    todo = {
      (fam, b): sorted({factors[a][j] for a in report.ARMS if report.FAMILY[a] == fam})
      for j, b in enumerate(cfg.batches)
      for fam in FAMILIES
    }
  todo = {k: [f for f in fs if (seed, *k, f) not in have] for k, fs in todo.items()}
  return {k: fs for k, fs in todo.items() if fs}


def _progress_bar(cfg: SweepConfig, show: bool):
  try:
    from tqdm.auto import tqdm
  except ImportError:  # progress bars are optional
    return None
  return tqdm(total=0, desc=f"sweep {cfg.name}", unit="seq", disable=not show)


def train_seed(cfg, seed, todo, bar=None, keep_ratios=False, on_group=None) -> list[dict]:
  """Train every ``(family, batch) -> factors`` group of ``todo`` with ``seed``; their records.

  ``on_group(records)``, when given, is called after each group with that group's records.
  """
  from optax_lamb_recipes import train as train_lib

  train_data, val, test, _ = splits.load_data(cfg, seed)
  trainer = train_lib.Trainer(cfg.model, micro=cfg.micro, seed=seed)
  out = []
  for (family, b), fs in todo.items():
    lrs = [f * presets.base_lrs(cfg, b)[family] for f in fs]
    if bar is not None:
      bar.set_postfix_str(f"seed {seed} {family} B={b}")
    t0 = time.perf_counter()
    done = (lambda k: bar.update(k * len(fs))) if bar is not None else None  # noqa: B023
    group = trainer.run(
      family, lrs, presets.phases_for(cfg, b, lrs[0]), train_data, val, test=test,
      evals_per_phase=cfg.evals, progress=done,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    done = [
      records.record(r, f, seed, seconds, keep_ratios) for r, f in zip(group, fs, strict=True)
    ]
    out += done
    if on_group is not None:
      on_group(done)
  return out


def run_sweep(cfg: SweepConfig, *, progress: bool = True, previous: dict | None = None) -> dict:
  """Tune on the first seed, rerun the chosen learning rates on the others; a JSON-able dict.

  ``previous``: the results of an earlier sweep of the same data, model and schedule (with
  other grids or seeds); its runs are reused and only the missing ones are trained.
  """
  start = time.perf_counter()
  runs = _reusable_runs(cfg, previous)
  have = {(r["seed"], r["family"], r["batch"], r["factor"]) for r in runs}
  bar = _progress_bar(cfg, progress)
  factors = None
  for i, seed in enumerate(cfg.seeds):
    todo = _todo(cfg, seed, factors, have)
    if bar is not None:
      bar.total += sum(map(len, todo.values())) * cfg.samples
      bar.refresh()
    if todo:
      runs += train_seed(cfg, seed, todo, bar, keep_ratios=i == 0)
    if i == 0:
      factors = report.choose_factors(dataclasses.asdict(cfg), runs)
  if bar is not None:
    bar.close()
  this = records.session(start)
  earlier = (previous.get("sessions") or [_session_of(previous)]) if previous else []
  sessions = earlier + [this]
  out = {
    "config": dataclasses.asdict(cfg),
    "data": {k: v for k, v in splits.load_data(cfg, cfg.seeds[0])[3].items() if k != "seed"},
    "chosen_factors": factors,
    "runs": runs,
    "sessions": sessions,  # each invocation that trained some of the runs
    "wall_seconds": sum(x["wall_seconds"] for x in sessions),
    "cpu_seconds": sum(x["cpu_seconds"] for x in sessions),
    "machine": this["machine"],
  }
  out["summary"] = report.summarize(out)
  return out


def _session_of(results: dict) -> dict:
  return {k: results[k] for k in ("wall_seconds", "cpu_seconds", "machine")}


def default_paths(preset: str) -> tuple[str, str]:
  """``(results JSON, figure)``: the main job's names for ``quick``, the preset's in them else."""
  tag = "" if preset == "quick" else f"_{preset}"
  return f"sweep{tag}_results.json", f"sweep{tag}.png"


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n")[0],
    formatter_class=records.DefaultsHelpFormatter,
    epilog="Presets on 2 CPU cores: "
    + "; ".join(f"{k}: {PRESETS[k].name} preset, {v}" for k, v in DURATIONS.items())
    + ". --out and --plot default to sweep_results.json and sweep.png for quick, and to "
    "sweep_<preset>_results.json and sweep_<preset>.png for the others.",
  )
  default = PRESETS[presets.default_preset()]
  preset = lambda v: f"(default: the preset's; {default.name}: {v})"  # noqa: E731
  many = lambda xs: " ".join(f"{x:g}" for x in xs)  # noqa: E731
  parser.add_argument("--preset", choices=sorted(PRESETS), default=default.name, help="the preset")
  parser.add_argument("--out", help="results JSON path (default: per preset, below)")
  parser.add_argument("--plot", help="figure path (PNG); '' for none (default: per preset, below)")
  parser.add_argument(
    "--batches",
    type=int,
    nargs="+",
    help=f"override the batch sizes {preset(many(default.batches))}",
  )
  parser.add_argument(
    "--samples", type=int, help=f"override the samples per run {preset(default.samples)}"
  )
  parser.add_argument(
    "--seeds", type=int, nargs="+", help=f"override the seeds {preset(many(default.seeds))}"
  )
  parser.add_argument(
    "--lamb-lr", type=float, help=f"LAMB peak lr at the largest batch {preset(default.lamb_lr)}"
  )
  parser.add_argument(
    "--adamw-lr", type=float, help=f"AdamW peak lr at the smallest batch {preset(default.adamw_lr)}"
  )
  parser.add_argument(
    "--lamb-grid", type=float, nargs="+", help=f"LAMB lr factors {preset(many(default.lamb_grid))}"
  )
  parser.add_argument(
    "--adamw-grid",
    type=float,
    nargs="+",
    help=f"AdamW lr factors {preset(many(default.adamw_grid))}",
  )
  parser.add_argument("--reuse", metavar="PATH", help="results JSON whose matching runs to reuse")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  return parser


def _config(args) -> SweepConfig:
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
  return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def main(argv=None):
  args = _parser().parse_args(argv)
  cfg = _config(args)
  out, plot = default_paths(args.preset)
  out, plot = args.out or out, plot if args.plot is None else args.plot
  previous = None
  if args.reuse:
    with open(args.reuse) as f:
      previous = json.load(f)
  results = run_sweep(cfg, progress=not args.no_progress, previous=previous)
  with open(out, "w") as f:
    json.dump(results, f)
  print(
    f"\n{cfg.name} sweep: {cfg.samples} sequences of {cfg.seq_len} tokens per run, "
    f"{len(cfg.seeds)} seed(s), {results['data']['source']}"
  )
  print(report.format_table(results))
  print("\n" + learned_line(results))
  print(caveats(results))
  this, m = results["sessions"][-1], results["machine"]
  times = (
    f"this session: wall time {this['wall_seconds']:.0f} s, CPU time {this['cpu_seconds']:.0f} s"
  )
  if len(results["sessions"]) > 1:
    times += (
      f"; all {len(results['sessions'])} sessions that trained these runs (with --reuse): "
      f"wall {results['wall_seconds']:.0f} s, CPU {results['cpu_seconds']:.0f} s"
    )
  print(f"\n{times}; {m['cpus']} CPUs ({m['cpu']}), load average {m['load_average_at_end']}")
  print(f"results: {out}")
  if plot:
    import matplotlib

    matplotlib.use("Agg")  # headless
    from optax_lamb_recipes import plots

    plots.sweep_figure(results, plot)
    print(f"figure: {plot}")


if __name__ == "__main__":
  main()
