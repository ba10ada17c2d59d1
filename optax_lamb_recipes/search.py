"""Nado et al.'s control at this scale: an equal-budget random search for each optimizer.

    python -m optax_lamb_recipes.search                 # trains what notebooks/results/search.json lacks
    LAMB_QUICK=1 python -m optax_lamb_recipes.search    # the CI preset (seconds), to search_ci.json

At the smallest and the largest batch of a sweep, LAMB and AdamW get the same number of trials.
Each trial is one random draw, log-uniform in each range of ``SPACES``: the peak learning rate
(a factor on the sweep's square-root-rule rate at that batch), the warm-up as a fraction of the
run's steps, 1 - beta2, the weight decay, and epsilon for AdamW (LAMB keeps the paper's 1e-6).
Every trial trains the first seed and is scored on the validation split; the best trial of each
optimizer and batch is then trained on the other seeds, and the two optimizers are compared on
the test split, paired by seed and test sequence (``analysis.t_interval``). The results file is
written after every group of runs; running the command again resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping

import numpy as np

from optax_lamb_recipes import analysis, presets, records, report, splits
from optax_lamb_recipes.presets import FAMILIES, SweepConfig

# Log-uniform ranges. The learning-rate factors span the claim grid's and beyond on both sides.
SPACES = {
  "lamb": {
    "factor": (1 / 16, 4.0),
    "warmup_frac": (0.005, 0.5),
    "one_minus_b2": (1e-3, 1e-1),
    "weight_decay": (1e-3, 0.3),
  },
  "adamw": {
    "factor": (1 / 16, 8.0),
    "warmup_frac": (0.005, 0.5),
    "one_minus_b2": (1e-3, 1e-1),
    "weight_decay": (1e-3, 0.3),
    "eps": (1e-10, 1e-4),
  },
}
FIXED_EPS = 1e-6  # LAMB's epsilon (the paper's), where the space has none


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  name: str
  sweep: SweepConfig  # data, model, batches and sample budget; searched at its first and last batch
  trials: int  # per optimizer and batch: the equal budget
  seeds: tuple[int, ...]  # the first scores the trials; all train the chosen trial
  group: int = 6  # trials trained side by side (one compiled program) before the file is written
  batches: tuple[int, ...] = ()  # where to search; () = the sweep's smallest and largest
  spaces: dict | None = None  # None = SPACES
  stream: tuple[int, ...] = ()  # more keys of the draws' generator: draws of their own
  stratified: bool = False  # one draw in each 1/trials of every log range (Latin hypercube)
  keep_ratios: bool = False  # record per-layer trust ratios and relative steps (thinned)
  select_seeds: int = 1  # the first this many seeds train every trial; their mean validation picks
  known: Mapping[str, tuple[dict[str, float], ...]] | None = None  # settings after the draws

  def draw(self, family: str, batch: int) -> list[dict[str, float]]:
    """The trials of ``family`` at ``batch``: the random draws, then its known settings."""
    drawn = draw_trials(
      family, batch, self.trials, spaces=self.spaces, stream=self.stream,
      stratified=self.stratified,
    )  # fmt: skip
    return drawn + [dict(k) for k in (self.known or {}).get(family, ())]

  def trials_of(self, family: str) -> int:
    return self.trials + len((self.known or {}).get(family, ()))


PRESETS = {
  "claim": SearchConfig("claim", presets.PRESETS["claim"], trials=12, seeds=(0, 1, 2, 3, 4)),
  "ci": SearchConfig("ci", presets.PRESETS["ci"], trials=2, seeds=(0, 1), group=2),
}
DEFAULT_OUT = {"claim": os.path.join("notebooks", "results", "search.json"), "ci": "search_ci.json"}


def draw_trials(
  family: str, batch: int, n: int, *, spaces=None, stream=(), stratified=False
) -> list[dict[str, float]]:
  """``n`` trials for ``family`` at ``batch``: the same draws on every run of the command.

  Log-uniform in each range of ``spaces`` (default ``SPACES``); ``stratified``: a Latin
  hypercube, each range's log cut into ``n`` equal strata with one draw in each, so that a few
  trials cannot all fall in one end of a range."""
  rng = np.random.default_rng([FAMILIES.index(family), batch, *stream])
  space = (spaces or SPACES)[family]
  if stratified:
    u = {k: (rng.permutation(n) + rng.uniform(size=n)) / n for k in space}
  else:  # trial by trial (the draws of the committed search)
    rows = [{k: rng.uniform() for k in space} for _ in range(n)]
    u = {k: [row[k] for row in rows] for k in space}
  logs = {k: (math.log(lo), math.log(hi)) for k, (lo, hi) in space.items()}
  out = []
  for i in range(n):
    x = {k: math.exp(lo + (hi - lo) * float(u[k][i])) for k, (lo, hi) in logs.items()}
    out.append(
      {"factor": x["factor"], "warmup_frac": x["warmup_frac"], "b2": 1.0 - x["one_minus_b2"],
       "weight_decay": x["weight_decay"], "eps": x.get("eps", FIXED_EPS)}
    )  # fmt: skip
  return out


def edges(cfg: SearchConfig) -> tuple[int, ...]:
  """The batches searched: ``cfg.batches``, or the sweep's smallest and largest."""
  return cfg.batches or (min(cfg.sweep.batches), max(cfg.sweep.batches))


