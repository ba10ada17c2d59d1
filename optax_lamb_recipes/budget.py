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

from optax_lamb_recipes import analysis, presets, records, report, search
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
  seeds = {s for _, s, _, _ in entries(results["budget"]["runs"])}
  out = {}
  batches = sorted({c["batch"] for c in results["chosen"]})
  multiples = sorted({1} | {m for m, _, _, _ in entries(results["budget"]["runs"])})
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


# Test losses below the plateau (about 5.3 nats at batch 16) that the short budget never reaches.
TARGETS = (4.5, 4.0, 3.5)


def _batch_range(results: dict) -> tuple[int, int]:
  batches = [c["batch"] for c in results["chosen"]]
  return min(batches), max(batches)


def steps_to_target(results: dict, family: str, batch: int, target: float):
  """``(steps, multiple, seed)``: the fewest optimizer steps, over every run of ``family`` at
  ``batch`` (each budget and seed), until the test loss first reaches ``target`` (linear between
  evaluations), and the run that did it; None where none does. Shallue et al. (2019) take the
  best over tuned settings; here only the schedule's length and the seed vary."""
  got = []
  for r in _all_runs(results):
    if (r["family"], r["batch"]) == (family, batch):
      steps = np.asarray(r["samples"], float) / batch
      at = analysis.first_crossing(steps, records.curve(r, "test"), target)
      if at is not None:
        got.append((at, r["multiple"], r["seed"]))
  return min(got, default=None)


def _steps_at_both_ends(results: dict, family: str, target: float):
  """`steps_to_target` at the smallest and at the largest batch."""
  return tuple(steps_to_target(results, family, b, target) for b in _batch_range(results))


def format_steps_to_target(results: dict, targets=TARGETS) -> str:
  """Markdown: per target and optimizer, ``steps_to_target`` at the smallest and the largest batch,
  and how many times fewer steps the largest batch took (perfect scaling: the batch ratio)."""
  b_min, b_max = _batch_range(results)
  lines = [
    f"| target | optimizer | steps at B={b_min} (run) | steps at B={b_max} (run) "
    f"| B={b_min} steps / B={b_max} steps (perfect: {b_max // b_min}) |",
    "|---:|---|---:|---:|---:|",
  ]
  cell = lambda got: "never" if got is None else f"{got[0]:,.0f} ({got[1]}x, seed {got[2]})"  # noqa: E731
  for target in targets:
    for family in FAMILIES:
      small, big = _steps_at_both_ends(results, family, target)
      ratio = f"{small[0] / big[0]:.1f}" if small and big else "n/a"
      label = report.OPTIMIZERS[family]
      lines.append(analysis.markdown_row([f"{target:.2f}", label, cell(small), cell(big), ratio]))
  return "\n".join(lines)


def steps_findings(results: dict, targets=TARGETS) -> list[str]:
  """Per target, one sentence: how many times fewer steps the largest batch took than the smallest
  (``steps_to_target``), per optimizer, against perfect scaling."""
  b_min, b_max = _batch_range(results)
  out = []
  for target in targets:
    parts = []
    for family in FAMILIES:
      small, big = _steps_at_both_ends(results, family, target)
      if small and big:
        ratio = small[0] / big[0]
        said = f"{ratio:.1f}x fewer" if ratio >= 1 else f"{1 / ratio:.1f}x more"
      else:
        said = {(True, False): f"only B={b_min}", (False, True): f"only B={b_max}"}.get(
          (bool(small), bool(big)), "neither batch"
        )
      parts.append(f"{report.OPTIMIZERS[family]} {said}")
    out.append(
      f"Test loss {target:.1f} (fewest steps over the runs), B={b_max} against "
      f"B={b_min} (perfect scaling: {b_max // b_min}x fewer): {', '.join(parts)}."
    )
  return out


# A rise of the test loss this far above its best so far (nats; the test set's sampling error is
# about 0.03) is a divergence, not noise.
DIVERGED_RISE = 0.5


def diverged(results: dict, rise: float = DIVERGED_RISE) -> list[tuple[dict, float]]:
  """``(run, largest rise of its test loss above its best so far)`` of every run whose rise
  exceeds ``rise``, in the results' order."""
  out = []
  for r in _all_runs(results):
    test = records.curve(r, "test", missing=np.inf)  # a loss that stopped being finite diverged
    worst = float(np.max(test - np.minimum.accumulate(test)))
    if worst > rise:
      out.append((r, worst))
  return out


