"""The past-plateau search: its spaces and stratified draws, the job end to end on the ci preset,
and its summaries."""

import math

import numpy as np
import pytest

pytest.importorskip("flax")

from optax_lamb_recipes import plateau, search

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)


def test_only_adamws_warmup_range_is_wider_than_the_searchs():
  assert plateau.SPACES["lamb"] == search.SPACES["lamb"]
  adamw = dict(plateau.SPACES["adamw"])
  lo, hi = adamw.pop("warmup_frac")
  assert (lo, hi) == (search.SPACES["adamw"]["warmup_frac"][0], 0.9) and hi > 0.5
  assert adamw == {k: v for k, v in search.SPACES["adamw"].items() if k != "warmup_frac"}
  cfg = plateau.PRESETS["claim"]
  assert cfg.batches == (512,) and cfg.trials >= 12 and len(cfg.seeds) == 3 and cfg.keep_ratios
  assert cfg.sweep.samples == 4 * search.PRESETS["claim"].sweep.samples


@pytest.mark.parametrize("family", ["lamb", "adamw"])
def test_stratified_draws_put_one_trial_in_each_stratum_of_every_log_range(family):
  cfg = plateau.PRESETS["claim"]
  trials = cfg.draw(family, 512)
  assert trials == cfg.draw(family, 512) and trials != search.draw_trials(family, 512, 12)
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
  assert len(results["runs"]) == 2 * (cfg.trials + len(cfg.seeds) - 1)
  assert all(("trust_ratios" in r) == (r["family"] == "lamb") for r in results["runs"])
  assert results["search"]["stratified"] and results["search"]["spaces"] == plateau.SPACES
  steps = plateau.format_steps(results)
  assert steps.count("\n") == 1 + len(plateau.TARGETS)
  assert plateau.main(["--preset", "ci", "--out", out])["runs"] == results["runs"]  # resumed


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
