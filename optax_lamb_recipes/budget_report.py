"""The longer-training results (``budget.py``'s JSON) as tables and findings.

Verdicts (a side of zero, a median of the steps to a target) are printed only at the budgets
where every optimizer ran `analysis.MIN_SEEDS` seeds at both batches; elsewhere the tables show
the plain mean of one run. Steps to a target are medians over seeds with the bracket of the
evaluations around them (`steps`).
"""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes import analysis, records, report, steps
from optax_lamb_recipes.budget import entries
from optax_lamb_recipes.presets import FAMILIES


def _all_runs(results: dict) -> list[dict]:
  return results["search_runs_at_1x"] + results["runs"]


def losses(results: dict, family: str, batch: int, multiple: int) -> tuple[list[int], np.ndarray]:
  """``(seeds, L)``: L[i, q], the final loss on test sequence q with seeds[i]."""
  at = _runs(results, family, batch, multiple)
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


def run_at(results: dict, family: str, batch: int, multiple: int, seed: int) -> dict | None:
  key = (family, batch, multiple, seed)
  return next(
    (r for r in _all_runs(results) if (r["family"], r["batch"], r["multiple"], r["seed"]) == key),
    None,
  )


def last_change(results: dict, family: str, batch: int, multiple: int, seed: int) -> float | None:
  """Test loss at the end minus test loss at 80% of the samples (one run): how flat the end is."""
  run = run_at(results, family, batch, multiple, seed)
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


def _runs(results: dict, family: str, batch: int, multiple: int) -> list[dict]:
  key = (family, batch, multiple)
  return sorted(
    (r for r in _all_runs(results) if (r["family"], r["batch"], r["multiple"]) == key),
    key=lambda r: r["seed"],
  )


def seeded_multiples(results: dict) -> list[int]:
  """The budgets where every optimizer ran at least ``analysis.MIN_SEEDS`` seeds at both ends of
  the batch range: the only ones a verdict or a median is printed for."""
  ends = _batch_range(results)
  return [
    m
    for m in sorted({r["multiple"] for r in _all_runs(results)})
    if all(len(_runs(results, f, b, m)) >= analysis.MIN_SEEDS for f in FAMILIES for b in ends)
  ]


def steps_to_target(results: dict, family: str, batch: int, multiple: int, target: float):
  """`steps.median` over the seeds of ``family`` at ``batch`` and ``multiple``: the median
  optimizer steps until the test loss first reaches ``target``, with its bracket."""
  return steps.median(_runs(results, family, batch, multiple), target)


def _medians(results: dict, multiple: int, targets) -> dict[tuple[str, int, float], dict]:
  """``(family, batch, target)`` -> `steps_to_target` at both ends of the batch range."""
  return {
    (f, b, t): steps_to_target(results, f, b, multiple, t)
    for f in FAMILIES
    for b in _batch_range(results)
    for t in targets
  }


def format_steps_to_target(results: dict, targets=TARGETS) -> str:
  """Markdown: per target and budget with enough seeds (where some median reached the target)
  and optimizer, the median steps at the smallest and the largest batch, and their ratio."""
  b_min, b_max = _batch_range(results)
  lines = [
    f"| target | samples | optimizer | steps at B={b_min} | steps at B={b_max} "
    f"| B={b_min} / B={b_max} (perfect: {b_max // b_min}) |",
    "|---:|---:|---|---:|---:|---:|",
  ]
  spc = results["config"]["samples"]
  for m in seeded_multiples(results):
    got = _medians(results, m, targets)
    for target in targets:
      if not any(steps.reached(got[f, b, target]) for f in FAMILIES for b in (b_min, b_max)):
        continue
      for family in FAMILIES:
        small, big = got[family, b_min, target], got[family, b_max, target]
        cells = [steps.cell(small), steps.cell(big), steps.ratio_cell(steps.ratio(small, big))]
        label = report.OPTIMIZERS[family]
        lines.append(analysis.markdown_row([f"{target:.2f}", f"{m} x {spc:,}", label, *cells]))
  return "\n".join(lines)


def steps_findings(results: dict, targets=TARGETS) -> list[str]:
  """Per budget with enough seeds where some median reached a target, one sentence: the median
  steps that did, and where both batches did, how many times fewer the largest batch took, with
  the range its brackets allow."""
  b_min, b_max = _batch_range(results)
  out = []
  for m in seeded_multiples(results):
    got = _medians(results, m, targets)
    parts = []
    for f, t in ((f, t) for f in FAMILIES for t in targets):
      small, big = got[f, b_min, t], got[f, b_max, t]
      if r := steps.ratio(small, big):
        parts.append(f"{report.OPTIMIZERS[f]} to {t:.1f}: {steps.ratio_cell(r)}x fewer")
      parts += [
        f"{report.OPTIMIZERS[f]} to {t:.1f} at B={b}: {steps.cell(v)}"
        for b, v in ((b_min, small), (b_max, big))
        if steps.reached(v) and not r
      ]
    if not parts:
      continue
    spacing = [got[FAMILIES[0], b, targets[0]]["spacing"] for b in (b_min, b_max)]
    rest = "" if len(parts) == len(got) else "; no other median reached a target"
    out.append(
      f"Steps to a target at {m}x the samples (medians over seeds, bracketed by evaluations every "
      f"{spacing[0]:,.0f} steps at B={b_min} and {spacing[1]:,.0f} at B={b_max}; perfect scaling: "
      f"{b_max // b_min}x fewer at B={b_max}): {'; '.join(parts)}{rest}."
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


def budget_trend(results: dict, batch: int, seed: int = 0) -> str:
  """Per optimizer, ``seed``'s final test loss at ``batch`` at each budget, what the last
  doubling changed and how much the longest run still fell over its last 20%."""
  parts = []
  for family in FAMILIES:
    ends = [
      (m, run["test"][-1])
      for m in sorted({r["multiple"] for r in _all_runs(results)})
      if (run := run_at(results, family, batch, m, seed))
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
  """Sentences: batch 16's final loss at each budget (seed 0), where LAMB minus AdamW lies at the
  budgets with `analysis.MIN_SEEDS` seeds, divergences, and the steps to the targets."""
  rows = table(results)
  b_min = min(b for b, _ in rows)
  out = [budget_trend(results, b_min)]
  seeded = seeded_multiples(results)
  for m in seeded:
    by_batch = {b: row["difference"] for (b, mm), row in rows.items() if mm == m}
    n = min(d["seeds"] for d in by_batch.values())
    out.append(f"At {m}x the samples ({n} seeds): {analysis.sides_of_zero(by_batch)}.")
  fewer = sorted({m for _, m in rows} - set(seeded))
  if fewer:
    out.append(
      f"At {', '.join(f'{m}x' for m in fewer)} fewer than {analysis.MIN_SEEDS} seeds ran: no "
      "verdict (the seeds at 4x spread by up to 1.9 nats)."
    )
  bad = diverged(results)
  if bad:
    out.append(
      f"Diverged (test loss rose more than {DIVERGED_RISE} nats above its best): "
      + "; ".join(_diverged_run(results, r, worst) for r, worst in bad)
      + "."
    )
  return out + steps_findings(results)


def format_compute(results: dict) -> str:
  return (
    f"{len(results['runs'])} runs (the search's chosen settings, 1 x = "
    f"{results['config']['samples']:,} samples), {records.compute_used(results)}"
  )


def format_report(results: dict) -> str:
  """Markdown: the loss table, the steps to the targets, the findings, the compute."""
  sections = [format_table(results), format_steps_to_target(results), " ".join(findings(results))]
  return "\n\n".join(sections + [format_compute(results) + "."])
