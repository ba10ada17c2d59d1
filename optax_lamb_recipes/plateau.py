"""One comparison past the plateau: LAMB and AdamW searched alike at batch 512 with 4x the samples.

    python -m optax_lamb_recipes.plateau                # trains what past_plateau.json lacks
    LAMB_QUICK=1 python -m optax_lamb_recipes.plateau   # the CI preset (seconds), to plateau_ci.json

The equal-budget search (``search.py``) ran at the sweep's sample budget (76,800 sequences), where
every AdamW trial at batch 512 ended on the plateau of the token-frequency loss (5.93 nats). Here
both optimizers are searched again at batch 512 with 4x the samples (600 steps), where LAMB's
searched settings fell to 4.2-5.0 nats in the longer runs (``budget.py``), and the search is
built so that neither side is favoured:

- the same ranges for both (``SPACES``): the learning-rate factor on each optimizer's
  square-root-rule rate, the warm-up as a fraction of the steps (0.5% to 90%: a long warm-up is
  the usual remedy for Adam's early instability at large batch, Goyal et al. 2017; Nado et al.
  2021 search it for every optimizer), 1 - beta2, the weight decay and epsilon;
- 8 stratified draws each (a Latin hypercube: one draw in each eighth of every log range, from a
  generator of their own), then each optimizer's best known settings at this batch (``KNOWN``):
  the settings the 1x search chose (``budget.json``'s, which LAMB stretched to 4x reached 4.606
  with) and the trial the first past-plateau search chose (``plateau.json``, at 9d9c950's
  ``notebooks/results``);
- every trial trains seeds 0 and 1 and is chosen by its mean validation loss over both (one
  seed's validation picked a LAMB trial that a known setting beat on the same seed);
- the two chosen trials train seeds 2 to 4 as well, and are compared on the test split over the
  five seeds, paired by seed and test sequence (``analysis.t_interval``).

Trust ratios and relative steps per layer are recorded in every LAMB run (about 1 KB per layer).

CPU budget, written before the job started, from the wall times the committed files record (2
CPUs): a run at batch 512 with 600 steps took 124 to 144 s with the machine to itself
(``budget.json``, seeds 1 and 2) and up to 565 s beside other jobs. 46 runs (2 x 10 trials x 2
seeds, then 2 x 3 reruns) are about 100 min on a quiet 2-core machine and at most about 4 h at low
priority beside other work. The results file is written after every run; running the command
again resumes where it stopped (a run cut short trains again from its start).
"""

from __future__ import annotations

import dataclasses
import os

from optax_lamb_recipes import analysis, presets, records, report, search, steps
from optax_lamb_recipes.presets import FAMILIES

MULTIPLE = 4  # times the sweep's samples
SPACE = {
  "factor": (1 / 16, 8.0),
  "warmup_frac": (0.005, 0.9),
  "one_minus_b2": (1e-3, 1e-1),
  "weight_decay": (1e-3, 0.3),
  "eps": (1e-10, 1e-4),
}
SPACES = {family: SPACE for family in FAMILIES}  # the same ranges for both optimizers
# Each optimizer's best known settings at batch 512, trained as two more trials of its search:
# the 1x search's choice (budget.json's "chosen") and the first past-plateau search's choice
# (plateau.json, trial 7 for LAMB and 9 for AdamW). tests/recipes/test_plateau.py reads them back.
KNOWN = {
  "lamb": (
    {
      "factor": 0.4366434256222498,
      "warmup_frac": 0.36545673098448545,
      "b2": 0.9638982657498378,
      "weight_decay": 0.0022705879473048853,
      "eps": 1e-06,
    },
    {
      "factor": 0.3029290279665067,
      "warmup_frac": 0.16532838506245415,
      "b2": 0.9381870796787936,
      "weight_decay": 0.1406991419686405,
      "eps": 1e-06,
    },
  ),
  "adamw": (
    {
      "factor": 0.605151528816447,
      "warmup_frac": 0.009835505354556783,
      "b2": 0.9942834192802984,
      "weight_decay": 0.004934737649544069,
      "eps": 6.025939980217662e-06,
    },
    {
      "factor": 0.5575853047953807,
      "warmup_frac": 0.5135761965228441,
      "b2": 0.9835379582166482,
      "weight_decay": 0.018613655289501194,
      "eps": 5.958916290823848e-07,
    },
  ),
}
# CI's known trial: the centre of every log range (CI has no earlier search to take one from).
CENTRE = {k: (lo * hi) ** 0.5 for k, (lo, hi) in SPACE.items()}
KNOWN_CI = {
  f: (
    {
      "factor": CENTRE["factor"],
      "warmup_frac": CENTRE["warmup_frac"],
      "b2": 1 - CENTRE["one_minus_b2"],
      "weight_decay": CENTRE["weight_decay"],
      "eps": CENTRE["eps"],
    },
  )
  for f in FAMILIES
}


