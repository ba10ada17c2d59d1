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

import numpy as np

from optax_lamb_recipes import analysis, presets, records, search
from optax_lamb_recipes.presets import FAMILIES


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
  name: str
  search: str  # the random search's results JSON ("": a fresh ci search, for CI)
  # (multiple of the search's samples, seed, batches), in training order
  runs: tuple[tuple[int, int, tuple[int, ...]], ...]


PRESETS = {
  # The longest budget on seed 0 (is 4x flat? 8x says), more seeds at 4x, then the curve's shape.
  "claim": BudgetConfig(
    "claim",
    os.path.join("notebooks", "results", "search.json"),
    runs=(
      (4, 0, (16, 512)),
      (8, 0, (16, 512)),
      (4, 1, (16, 512)),
      (4, 2, (16, 512)),
      (2, 0, (16, 512)),
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

  for multiple, seed, batches in cfg.runs:
    longer = dataclasses.replace(scfg, samples=scfg.samples * multiple)
    for (family, b), s in sorted(settings.items(), key=lambda kv: FAMILIES.index(kv[0][0])):
      if b in batches and (multiple, seed, family, b) not in have:
        search.train_trials(
          longer, seed, family, b, {s["trial"]: s["hyper"]}, 1, lambda g, m=multiple: save(g, m)
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


def _all_runs(results: dict) -> list[dict]:
  return results["search_runs_at_1x"] + results["runs"]


def losses(results: dict, family: str, batch: int, multiple: int) -> tuple[list[int], np.ndarray]:
  """``(seeds, L)``: L[i, q], the final loss on test sequence q with seeds[i]."""
  at = sorted(
    (r for r in _all_runs(results) if (r["family"], r["batch"], r["multiple"]) == (family, batch, multiple)),
    key=lambda r: r["seed"],
  )  # fmt: skip
  return [r["seed"] for r in at], np.array([r["test_per_sequence"] for r in at], float)


def table(results: dict) -> dict[tuple[int, int], dict[str, dict]]:
  """``(batch, multiple)`` -> ``lamb``, ``adamw`` and ``difference`` (LAMB minus AdamW, paired on
  the seeds both have): each a mean with its 95% interval, over at most the seeds of the longer
  runs (the search's extra seeds at 1x are left out, so that every budget has the same seeds)."""
  seeds = {s for _, s, _ in results["budget"]["runs"]}
  out = {}
  batches = sorted({c["batch"] for c in results["chosen"]})
  multiples = sorted({1} | {m for m, _, _ in results["budget"]["runs"]})
  for b in batches:
    for m in multiples:
      row = analysis.paired(losses(results, "lamb", b, m), losses(results, "adamw", b, m), seeds)
      if row is not None:
        out[b, m] = row
  return out


def _run(results: dict, family: str, batch: int, multiple: int, seed: int) -> dict | None:
  key = (family, batch, multiple, seed)
  return next(
    (r for r in _all_runs(results) if (r["family"], r["batch"], r["multiple"], r["seed"]) == key),
    None,
  )


def last_change(results: dict, family: str, batch: int, multiple: int, seed: int) -> float | None:
  """Test loss at the end minus test loss at 80% of the samples (one run): how flat the end is."""
  run = _run(results, family, batch, multiple, seed)
  if run is None:
    return None
  samples = np.asarray(run["samples"], float)
  at = int(np.argmin(np.abs(samples - 0.8 * samples[-1])))
  return run["test"][-1] - run["test"][at]


def format_table(results: dict) -> str:
  """Markdown: per batch and budget, each optimizer's final test loss and the paired difference,
  and the last 20% of seed 0's test curve."""
  spc = results["config"]["samples"]
  lines = [
    "| batch | samples | LAMB | AdamW | LAMB minus AdamW | seeds | last 20%: LAMB / AdamW |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for (b, m), row in table(results).items():
    d = row["difference"]
    ends = [last_change(results, f, b, m, 0) for f in FAMILIES]
    cells = analysis.loss_cell(row["lamb"]), analysis.loss_cell(row["adamw"])
    end = " / ".join("n/a" if e is None else f"{e:+.3f}" for e in ends)
    lines.append(
      analysis.markdown_row(
        [b, f"{m} x {spc:,}", *cells, analysis.difference_cell(d), d["seeds"], end]
      )
    )
  return "\n".join(lines)


def gain_kept(results: dict) -> dict[int, dict[str, float]]:
  """Multiple -> family -> share of batch 16's gain over the unigram baseline kept at the largest
  batch: (baseline - L_max) / (baseline - L_min), from the means of ``table``."""
  base, rows = analysis.baseline(results), table(results)
  if base is None:
    return {}
  b_min, b_max = min(b for b, _ in rows), max(b for b, _ in rows)
  out = {}
  for m in sorted({m for _, m in rows}):
    if (b_min, m) in rows and (b_max, m) in rows:
      out[m] = {
        f: (base - rows[b_max, m][f]["mean"]) / (base - rows[b_min, m][f]["mean"]) for f in FAMILIES
      }
  return out


def findings(results: dict) -> list[str]:
  """Sentences: how much batch 16 still gains from the longest budgets, where LAMB minus AdamW
  lies at each budget, and the share of batch 16's gain kept at the largest batch."""
  rows = table(results)
  b_min = min(b for b, _ in rows)
  multiples = sorted(m for b, m in rows if b == b_min)
  out = []
  if len(multiples) >= 2:
    m1, m2 = multiples[-2], multiples[-1]
    ends = {f: [_run(results, f, b_min, m, 0) for m in (m1, m2)] for f in FAMILIES}
    steps = ", ".join(
      f"{f} {b['test'][-1] - a['test'][-1]:+.3f}" for f, (a, b) in ends.items() if a and b
    )
    out.append(
      f"Batch {b_min}, final test loss at {m2}x minus at {m1}x the samples (seed 0): {steps} nats."
    )
  for m in multiples:
    by_batch = {b: row["difference"] for (b, mm), row in rows.items() if mm == m}
    n = min(d["seeds"] for d in by_batch.values())
    out.append(
      f"At {m}x the samples ({n} seed{'s' if n > 1 else ''}): {analysis.sides_of_zero(by_batch)}."
    )
  kept = gain_kept(results)
  if kept:
    out.append(
      "Share of batch 16's gain over the unigram baseline kept at the largest batch: "
      + "; ".join(
        f"{m}x: " + ", ".join(f"{f} {v:.0%}" for f, v in shares.items())
        for m, shares in kept.items()
      )
      + "."
    )
  return out


def format_compute(results: dict) -> str:
  sessions = results["sessions"]
  m = sessions[-1]["machine"]
  return (
    f"{len(results['runs'])} runs (the search's chosen settings, 1 x = "
    f"{results['config']['samples']:,} samples), {results['wall_seconds'] / 60:.0f} min wall and "
    f"{results['cpu_seconds'] / 60:.0f} min CPU in {len(sessions)} session(s) on {m['cpus']} "
    f"CPUs ({m['cpu']}), {sessions[-1]['date']}"
  )


def format_report(results: dict) -> str:
  return (
    format_table(results)
    + "\n\n"
    + " ".join(findings(results))
    + "\n\n"
    + format_compute(results)
    + "."
  )


def _job(preset: str, out: str, previous: dict | None) -> dict:
  cfg = PRESETS[preset]
  ci_search = lambda: search.run_search(search.PRESETS["ci"], out="search_ci.json")
  return run_budget(cfg, records.input_results(cfg.search, ci_search), out=out, previous=previous)


def main(argv=None):
  epilog = (
    "The claim preset trains 20 runs, 2 to 8 times as long as the search's; measured times are "
    "in the results' sessions. The ci preset takes seconds."
  )
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, _job, format_report)


if __name__ == "__main__":
  main()
