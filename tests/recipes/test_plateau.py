"""The past-plateau search: its spaces and stratified draws, the job end to end on the ci preset,
and its summaries."""

import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("flax")

from optax_lamb_recipes import analysis, plateau, search

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)


def test_both_optimizers_search_the_same_ranges_with_their_known_settings_among_the_trials():
  assert plateau.SPACES["lamb"] == plateau.SPACES["adamw"]
  assert plateau.SPACES["lamb"]["warmup_frac"][1] >= 0.9  # long warm-ups for both
  cfg = plateau.PRESETS["claim"]
  assert cfg.batches == (512,) and cfg.select_seeds >= 2 and len(cfg.seeds) >= 5 and cfg.keep_ratios
  assert cfg.sweep.samples == 4 * search.PRESETS["claim"].sweep.samples
  for family in plateau.FAMILIES:
    trials = cfg.draw(family, 512)
    assert len(trials) == cfg.trials_of(family) == cfg.trials + len(plateau.KNOWN[family])
    assert trials[cfg.trials :] == list(plateau.KNOWN[family])


@pytest.mark.parametrize("family", ["lamb", "adamw"])
def test_the_known_settings_are_the_committed_searches_choices(family):
  """KNOWN holds budget.json's choice at batch 512 and plateau.json's chosen trial."""
  root = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "results")
  with open(os.path.join(root, "budget.json")) as f:
    budget = json.load(f)
  (at_1x,) = [c["hyper"] for c in budget["chosen"] if (c["family"], c["batch"]) == (family, 512)]
  path = os.path.join(root, "plateau.json")
  if not os.path.exists(path):  # the first past-plateau search, superseded: only the 1x choice
    assert plateau.KNOWN[family][0] == at_1x
    return
  with open(path) as f:
    first = json.load(f)
  (trial,) = [c["trial"] for c in first["chosen"] if c["family"] == family]
  (chosen,) = {
    json.dumps(r["hyper"], sort_keys=True)
    for r in first["runs"]
    if (r["family"], r["trial"]) == (family, trial)
  }
  assert list(plateau.KNOWN[family]) == [at_1x, json.loads(chosen)]


@pytest.mark.parametrize("family", ["lamb", "adamw"])
def test_stratified_draws_put_one_trial_in_each_stratum_of_every_log_range(family):
  cfg = plateau.PRESETS["claim"]
  trials = cfg.draw(family, 512)
  trials = trials[: cfg.trials]  # the draws (the known settings follow them)
  assert trials == cfg.draw(family, 512)[: cfg.trials]
  assert trials != search.draw_trials(family, 512, cfg.trials)
  drawn = {
    "factor": [t["factor"] for t in trials],
    "warmup_frac": [t["warmup_frac"] for t in trials],
    "one_minus_b2": [1 - t["b2"] for t in trials],
    "weight_decay": [t["weight_decay"] for t in trials],
    "eps": [t["eps"] for t in trials],
  }
  for name, (lo, hi) in plateau.SPACES[family].items():
    where = (np.log(drawn[name]) - math.log(lo)) / (math.log(hi) - math.log(lo))
    strata = np.floor(np.clip(where, 0, 1 - 1e-12) * len(trials)).astype(int)
    assert sorted(strata) == list(range(len(trials))), name


def test_the_ci_job_searches_one_batch_reruns_the_best_and_reports(tmp_path):
  out = str(tmp_path / "plateau.json")
  results = plateau.main(["--preset", "ci", "--out", out])
  cfg = plateau.PRESETS["ci"]
  assert {r["batch"] for r in results["runs"]} == set(cfg.batches)
  reruns = len(cfg.seeds) - cfg.select_seeds
  assert len(results["runs"]) == sum(
    cfg.select_seeds * cfg.trials_of(f) + reruns for f in plateau.FAMILIES
  )
  for c in results["chosen"]:  # the best mean validation over the selection seeds
    means = {}
    for r in results["runs"]:
      if r["family"] == c["family"] and r["seed"] in cfg.seeds[: cfg.select_seeds]:
        last = r["validation"][-1]
        means.setdefault(r["trial"], []).append(math.inf if last is None else last)
    assert c["trial"] == min(means, key=lambda t: np.mean(means[t]))
  assert all(("trust_ratios" in r) == (r["family"] == "lamb") for r in results["runs"])
  assert results["search"]["stratified"] and results["search"]["spaces"] == plateau.SPACES
  steps = plateau.format_steps(results)
  assert steps.count("\n") == 1 + len(plateau.TARGETS)
  assert plateau.main(["--preset", "ci", "--out", out])["runs"] == results["runs"]  # resumed
  said = plateau.verdict(results)
  (d,) = [row["difference"] for row in search.table(results).values()]
  assert analysis.difference_cell(d) in said and f"over {d['seeds']} seeds" in said
  for family in plateau.FAMILIES:
    assert plateau.trial_source(results, family) in said


def test_trial_source_names_a_draw_or_the_known_setting_it_was():
  results = {"search": {"trials": 8}, "chosen": [{"family": "lamb", "trial": 8},
                                                 {"family": "adamw", "trial": 3}]}  # fmt: skip
  assert plateau.trial_source(results, "lamb") == (f"known setting 1 ({plateau.KNOWN_SOURCES[0]})")
  assert plateau.trial_source(results, "adamw") == "draw 4 of 8"


def test_trials_left_counts_final_test_losses_below_the_baseline():
  base = 6.0
  finals = {"lamb": [5.0, 5.6, 5.4, None], "adamw": [5.9, 5.45, 6.1, 5.0]}
  runs = [
    {"seed": 0, "family": f, "batch": 512, "trial": i, "test": [6.2, x]}
    for f, xs in finals.items()
    for i, x in enumerate(finals[f])
  ]
  results = {"search": {"seeds": [0]}, "runs": runs, "config": {"seq_len": 32},
             "data": {"unigram_loss": {"32": base}}}  # fmt: skip
  want = {f: (sum(x is not None and x < base - plateau.LEFT_BY for x in xs), 4)
          for f, xs in finals.items()}  # fmt: skip
  assert plateau.trials_left(results) == want