def _config(name: str, sweep: presets.SweepConfig, **kw) -> search.SearchConfig:
  longer = dataclasses.replace(sweep, samples=sweep.samples * MULTIPLE)
  return search.SearchConfig(
    name,
    longer,
    spaces=SPACES,
    stream=(MULTIPLE, 2),
    stratified=True,
    keep_ratios=True,
    select_seeds=2,
    **kw,
  )


PRESETS = {
  "claim": _config("past-plateau", presets.PRESETS["claim"], trials=8, seeds=(0, 1, 2, 3, 4),
                   group=1, batches=(512,), known=KNOWN),
  "ci": _config("plateau-ci", presets.PRESETS["ci"], trials=1, seeds=(0, 1), group=1,
                batches=(64,), known=KNOWN_CI),
}  # fmt: skip
DEFAULT_OUT = {
  "claim": os.path.join("notebooks", "results", "past_plateau.json"),
  "ci": "plateau_ci.json",
}


# A trial "left the plateau" when its final test loss ended this far below the token-frequency
# loss (nats; the test set's sampling error is about 0.03, the plateau's runs end within 0.1).
LEFT_BY = 0.5
TARGETS = (5.0, 4.5, 4.0)  # test losses below the plateau, for steps to a target


def trials_left(results: dict) -> dict[str, tuple[int, int]]:
  """Optimizer -> (trials whose final test loss ended `LEFT_BY` below the token-frequency loss,
  trials), on the first seed; empty where the data has no token-frequency loss (CI's)."""
  base = analysis.baseline(results)
  if base is None:
    return {}
  first = results["search"]["seeds"][0]
  out = {}
  for family in FAMILIES:
    runs = [r for r in results["runs"] if (r["seed"], r["family"]) == (first, family)]
    out[family] = sum(records.final(r, "test") < base - LEFT_BY for r in runs), len(runs)
  return out


def _chosen_runs(results: dict, family: str) -> list[dict]:
  """The runs (by seed) of ``family``'s chosen trial; none before all its trials have trained."""
  at = [c for c in results["chosen"] if c["family"] == family]
  if not at:
    return []
  key = (family, at[0]["batch"], at[0]["trial"])
  return sorted(
    (r for r in results["runs"] if (r["family"], r["batch"], r["trial"]) == key),
    key=lambda r: r["seed"],
  )


def format_steps(results: dict, targets=TARGETS) -> str:
  """Markdown: the median steps over seeds of each optimizer's chosen trial to each target, with
  the bracket of its evaluations."""
  lines = ["| target | LAMB | AdamW |", "|---:|---:|---:|"]
  for t in targets:
    cells = [steps.cell(steps.median(_chosen_runs(results, f), t)) for f in FAMILIES]
    lines.append(analysis.markdown_row([f"{t:.2f}", *cells]))
  return "\n".join(lines)


