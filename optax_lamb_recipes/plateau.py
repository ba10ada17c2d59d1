"""One comparison past the plateau: the random search again at batch 512 with 4x the samples.

    python -m optax_lamb_recipes.plateau                # trains what notebooks/results/plateau.json lacks
    LAMB_QUICK=1 python -m optax_lamb_recipes.plateau   # the CI preset (seconds), to plateau_ci.json

The equal-budget search (``search.py``) ran at the sweep's sample budget (76,800 sequences), where
every AdamW trial at batch 512 ended on the plateau of the token-frequency loss (5.93 nats), so its
comparison there is between two optimizers that barely left it. Here the search runs again at
batch 512 only, with 4x the samples (600 steps), where the searched LAMB settings of the longer
runs (``budget.py``) fell to 4.2-5.0 nats: 12 trials per optimizer, scored on validation with
seed 0, then each optimizer's best trial on seeds 1 and 2, compared on the test split paired by
seed and test sequence (``analysis.t_interval``). Trust ratios and relative steps per layer are
recorded in every run (about 1 KB per layer and run).

The spaces are the search's, except AdamW's warm-up: 0.5% to 90% of the steps instead of 0.5% to
50%. AdamW's 12 draws at 1x had warm-ups of 0.7% to 23%; the six with a peak learning rate above
0.015 all ended within 0.014 nats above the token-frequency loss, and none left the plateau. A long
warm-up is the usual remedy for Adam's instability early in large-batch training (Goyal et al.
2017; Nado et al. 2021 search it for every optimizer), and LAMB's best trial at 1x warmed up over
37% of its steps, beyond every AdamW draw. The upper end, 90%, lets the learning rate rise over
almost the whole run and still decay over the last 10%; the lower end is kept so that the short
warm-ups stay in the space. The draws are fresh (a generator of their own, ``stream``) and
stratified (a Latin hypercube: one draw in each twelfth of every log range), so that twelve trials
cannot all land at one end of the warm-up range as the 1x draws did.

CPU budget, written before the job started, from the wall times the committed files record (2
CPUs, AMD EPYC): a run at batch 512 with 600 steps took 124 to 144 s when it had the machine to
itself (the budget's 4x runs on seeds 1 and 2, ``budget.json``) and 368 to 565 s beside another
job (seed 0); 150 steps took 36 to 42 s (the search's reruns, about 0.25 s a step). So 28 runs
(24 trials and 4 reruns, 16,800 steps) need about 60 min on a quiet 2-core machine, and at most
about 4 h of wall time at the lowest priority beside other jobs (2 CPUs, Intel Xeon, for this
job). The results file is written after every run; running the command again resumes where it
stopped (a run cut short trains again from its start).
"""

from __future__ import annotations

import dataclasses
import os

from optax_lamb_recipes import analysis, budget_report, presets, records, report, search, steps
from optax_lamb_recipes.presets import FAMILIES

MULTIPLE = 4  # times the sweep's samples
SPACES = {
  "lamb": search.SPACES["lamb"],
  "adamw": search.SPACES["adamw"] | {"warmup_frac": (0.005, 0.9)},
}


def _config(name: str, sweep: presets.SweepConfig, **kw) -> search.SearchConfig:
  longer = dataclasses.replace(sweep, samples=sweep.samples * MULTIPLE)
  return search.SearchConfig(
    name, longer, spaces=SPACES, stream=(MULTIPLE,), stratified=True, keep_ratios=True, **kw
  )


