"""The claim study: which runs it trains, resuming, its paired intervals and the two-level
bootstrap (kept for one run's test-set sampling error; the verdicts use `analysis.t_interval`)."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("flax")

from helpers.recipes import TINY_SWEEP

from optax_lamb_recipes import analysis, report, study, sweep

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)


def test_bootstrap_means_are_the_resampled_tables_means():
  table = np.random.default_rng(3).normal(size=(4, 50))
  got = analysis.bootstrap(table, resamples=200, seed=7)
  # the same draws, resampled the plain way: rows, then columns of those rows
  rng = np.random.default_rng(7)
  rows, cols = rng.integers(0, 4, (200, 4)), rng.integers(0, 50, (200, 50))
  means = [table[np.ix_(r, c)].mean() for r, c in zip(rows, cols, strict=True)]
  lo, hi = np.quantile(means, [0.025, 0.975])
  assert (got["low"], got["high"]) == pytest.approx((lo, hi), rel=1e-12)
  assert got["mean"] == pytest.approx(table.mean()) and got["seeds"] == 4


def test_bootstrap_interval_has_the_width_of_the_sampling_error():
  sigma, n = 2.0, 4000  # one seed: only the test sequences vary
  table = np.random.default_rng(0).normal(5.0, sigma, (1, n))
  got = analysis.bootstrap(table)
  assert got["high"] - got["low"] == pytest.approx(2 * 1.96 * sigma / np.sqrt(n), rel=0.1)
  assert got["low"] < 5.0 < got["high"]


def _results_with(lamb: np.ndarray, adamw: np.ndarray) -> dict:
  """A study of one batch whose arms all report the tables ``lamb`` and ``adamw`` [seed, seq]."""
  runs = [
    {"family": fam, "batch": 16, "factor": 1.0, "seed": s, "test_per_sequence": row.tolist()}
    for fam, table in (("lamb", lamb), ("adamw", adamw))
    for s, row in enumerate(table)
  ]
  factors = {arm: [1.0] for arm in report.ARMS}
  data = {"unigram_loss": {"32": 6.0}}
  config = {"batches": [16], "seq_len": 32}
  return {"config": config, "data": data, "runs": runs, "tuning": {"chosen_factors": factors}}


def test_paired_difference_is_lamb_minus_adamw_and_pairing_removes_shared_noise():
  rng = np.random.default_rng(1)
  shared = rng.normal(0, 1.0, (5, 1)) + rng.normal(0, 1.0, (1, 300))  # seed and sequence effects
  lamb = shared + 5.0 + rng.normal(0, 0.01, (5, 300))
  adamw = shared + 5.1 + rng.normal(0, 0.01, (5, 300))
  results = _results_with(lamb, adamw)
  diff = analysis.paired_differences(results)["tuned at B_min"][16]
  assert diff["low"] < -0.1 < diff["high"] and diff["high"] < 0
  assert diff["high"] - diff["low"] < 0.01  # the shared effects cancel
  per_arm = analysis.arm_table(results)[report.arm_name("lamb", "tuned at B_min")][16]
  assert per_arm["high"] - per_arm["low"] > 0.5  # unpaired, they do not


def test_cells_train_every_arms_factor_and_extra_seeds_at_the_edges_only():
  factors = {arm: [1.0, 2.0, 4.0] for arm in report.ARMS}
  factors[report.arm_name("lamb", "tuned at B_max")] = [4.0, 4.0, 4.0]
  cfg = study.StudyConfig(name="t", tuning="", seeds=(0,), extra_seeds=(5,))
  got = study.cells(cfg, [16, 32, 64], factors)
  assert got[0][("lamb", 16)] == [1.0, 4.0] and got[0][("adamw", 32)] == [2.0]
  assert sorted(got[5]) == [("adamw", 16), ("adamw", 64), ("lamb", 16), ("lamb", 64)]


def test_study_resumes_and_reproduces_runs_bit_for_bit(tmp_path):
  tuning = json.loads(json.dumps(sweep.run_sweep(TINY_SWEEP, progress=False)))
  cfg = study.StudyConfig(name="t", tuning="", seeds=(0,), extra_seeds=(1,))
  out = str(tmp_path / "study.json")
  first = study.run_study(cfg, tuning, out=out)
  with open(out) as f:
    assert json.load(f)["runs"] == json.loads(json.dumps(first["runs"]))
  keys = [(r["seed"], r["family"], r["batch"], r["factor"]) for r in first["runs"]]
  assert len(keys) == len(set(keys)) and {k[0] for k in keys} == {0, 1}
  # a study killed after some groups: the next call trains only what is missing
  kept = dataclasses.replace(cfg)  # same study
  partial = {**first, "runs": first["runs"][:2]}
  again = study.run_study(kept, tuning, out=out, previous=partial)
  assert again["runs"][:2] == first["runs"][:2]
  by_key = lambda runs: {(r["seed"], r["family"], r["batch"], r["factor"]): r for r in runs}
  redone, orig = by_key(again["runs"]), by_key(first["runs"])
  assert redone.keys() == orig.keys()
  for k in orig:  # same seeds, same data order: the same losses on every test sequence
    assert redone[k]["test_per_sequence"] == orig[k]["test_per_sequence"], k
  assert len(again["sessions"]) == len(first["sessions"]) + 1
  # seed 0's runs of the study are the tuning sweep's runs, trained again (in groups of other
  # sizes: vmap over another number of learning rates may round differently in the last bits)
  tuned = by_key(tuning["runs"])
  for k, r in orig.items():
    if k[0] == 0:
      np.testing.assert_allclose(r["test"], tuned[k]["test"], rtol=1e-5, err_msg=str(k))


def test_findings_name_the_batches_by_the_side_of_zero_their_interval_lies_on():
  rng = np.random.default_rng(4)
  noise = rng.normal(0, 0.01, (3, 200))
  results = _results_with(5.0 + noise, 5.2 + noise)
  results["config"]["batches"] = [16, 64, 256]
  wide = rng.normal(0, 1.0, (3, 200))
  more = {64: (5.2 + noise, 5.0 + noise), 256: (5.0 + wide, 5.0 + wide[::-1])}
  for b, (lamb, adamw) in more.items():
    for fam, table in (("lamb", lamb), ("adamw", adamw)):
      results["runs"] += [
        {"family": fam, "batch": b, "factor": 1.0, "seed": s, "test_per_sequence": row.tolist()}
        for s, row in enumerate(table)
      ]
  for arm in report.ARMS:
    results["tuning"]["chosen_factors"][arm] = [1.0] * 3
  for line in analysis.findings(results):
    assert line.endswith(
      "LAMB better at B=16; AdamW better at B=64; no difference resolved at B=256."
    ), line


def test_steps_to_target_is_the_median_over_seeds_with_its_bracket():
  results = _results_with(np.zeros((3, 1)), np.zeros((3, 1)))
  curves = ([6.0, 5.0, 4.0], [6.0, 5.4, 4.2], [6.0, 5.9, 5.8])  # batch 16: steps 10, 20, 30
  for r, curve in zip(results["runs"][:3], curves, strict=True):
    r |= {"batch": 16, "samples": [160, 320, 480], "test": curve}
  for r in results["runs"][3:]:  # AdamW stays above every target
    r |= {"batch": 16, "samples": [160, 320, 480], "test": [6.0, 5.9, 5.8]}
  arm = report.arm_name("lamb", "retuned per batch")
  (got,) = analysis.steps_to_target(results, arm, 5.6).values()
  # seed 0 crosses 5.6 at 10 + 10 * 0.4 / 1.0, seed 1 at 10 + 10 * 0.4 / 0.6, seed 2 never
  crossings = [10 + 10 * 0.4 / 1.0, 10 + 10 * 0.4 / 0.6, np.inf]
  assert got["median"] == pytest.approx(np.median(crossings))
  assert (got["low"], got["high"]) == (10.0, 20.0)
  assert (got["reached"], got["seeds"], got["spacing"]) == (2, 3, 10.0)
  (never,) = analysis.steps_to_target(results, arm, 4.1).values()  # only seed 0 reaches 4.1
  assert never["median"] == np.inf and never["low"] == 30.0  # at least the runs' last step
  text = analysis.format_steps_to_target(results, targets=(5.6,))
  assert f"| 5.60 | LAMB | {np.median(crossings):.0f} (10-20, 2/3 seeds) |" in text