def findings(results: dict, targets=TARGETS) -> list[str]:
  """Sentences: how many trials left the plateau, where LAMB minus AdamW lies (with the seeds it
  rests on), the largest trust ratio of LAMB's chosen trial, and which optimizer surely reached
  each target in fewer steps."""
  left, out = trials_left(results), []
  if left:
    out.append(
      f"Trials whose final test loss ended more than {LEFT_BY} nats below the token-frequency "
      f"loss ({analysis.baseline(results):.2f}), seed {results['search']['seeds'][0]}: "
      + ", ".join(f"{report.OPTIMIZERS[f]} {k} of {n}" for f, (k, n) in left.items())
      + "."
    )
  table = search.table(results)
  if not table:
    return out
  (b,) = table
  d = table[b]["difference"]
  if d["seeds"] >= analysis.MIN_SEEDS:
    out.append(f"Both searched, {d['seeds']} seeds: {analysis.sides_of_zero({b: d})}.")
  ratios = [
    (max(max(v) for v in r["trust_ratios"].values()), r) for r in _chosen_runs(results, "lamb")
  ]
  if ratios:
    out.append(
      "Largest trust ratio of LAMB's chosen trial at the 100 recorded steps of each run: "
      + ", ".join(f"{x:.2f} (seed {r['seed']})" for x, r in ratios)
      + "."
    )
  for t in targets:
    lamb, adamw = (steps.median(_chosen_runs(results, f), t) for f in FAMILIES)
    if not (steps.reached(lamb) or steps.reached(adamw)):
      continue
    who = (
      "LAMB" if lamb["high"] < adamw["low"] else "AdamW" if adamw["high"] < lamb["low"] else None
    )
    said = f"{who} surely took fewer steps" if who else "the brackets overlap"
    out.append(f"To {t:.1f}: LAMB {steps.cell(lamb)}, AdamW {steps.cell(adamw)} steps ({said}).")
  return out


# What each known setting is (`KNOWN`'s order), for the verdict's account of the chosen trials.
KNOWN_SOURCES = ("the 1x search's choice, `budget.json`", "the first past-plateau search's choice")


def trial_source(results: dict, family: str) -> str:
  """Where ``family``'s chosen trial came from: a stratified draw, or one of its known settings."""
  (c,) = [c for c in results["chosen"] if c["family"] == family]
  drawn = results["search"]["trials"]
  if c["trial"] < drawn:
    return f"draw {c['trial'] + 1} of {drawn}"
  return f"known setting {c['trial'] - drawn + 1} ({KNOWN_SOURCES[c['trial'] - drawn]})"


def verdict(results: dict) -> str:
  """The recipe's first finding, from a fair search (both optimizers over the same ranges with
  their known settings among the trials, chosen on the selection seeds' validation, the pair on
  every seed): LAMB minus AdamW, its t-interval and per-seed values, the verdict, and where each
  chosen trial came from."""
  (b,) = results["search"]["batches"]
  d = search.table(results)[b]["difference"]
  tests = [records.final(r, "test") for f in FAMILIES for r in _chosen_runs(results, f)]
  selecting = search.selection_seeds_text(results)
  known = {f: len(k) for f, k in results["search"].get("known", {}).items()}
  words = analysis.side(d).replace("no difference resolved", "unresolved")
  base = analysis.baseline(results)
  against = "" if base is None else f" against the token-frequency loss {base:.2f}"
  return (
    f"Past the plateau (batch {b}, {MULTIPLE}x the sweep's samples, test losses {min(tests):.2f} to "
    f"{max(tests):.2f}{against}), LAMB minus AdamW: {analysis.difference_cell(d)} nats over {d['seeds']} seeds "
    f"(95% t-interval; each seed's), {words}. Both were searched over the same ranges: "
    f"{results['search']['trials']} stratified draws each plus its best known settings ("
    + ", ".join(f"{report.OPTIMIZERS[f]} {n}" for f, n in known.items())
    + f"), each chosen by its mean validation loss on seeds {selecting}: LAMB's chosen trial is "
    f"{trial_source(results, 'lamb')}, AdamW's {trial_source(results, 'adamw')}."
  )


def format_report(results: dict) -> str:
  """Markdown: the paired table, the findings, the steps to the targets, the chosen trials, the
  compute."""
  steps_table = "Steps to a test loss, median over seeds (evaluations around it):\n\n"
  selecting = search.selection_seeds_text(results)
  return "\n\n".join(
    [
      search.format_table(results),
      " ".join(findings(results)),
      steps_table + format_steps(results),
      f"The chosen trials (final validation loss, mean over seeds {selecting}):\n\n"
      + search.format_chosen(results),
      search.format_compute(results) + ".",
    ]
  )


def main(argv=None) -> dict:
  epilog = (
    "The claim preset trains 46 runs of 600 steps at batch 512 (20 trials on 2 seeds, then 6 "
    "reruns of the chosen ones); measured times are in the results' sessions. The ci preset takes seconds."
  )
  run = lambda preset, out, previous: search.run_search(PRESETS[preset], out=out, previous=previous)
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, run, format_report)


if __name__ == "__main__":
  main()
