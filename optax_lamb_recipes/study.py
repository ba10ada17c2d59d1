"""The claim study: LAMB against AdamW with both tuned the same way, paired by seed.

    python -m optax_lamb_recipes.study                 # trains what notebooks/results/study.json lacks
    LAMB_QUICK=1 python -m optax_lamb_recipes.study    # the CI preset (seconds), to study_ci.json

The learning rates come from a sweep's tuning grid (its first seed, validation split): for each
optimizer, the factor best at the smallest batch, the one best at the largest, and the one best at
each batch. The square-root rule carries an anchor's factor to the other batches, so each
optimizer has three arms (``PROTOCOLS``), and LAMB meets AdamW under the same protocol. Every arm
is trained again on ``seeds`` at every batch and on ``extra_seeds`` at the smallest and largest
batch; each run keeps its final model's loss on every test sequence, so that comparisons pair by
seed and test sequence (``analysis``: t-intervals over the seeds). The results file is written
after every group of runs; running the command again resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import os
import time

from optax_lamb_recipes import presets, records, report, sweep


@dataclasses.dataclass(frozen=True)
class StudyConfig:
  """Which tuning results to follow, and the seeds to train."""

  name: str
  tuning: str  # a sweep's results JSON (its config is the training setup; its first seed tunes)
  seeds: tuple[int, ...] = (0, 1, 2)  # trained at every batch
  extra_seeds: tuple[int, ...] = (3, 4)  # trained at the smallest and largest batch only


PRESETS = {
  "claim": StudyConfig(name="claim", tuning=os.path.join("notebooks", "results", "sweep.json")),
  # CI: tunes with a fresh ci sweep (seconds), then one extra seed.
  "ci": StudyConfig(name="ci", tuning="", seeds=(0,), extra_seeds=(1,)),
}
DEFAULT_OUT = {"claim": os.path.join("notebooks", "results", "study.json"), "ci": "study_ci.json"}


def cells(cfg: StudyConfig, batches, factors) -> dict[int, dict[tuple[str, int], list[float]]]:
  """Seed -> ``(family, batch) -> lr factors`` to train: every arm's choice at each batch."""
  edges = (min(batches), max(batches))
  out = {}
  for seed in cfg.seeds + cfg.extra_seeds:
    out[seed] = {}
    for j, b in enumerate(batches):
      if seed in cfg.seeds or b in edges:
        for family in report.OPTIMIZERS:
          arms = [a for a in report.ARMS if report.FAMILY[a] == family]
          out[seed][family, b] = sorted({factors[a][j] for a in arms})
  return out


def run_study(cfg: StudyConfig, tuning: dict, *, out: str, previous: dict | None = None) -> dict:
  """Train every missing run of the study, writing ``out`` after each group; the results dict."""
  start = time.perf_counter()
  scfg = presets.from_json(tuning["config"])
  factors = report.choose_factors(tuning["config"], tuning["runs"])
  runs = list(previous["runs"]) if previous else []
  have = {(r["seed"], r["family"], r["batch"], r["factor"]) for r in runs}
  earlier = list(previous["sessions"]) if previous else []

  def save(group):
    runs.extend(group)
    records.write_json(
      _results(cfg, tuning, factors, runs, earlier + [records.session(start)]), out
    )
    r = group[0]
    print(f"seed {r['seed']} {r['family']} B={r['batch']}: {r['group_seconds']:.0f} s", flush=True)

  for seed, todo in cells(cfg, list(scfg.batches), factors).items():
    todo = {k: [f for f in fs if (seed, *k, f) not in have] for k, fs in todo.items()}
    todo = {k: fs for k, fs in todo.items() if fs}
    if todo:
      sweep.train_seed(scfg, seed, todo, keep_ratios=seed == cfg.seeds[0], on_group=save)
  sessions = earlier + [records.session(start)] if len(runs) > len(have) else earlier
  return _results(cfg, tuning, factors, runs, sessions)


def _results(cfg, tuning, factors, runs, sessions) -> dict:
  return {
    "study": dataclasses.asdict(cfg),
    "config": tuning["config"],
    "data": tuning["data"],
    "tuning": {"chosen_factors": factors, "trials_per_batch": _grid_sizes(tuning)},
    "runs": runs,
    "sessions": sessions,
    "wall_seconds": sum(s["wall_seconds"] for s in sessions),
    "cpu_seconds": sum(s["cpu_seconds"] for s in sessions),
  }


def _grid_sizes(tuning: dict) -> dict[str, int]:
  return {"lamb": len(tuning["config"]["lamb_grid"]), "adamw": len(tuning["config"]["adamw_grid"])}


def _job(preset: str, out: str, previous: dict | None) -> dict:
  cfg = PRESETS[preset]
  ci_sweep = lambda: sweep.run_sweep(presets.PRESETS["ci"], progress=False)
  return run_study(cfg, records.input_results(cfg.tuning, ci_sweep), out=out, previous=previous)


def main(argv=None):
  from optax_lamb_recipes import analysis

  epilog = (
    "The claim preset trains 88 runs: 82 minutes on 2 CPU cores for the committed ones (see the "
    "results' sessions). The ci preset takes seconds."
  )
  return records.run_resumable(
    argv, __doc__, epilog, PRESETS, DEFAULT_OUT, _job, analysis.format_report
  )


if __name__ == "__main__":
  main()