PRESETS = {
  "claim": _config("plateau", presets.PRESETS["claim"], trials=12, seeds=(0, 1, 2), group=1,
                   batches=(512,)),
  "ci": _config("plateau-ci", presets.PRESETS["ci"], trials=2, seeds=(0, 1), group=1,
                batches=(64,)),
}  # fmt: skip
DEFAULT_OUT = {
  "claim": os.path.join("notebooks", "results", "plateau.json"),
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


def _same_runs_but_samples(past: dict, longer: dict) -> int:
  """How many times ``longer``'s samples this search's runs have; ValueError unless the two
  files' data, model and splits agree (so that their runs pair by seed and test sequence)."""
  a, b = dict(past["config"]), dict(longer["config"])
  multiple = a.pop("samples") / b.pop("samples")
  a.pop("seeds"), b.pop("seeds")
  if a != b or past["data"] != longer["data"] or multiple != int(multiple):
    raise ValueError("plateau.json and budget.json differ in data, model or splits")
  return int(multiple)


def stretched_lamb(past: dict, longer: dict) -> dict:
  """The longer-training file's LAMB (its settings searched at 1x, the schedule stretched) at
  this search's batch and budget, set against this search's chosen trials on the same seeds:
  ``difference`` (that LAMB minus the chosen AdamW, a `analysis.t_interval` paired by seed and
  test sequence), ``chosen`` (the chosen LAMB minus the chosen AdamW, the same), and on the
  search's first seed the validation loss of that LAMB and of the chosen LAMB (``validation``)."""
  multiple = _same_runs_but_samples(past, longer)
  (batch,) = past["search"]["batches"]
  stretched = budget_report.losses(longer, "lamb", batch, multiple)
  lamb, adamw = (search.losses(past, f, batch) for f in FAMILIES)
  first = past["search"]["seeds"][0]
  chosen_lamb = next(r for r in _chosen_runs(past, "lamb") if r["seed"] == first)
  return {
    "batch": batch,
    "multiple": multiple,
    "difference": analysis.paired(stretched, adamw)["difference"],
    "chosen": analysis.paired(lamb, adamw)["difference"],
    "validation": {
      "stretched": records.final(budget_report.run_at(longer, "lamb", batch, multiple, first),
                                 "validation"),
      "chosen": records.final(chosen_lamb, "validation"),
      "seed": first,
    },
  }  # fmt: skip


def headline(past: dict, longer: dict) -> str:
  """The recipe's first finding: LAMB against AdamW past the plateau, from this search and from
  the longer-training file's LAMB at the same batch and budget, with the verdict of each."""
  got = stretched_lamb(past, longer)
  d, c, v = got["difference"], got["chosen"], got["validation"]
  tests = [records.final(r, "test") for f in FAMILIES for r in _chosen_runs(past, f)]
  than = "better than" if v["stretched"] < v["chosen"] else "no better than"
  words = lambda x: analysis.side(x).replace("no difference resolved", "unresolved")  # noqa: E731
  return (
    f"Past the plateau (batch {got['batch']}, {got['multiple']}x the samples, test losses "
    f"{min(tests):.2f} to {max(tests):.2f} against the token-frequency loss "
    f"{analysis.baseline(past):.2f}), LAMB minus AdamW, both searched with the same budget: "
    f"{analysis.difference_cell(c)} nats over {c['seeds']} seeds, {words(c)}. LAMB's settings "
    f"searched at 1x and stretched to {got['multiple']}x (`budget.json`) score "
    f"{v['stretched']:.3f} on seed {v['seed']}'s validation, {than} the search's chosen LAMB "
    f"({v['chosen']:.3f}); against the same AdamW: {analysis.difference_cell(d)} nats, {words(d)}."
  )


def format_report(results: dict) -> str:
  """Markdown: the paired table, the findings, the steps to the targets, the chosen trials, the
  compute."""
  steps_table = "Steps to a test loss, median over seeds (evaluations around it):\n\n"
  return "\n\n".join(
    [
      search.format_table(results),
      " ".join(findings(results)),
      steps_table + format_steps(results),
      "The chosen trials (validation loss with the first seed):\n\n"
      + search.format_chosen(results),
      search.format_compute(results) + ".",
    ]
  )


def main(argv=None) -> dict:
  epilog = (
    "The claim preset trains 28 runs of 600 steps at batch 512 (24 trials, then 4 reruns of the "
    "chosen ones); measured times are in the results' sessions. The ci preset takes seconds."
  )
  run = lambda preset, out, previous: search.run_search(PRESETS[preset], out=out, previous=previous)
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, run, format_report)


if __name__ == "__main__":
  main()