def _diverged_run(results: dict, run: dict, worst: float) -> str:
  """The diverged run, and how the same settings and budget did on the other seeds."""
  others = [
    r
    for r in _all_runs(results)
    if (r["family"], r["batch"], r["multiple"]) == (run["family"], run["batch"], run["multiple"])
    and r["seed"] != run["seed"]
  ]
  said = "".join(f", seed {r['seed']} ending at {r['test'][-1]:.3f}" for r in others)
  return (
    f"{report.OPTIMIZERS[run['family']]} B={run['batch']} {run['multiple']}x seed {run['seed']} "
    f"(+{worst:.2f}, ending at {run['test'][-1]:.3f}{said})"
  )


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


def budget_trend(results: dict, batch: int, seed: int = 0) -> str:
  """Per optimizer, ``seed``'s final test loss at ``batch`` at each budget, what the last
  doubling changed and how much the longest run still fell over its last 20%."""
  parts = []
  for family in FAMILIES:
    ends = [
      (m, run["test"][-1])
      for m in sorted({r["multiple"] for r in _all_runs(results)})
      if (run := _run(results, family, batch, m, seed))
    ]
    if not ends:
      continue
    line = ", ".join(f"{m}x {loss:.3f}" for m, loss in ends)
    (m1, l1), (m2, l2) = ends[-2] if len(ends) > 1 else ends[-1], ends[-1]
    if m1 != m2:
      line += f"; {m1}x to {m2}x: {l2 - l1:+.3f}"
    line += f"; last 20% of {m2}x: {last_change(results, family, batch, m2, seed):+.3f}"
    parts.append(f"{report.OPTIMIZERS[family]} {line}")
  return f"Batch {batch}, seed {seed}, final test loss by budget: " + "; ".join(parts) + " (nats)."


def findings(results: dict) -> list[str]:
  """Sentences: batch 16's final loss at each budget (is it still improving?), where LAMB minus
  AdamW lies at each budget, divergences, steps to the targets, and the share of batch 16's gain
  kept at the largest batch."""
  rows = table(results)
  b_min = min(b for b, _ in rows)
  multiples = sorted(m for b, m in rows if b == b_min)
  out = [budget_trend(results, b_min)]
  for m in multiples:
    by_batch = {b: row["difference"] for (b, mm), row in rows.items() if mm == m}
    n = min(d["seeds"] for d in by_batch.values())
    out.append(
      f"At {m}x the samples ({n} seed{'s' if n > 1 else ''}): {analysis.sides_of_zero(by_batch)}."
    )
  bad = diverged(results)
  if bad:
    out.append(
      f"Diverged (test loss rose more than {DIVERGED_RISE} nats above its best): "
      + "; ".join(_diverged_run(results, r, worst) for r, worst in bad)
      + "."
    )
  out += steps_findings(results)
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
  return (
    f"{len(results['runs'])} runs (the search's chosen settings, 1 x = "
    f"{results['config']['samples']:,} samples), {records.compute_used(results)}"
  )


def format_report(results: dict) -> str:
  """Markdown: the loss table, the steps to the targets, the findings, the compute."""
  sections = [format_table(results), format_steps_to_target(results), " ".join(findings(results))]
  return "\n\n".join(sections + [format_compute(results) + "."])


def _job(preset: str, out: str, previous: dict | None) -> dict:
  cfg = PRESETS[preset]
  ci_search = lambda: search.run_search(search.PRESETS["ci"], out="search_ci.json")
  return run_budget(cfg, records.input_results(cfg.search, ci_search), out=out, previous=previous)


def main(argv=None):
  claim = entries(PRESETS["claim"].runs)
  multiples = sorted({m for m, _, _, _ in claim})
  epilog = (
    f"The claim preset trains {sum(len(f) * len(b) for _, _, b, f in claim)} runs, "
    f"{multiples[0]} to {multiples[-1]} times as long as the search's; measured times are in the "
    "results' sessions. The ci preset takes seconds."
  )
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, _job, format_report)


if __name__ == "__main__":
  main()
