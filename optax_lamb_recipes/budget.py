"""Longer training: the searched settings with several times the sample budget.

    python -m optax_lamb_recipes.budget                # trains what notebooks/results/budget.json lacks
    LAMB_QUICK=1 python -m optax_lamb_recipes.budget   # the CI preset (seconds), to budget_ci.json

The random search (``search.py``) chose each optimizer's settings at the smallest and the largest
batch under the sweep's sample budget, where batch 16 was still learning at the end. Here those
settings train again with ``multiple`` times the samples (the same schedule stretched: warm-up the
same fraction of the steps, decay to zero at the last step), so that the budget where batch 16
stops improving is measured, and LAMB and AdamW are compared there, paired by seed and test
sequence. The settings are not re-searched at the longer budgets. The results file is written after
every run; running the command again resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import os
import time

from optax_lamb_recipes import presets, records, search
from optax_lamb_recipes.presets import FAMILIES


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
  name: str
  search: str  # the random search's results JSON ("": a fresh ci search, for CI)
  # (multiple of the search's samples, seed, batches[, families]), in training order; every
  # optimizer where families is left out
  runs: tuple[tuple, ...]


def entries(runs) -> list[tuple[int, int, tuple[int, ...], tuple[str, ...]]]:
  """``BudgetConfig.runs`` (or their JSON lists) with the families filled in."""
  return [(r[0], r[1], tuple(r[2]), tuple(r[3]) if len(r) > 3 else FAMILIES) for r in runs]


PRESETS = {
  # The longest budget on seed 0 (is 4x flat? 8x says), more seeds at 4x, then the curve's shape;
  # then 16x, 32x and 64x, since batch 16 still improved at 8x.
  "claim": BudgetConfig(
    "claim",
    os.path.join("notebooks", "results", "search.json"),
    runs=(
      (4, 0, (16, 512)),
      (8, 0, (16, 512)),
      (4, 1, (16, 512)),
      (4, 2, (16, 512)),
      (2, 0, (16, 512)),
      (16, 0, (16, 512)),  # 8x was still falling: longer, for batch 16 above all
      (32, 0, (16,)),
      (64, 0, (16,), ("adamw",)),  # LAMB diverged at 32x with these settings
      (32, 1, (16,), ("lamb",)),  # does it on another seed?
    ),
  ),  # fmt: skip
  "ci": BudgetConfig("ci", "", runs=((2, 0, (16, 64)), (2, 1, (16, 64)))),
}
DEFAULT_OUT = {"claim": os.path.join("notebooks", "results", "budget.json"), "ci": "budget_ci.json"}


def chosen_settings(searched: dict) -> dict[tuple[str, int], dict]:
  """``(family, batch) -> {"trial", "hyper"}`` of the search's chosen trials."""
  out = {}
  for c in searched["chosen"]:
    run = next(
      r
      for r in searched["runs"]
      if (r["family"], r["batch"], r["trial"]) == (c["family"], c["batch"], c["trial"])
    )
    out[c["family"], c["batch"]] = {"trial": c["trial"], "hyper": run["hyper"]}
  return out


def run_budget(cfg: BudgetConfig, searched: dict, *, out: str, previous: dict | None = None):
  """Train every missing run, writing ``out`` after each; the results dict."""
  start = time.perf_counter()
  scfg = presets.from_json(searched["config"])
  settings = chosen_settings(searched)
  runs = list(previous["runs"]) if previous else []
  earlier = list(previous["sessions"]) if previous else []
  have = {(r["multiple"], r["seed"], r["family"], r["batch"]) for r in runs}

  def save(group, multiple):
    runs.extend(g | {"multiple": multiple} for g in group)
    records.write_json(_results(cfg, searched, runs, earlier + [records.session(start)]), out)
    r = group[0]
    print(
      f"{multiple}x seed {r['seed']} {r['family']} B={r['batch']}: {r['group_seconds']:.0f} s",
      flush=True,
    )

  for multiple, seed, batches, families in entries(cfg.runs):
    longer = dataclasses.replace(scfg, samples=scfg.samples * multiple)
    for (family, b), s in sorted(settings.items(), key=lambda kv: FAMILIES.index(kv[0][0])):
      if b in batches and family in families and (multiple, seed, family, b) not in have:
        search.train_trials(
          longer,
          seed,
          family,
          b,
          {s["trial"]: s["hyper"]},
          1,
          lambda g, m=multiple: save(g, m),
          keep_ratios=True,
        )
  sessions = earlier + [records.session(start)] if len(runs) > len(have) else earlier
  return _results(cfg, searched, runs, sessions)


def _results(cfg: BudgetConfig, searched: dict, runs: list[dict], sessions: list[dict]) -> dict:
  return {
    "budget": dataclasses.asdict(cfg),
    "config": searched["config"],
    "data": searched["data"],
    "chosen": [{"family": f, "batch": b} | s for (f, b), s in chosen_settings(searched).items()],
    "search_runs_at_1x": [
      r | {"multiple": 1}
      for r in searched["runs"]
      if any(
        (r["family"], r["batch"], r["trial"]) == (c["family"], c["batch"], c["trial"])
        for c in searched["chosen"]
      )
    ],  # fmt: skip
    "runs": runs,
    "sessions": sessions,
    "wall_seconds": sum(s["wall_seconds"] for s in sessions),
    "cpu_seconds": sum(s["cpu_seconds"] for s in sessions),
  }


def _job(preset: str, out: str, previous: dict | None) -> dict:
  cfg = PRESETS[preset]
  ci_search = lambda: search.run_search(search.PRESETS["ci"], out="search_ci.json")
  return run_budget(cfg, records.input_results(cfg.search, ci_search), out=out, previous=previous)


def main(argv=None) -> dict:
  from optax_lamb_recipes import budget_report  # it reads this module's entries

  claim = entries(PRESETS["claim"].runs)
  multiples = sorted({m for m, _, _, _ in claim})
  epilog = (
    f"The claim preset trains {sum(len(f) * len(b) for _, _, b, f in claim)} runs, "
    f"{multiples[0]} to {multiples[-1]} times as long as the search's; measured times are in the "
    "results' sessions. The ci preset takes seconds."
  )
  return records.run_resumable(
    argv, __doc__, epilog, PRESETS, DEFAULT_OUT, _job, budget_report.format_report
  )


if __name__ == "__main__":
  main()