def chosen(cfg: SearchConfig, runs: list[dict]) -> dict[tuple[str, int], int]:
  """``(family, batch) -> trial`` with the best final validation loss, averaged over the
  selection seeds (the first ``cfg.select_seeds``), once every trial has trained on each."""
  selecting = cfg.seeds[: cfg.select_seeds]
  out = {}
  for family in FAMILIES:
    for b in edges(cfg):
      scored: dict[int, list[float]] = {}
      for r in runs:
        if r["seed"] in selecting and (r["family"], r["batch"]) == (family, b):
          scored.setdefault(r["trial"], []).append(records.final(r, "validation"))
      complete = {t: float(np.mean(v)) for t, v in scored.items() if len(v) == len(selecting)}
      if len(complete) == cfg.trials_of(family):
        out[family, b] = min(complete, key=complete.get)
  return out


def train_trials(
  scfg: SweepConfig, seed: int, family: str, b: int, trials: dict, group: int, on_group,
  keep_ratios: bool = False, opt=None,
) -> None:  # fmt: skip
  """Train ``trials`` (index -> drawn settings) of ``family`` at batch ``b`` on ``seed``,
  ``group`` side by side; ``on_group(records)`` after each group (with the per-layer trust ratios
  and relative steps where ``keep_ratios``). ``opt``: the trainer's `train.OptimizerConfig`
  (default: the recipe's), which the trials' searched settings replace."""
  from optax_lamb_recipes import train as train_lib

  train_data, val, test, _ = splits.load_data(scfg, seed)
  opt = opt or train_lib.OptimizerConfig()
  trainer = train_lib.Trainer(scfg.model, opt=opt, micro=scfg.micro, seed=seed)
  idx_all = list(trials)
  for lo in range(0, len(idx_all), group):
    idx = idx_all[lo : lo + group]
    chunk = [trials[i] for i in idx]
    lrs = [t["factor"] * presets.base_lrs(scfg, b)[family] for t in chunk]
    t0 = time.perf_counter()
    results = trainer.run(
      family, lrs, presets.phases_for(scfg, b, lrs[0]), train_data, val, test=test,
      evals_per_phase=scfg.evals, trials=chunk,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    done = []
    for res, i, t in zip(results, idx, chunk, strict=True):
      done.append(records.record(res, t["factor"], seed, seconds, keep_ratios=keep_ratios))
      done[-1] |= {"trial": i, "hyper": t}
    on_group(done)


def run_search(cfg: SearchConfig, *, out: str, previous: dict | None = None) -> dict:
  """Train every missing run, writing ``out`` after each group; the results dict."""
  start = time.perf_counter()
  runs = list(previous["runs"]) if previous else []
  earlier = list(previous["sessions"]) if previous else []
  have = {(r["seed"], r["family"], r["batch"], r["trial"]) for r in runs}
  data = splits.load_data(cfg.sweep, cfg.seeds[0])[3]  # the data's summary, for the results

  def save(group):
    runs.extend(group)
    records.write_json(_results(cfg, data, runs, earlier + [records.session(start)]), out)
    r = group[0]
    print(f"seed {r['seed']} {r['family']} B={r['batch']}: {r['group_seconds']:.0f} s", flush=True)

  for seed in cfg.seeds:
    for family in FAMILIES:
      for b in edges(cfg):
        if seed in cfg.seeds[: cfg.select_seeds]:
          which = list(range(cfg.trials_of(family)))
        else:
          which = [chosen(cfg, runs)[family, b]]
        which = [i for i in which if (seed, family, b, i) not in have]
        if which:
          drawn = cfg.draw(family, b)
          trials = {i: drawn[i] for i in which}
          train_trials(cfg.sweep, seed, family, b, trials, cfg.group, save, cfg.keep_ratios)
  sessions = earlier + [records.session(start)] if len(runs) > len(have) else earlier
  return _results(cfg, data, runs, sessions)


def _results(cfg: SearchConfig, data: dict, runs: list[dict], sessions: list[dict]) -> dict:
  return {
    "search": {
      "name": cfg.name,
      "trials": cfg.trials,
      "seeds": list(cfg.seeds),
      "batches": list(edges(cfg)),
      "spaces": cfg.spaces or SPACES,
      "stream": list(cfg.stream),
      "stratified": cfg.stratified,
      "select_seeds": cfg.select_seeds,
      "known": {f: list(k) for f, k in (cfg.known or {}).items()},
    },  # fmt: skip
    "config": dataclasses.asdict(cfg.sweep),
    "data": {k: v for k, v in data.items() if k != "seed"},
    "chosen": [{"family": f, "batch": b, "trial": t} for (f, b), t in chosen(cfg, runs).items()],
    "runs": runs,
    "sessions": sessions,
    "wall_seconds": sum(s["wall_seconds"] for s in sessions),
    "cpu_seconds": sum(s["cpu_seconds"] for s in sessions),
  }


def losses(results: dict, family: str, batch: int) -> tuple[list[int], np.ndarray]:
  """``(seeds, L)`` of the chosen trial: L[i, q], the loss on test sequence q with seeds[i]."""
  trial = next(
    c["trial"] for c in results["chosen"] if (c["family"], c["batch"]) == (family, batch)
  )
  at = sorted(
    (r for r in results["runs"] if (r["family"], r["batch"], r["trial"]) == (family, batch, trial)),
    key=lambda r: r["seed"],
  )
  return [r["seed"] for r in at], np.array([r["test_per_sequence"] for r in at], float)


def table(results: dict) -> dict[int, dict[str, dict]]:
  """Batch -> ``lamb`` / ``adamw`` (final test loss of the chosen trial) and ``difference``
  (LAMB minus AdamW), on the seeds both have (`analysis.paired`), where both chose a trial."""
  chosen = {(c["family"], c["batch"]) for c in results["chosen"]}
  batches = sorted({b for _, b in chosen if all((f, b) in chosen for f in FAMILIES)})
  return {
    b: analysis.paired(losses(results, "lamb", b), losses(results, "adamw", b)) for b in batches
  }


def format_table(results: dict) -> str:
  """Markdown: per batch, each optimizer's searched loss and the paired difference."""
  known = {len(k) for k in results["search"].get("known", {}).values()}
  plus = f" plus {known.pop()} known settings" if len(known) == 1 and 0 not in known else ""
  lines = [
    f"Random search, {results['search']['trials']} trials{plus} per optimizer and batch; final test "
    "loss of the best trial (nats), mean over seeds [95% t-interval] (each seed's), and LAMB minus "
    "AdamW (negative: LAMB better):",
    "",
    "| batch | LAMB | AdamW | LAMB minus AdamW | seeds |",
    "|---:|---:|---:|---:|---:|",
  ]
  for b, row in table(results).items():
    d = row["difference"]
    cells = analysis.loss_cell(row["lamb"]), analysis.loss_cell(row["adamw"])
    lines.append(analysis.markdown_row([b, *cells, analysis.difference_cell(d), d["seeds"]]))
  return "\n".join(lines)


def findings(results: dict) -> str:
  """One sentence: where the searched LAMB minus AdamW lies relative to zero, at 95%."""
  by_batch = {b: row["difference"] for b, row in table(results).items()}
  return f"Both searched: {analysis.sides_of_zero(by_batch)}."


def selection_seeds(results: dict) -> list[int]:
  """The seeds on which every trial trained and was scored (the first, in older files)."""
  search = results["search"]
  return search["seeds"][: search.get("select_seeds", 1)]


def selection_seeds_text(results: dict) -> str:
  """`selection_seeds` as a list for a sentence: "0, 1"."""
  return ", ".join(str(s) for s in selection_seeds(results))


def format_chosen(results: dict) -> str:
  """Markdown: the chosen trial of each optimizer and batch, and its validation loss (the mean
  over the selection seeds)."""
  lines = [
    "| optimizer | batch | peak lr | warm-up | beta2 | weight decay | eps | validation |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  selecting = selection_seeds(results)
  for c in results["chosen"]:
    at = [
      r
      for r in results["runs"]
      if r["seed"] in selecting
      and (r["family"], r["batch"], r["trial"]) == (c["family"], c["batch"], c["trial"])
    ]
    r, h = at[0], at[0]["hyper"]
    validation = float(np.mean([records.final(x, "validation") for x in at]))
    settings = f"{r['peak_lr']:.2g}", f"{h['warmup_frac']:.1%}", f"{h['b2']:.4f}"
    rest = f"{h['weight_decay']:.2g}", f"{h['eps']:.1g}", f"{validation:.3f}"
    lines.append(analysis.markdown_row([c["family"], c["batch"], *settings, *rest]))
  return "\n".join(lines)


def format_compute(results: dict) -> str:
  """One sentence: the budget (trials, spaces), runs, wall and CPU time, machine, dates."""
  ranges = lambda space: ", ".join(f"{k} {lo:g} to {hi:g}" for k, (lo, hi) in space.items())
  search = results["search"]
  how = (
    "and stratified, one draw in each 1/n of every log range " if search.get("stratified") else ""
  )
  known = {f: len(k) for f, k in search.get("known", {}).items() if k}
  plus = (
    " plus known settings (" + ", ".join(f"{report.OPTIMIZERS[f]} {n}" for f, n in known.items())
    + ")" if known else ""
  )  # fmt: skip
  selecting = selection_seeds(results)
  rest = [s for s in search["seeds"] if s not in selecting]
  return (
    f"{search['trials']} trials per optimizer at each batch, drawn log-uniformly {how}"
    f"(LAMB: {ranges(search['spaces']['lamb'])}; AdamW: {ranges(search['spaces']['adamw'])}; "
    f"factor on the square-root-rule learning rate, warm-up as a fraction of the steps){plus}, "
    f"scored on validation with seed{'s' * (len(selecting) > 1)} "
    f"{', '.join(map(str, selecting))}, the best rerun on seeds {', '.join(map(str, rest))}: "
    f"{len(results['runs'])} runs, {records.compute_used(results)}"
  )


def format_report(results: dict) -> str:
  """Markdown: the paired table, the chosen trials, the compute."""
  chosen = "The chosen trials (validation loss with the first seed):\n\n" + format_chosen(results)
  return "\n\n".join([format_table(results), chosen, format_compute(results) + "."])


def main(argv=None):
  epilog = (
    "The claim preset trains 64 runs (48 trials, then 16 reruns of the chosen ones); "
    "measured times are in the results' sessions. The ci preset takes seconds."
  )
  run = lambda preset, out, previous: run_search(PRESETS[preset], out=out, previous=previous)
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, run, format_report)


if __name__ == "__main__":
  main()
