"""Longer training of the searched settings: the runs it trains, resuming, and its summaries."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("flax")

from helpers.recipes import TINY_SWEEP

from optax_lamb_recipes import budget, search
from optax_lamb_recipes import budget_report as report

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)

TINY_SEARCH = search.SearchConfig("tiny", dataclasses.replace(TINY_SWEEP, seeds=(0,)), 2, (0,), 2)
TINY = budget.BudgetConfig("tiny", "", runs=((2, 0, (16, 32)), (2, 1, (16,), ("adamw",))))


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
  return search.run_search(TINY_SEARCH, out=str(tmp_path_factory.mktemp("s") / "search.json"))


def test_trains_the_chosen_settings_longer_on_each_seed_and_resumes(searched, tmp_path):
  out = str(tmp_path / "budget.json")
  results = budget.run_budget(TINY, searched, out=out)
  chosen = budget.chosen_settings(searched)
  # the optimizers each entry names (both where it names none) at the batches it names
  assert len(chosen) == 4
  assert sorted((r["seed"], r["batch"], r["family"]) for r in results["runs"]) == [
    (0, 16, "adamw"), (0, 16, "lamb"), (0, 32, "adamw"), (0, 32, "lamb"), (1, 16, "adamw")
  ]  # fmt: skip
  for r in results["runs"]:
    (at_1x,) = [
      s
      for s in searched["runs"]
      if (s["family"], s["batch"], s["trial"], s["seed"])
      == (r["family"], r["batch"], chosen[r["family"], r["batch"]]["trial"], 0)
    ]
    assert r["hyper"] == at_1x["hyper"] and r["multiple"] == 2
    assert r["steps"] == 2 * at_1x["steps"] and r["samples"][-1] == 2 * at_1x["samples"][-1]
    assert r["peak_lr"] == pytest.approx(at_1x["peak_lr"])
    # the warm-up is the same fraction of the (longer) run: the peak at that step
    peak_at = r["lr_steps"][int(np.argmax(r["lr"]))]
    assert peak_at == max(1, round(r["hyper"]["warmup_frac"] * r["steps"]))
    # per-layer trust ratios (LAMB) and relative steps (both) are kept
    assert ("trust_ratios" in r) == (r["family"] == "lamb") and "relative_steps" in r
  partial = dict(results, runs=results["runs"][:2])
  resumed = budget.run_budget(TINY, searched, out=str(tmp_path / "again.json"), previous=partial)
  key = lambda r: (r["multiple"], r["seed"], r["family"], r["batch"])
  assert sorted(map(key, resumed["runs"])) == sorted(map(key, results["runs"]))
  want = {key(r): r["test_per_sequence"] for r in results["runs"]}
  for r in resumed["runs"][2:]:
    np.testing.assert_allclose(r["test_per_sequence"], want[key(r)], rtol=1e-5, err_msg=str(key(r)))


def _synthetic(rng):
  """A results dict of the budget's shape: 2 batches x 2 multiples x 2 optimizers x 3 seeds."""
  runs = []
  for b in (16, 512):
    for m in (1, 4):
      for f, shift in (("lamb", 0.0), ("adamw", 0.1)):
        for seed in range(3):
          per_seq = 5.0 + shift + b / 1000 - 0.05 * m + rng.normal(0, 0.5, 200)
          test = [6.0, 5.5, 5.3, 5.2, per_seq.mean()]
          runs.append(
            {"family": f, "batch": b, "multiple": m, "seed": seed, "trial": 0,
             "samples": [m * x for x in (10, 20, 30, 40, 50)], "test": test,
             "test_per_sequence": per_seq.tolist()}
          )  # fmt: skip
  return {
    "budget": {"runs": [[4, 0, [16, 512]], [4, 1, [16, 512]], [4, 2, [16, 512]]]},
    "config": {"seq_len": 32, "samples": 50},
    "data": {"unigram_loss": {"32": 6.0}},
    "chosen": [{"family": f, "batch": b, "trial": 0} for f in ("lamb", "adamw") for b in (16, 512)],
    "search_runs_at_1x": [r for r in runs if r["multiple"] == 1],
    "runs": [r for r in runs if r["multiple"] == 4],
  }


def test_table_differences_and_flatness_against_numpy():
  results = _synthetic(np.random.default_rng(0))
  rows = report.table(results)
  assert set(rows) == {(16, 1), (16, 4), (512, 1), (512, 4)}
  per = lambda f, b, m: np.array(
    [
      r["test_per_sequence"]
      for r in results["search_runs_at_1x"] + results["runs"]
      if (r["family"], r["batch"], r["multiple"]) == (f, b, m)
    ]
  )
  for (b, m), row in rows.items():
    assert row["lamb"]["mean"] == pytest.approx(per("lamb", b, m).mean())
    diff = row["difference"]
    assert diff["mean"] == pytest.approx((per("lamb", b, m) - per("adamw", b, m)).mean())
    assert diff["low"] < diff["mean"] < diff["high"] and diff["seeds"] == 3
  # the end of each curve: test loss at the end minus at 80% of the samples
  assert report.last_change(results, "lamb", 16, 4, 0) == pytest.approx(
    results["runs"][0]["test"][-1] - 5.2
  )
  assert report.last_change(results, "lamb", 16, 8, 0) is None
  text = report.format_table(results)
  assert text.count("\n") == 1 + len(rows)
  said = report.findings(results)
  assert any("LAMB better" in s for s in said)
  ends = {m: report.run_at(results, "adamw", 16, m, 0)["test"][-1] for m in (1, 4)}
  assert said[0].startswith("Batch 16, seed 0, final test loss by budget: LAMB 1x ")
  assert (
    f"AdamW 1x {ends[1]:.3f}, 4x {ends[4]:.3f}; 1x to 4x: {ends[4] - ends[1]:+.3f}; "
    f"last 20% of 4x: {report.last_change(results, 'adamw', 16, 4, 0):+.3f} (nats)."
  ) in said[0]


def test_command_line_resumes_a_finished_file_and_prints_its_report(
  searched, tmp_path, monkeypatch, capsys
):
  path = tmp_path / "search.json"
  path.write_text(json.dumps(searched))
  cfg = dataclasses.replace(TINY, search=str(path))
  out = str(tmp_path / "budget.json")
  budget.run_budget(cfg, searched, out=out)
  done = json.loads((tmp_path / "budget.json").read_text())
  monkeypatch.setitem(budget.PRESETS, "ci", cfg)
  again = budget.main(["--preset", "ci", "--out", out])
  assert again["runs"] == done["runs"] and again["sessions"] == done["sessions"]  # nothing trained
  printed = capsys.readouterr().out
  assert f"resuming {out}: {len(done['runs'])} runs done" in printed
  assert report.format_table(done) in printed and f"results: {out}" in printed
  # without --preset and LAMB_QUICK: the claim preset (the job has no quick one)
  monkeypatch.delenv("LAMB_QUICK", raising=False)
  monkeypatch.setitem(budget.PRESETS, "claim", cfg)
  assert budget.main(["--out", out])["runs"] == done["runs"]


def test_verdicts_and_intervals_only_where_three_seeds_ran():
  results = _synthetic(np.random.default_rng(0))
  one = [dict(r, multiple=8) for r in results["runs"] if r["seed"] == 0]  # 8x: seed 0 only
  results["runs"] += one
  results["budget"]["runs"].append([8, 0, [16, 512]])
  assert report.seeded_multiples(results) == [1, 4]
  rows = report.table(results)
  assert rows[16, 8]["difference"]["seeds"] == 1
  text = report.format_table(results)
  (line,) = [ln for ln in text.splitlines() if ln.startswith("| 16 | 8 x 50 |")]
  lamb = np.mean(one[0]["test_per_sequence"])
  assert line.startswith(f"| 16 | 8 x 50 | {lamb:.3f} | ") and "[" not in line  # no interval
  said = " ".join(report.findings(results))
  assert "At 4x the samples (3 seeds): " in said and "At 8x the samples" not in said
  assert "At 8x fewer than 3 seeds ran: no verdict" in said


def test_steps_to_target_is_the_median_over_seeds_at_each_budget():
  results = _synthetic(np.random.default_rng(0))
  # every run's curve passes 5.4 halfway between its 2nd and 3rd evaluation (samples 20 and 30
  # at 1x, 80 and 120 at 4x); at 4x, seed 0 of LAMB at batch 16 also reaches 3.0 at its last
  for b in (16, 512):
    for f in ("lamb", "adamw"):
      got = report.steps_to_target(results, f, b, 4, 5.4)
      assert got["median"] == pytest.approx(100 / b)
      assert (got["low"], got["high"]) == (80 / b, 120 / b) and got["reached"] == 3
      assert report.steps_to_target(results, f, b, 1, 1.0)["reached"] == 0
  run = next(r for r in results["runs"] if (r["family"], r["batch"], r["seed"]) == ("lamb", 16, 0))
  run["test"][-1] = 2.0
  one = report.steps_to_target(results, "lamb", 16, 4, 3.0)
  assert one["reached"] == 1 and one["median"] == np.inf  # one seed of three: no median
  text = report.format_steps_to_target(results, targets=(5.4, 3.0))
  # the ratio and the range the brackets allow: (80 / 16) / (120 / 512) to (120 / 16) / (80 / 512)
  want = f"32.0 ({80 / 16 / (120 / 512):.1f}-{120 / 16 / (80 / 512):.1f})"
  assert f"| 5.40 | 4 x 50 | LAMB | 6 (5-8) | 0 (0-0) | {want} |" in text
  assert "| 3.00 |" not in text  # no median reached 3.0
  said = report.steps_findings(results, targets=(5.4, 3.0))
  assert len(said) == 2 and f"LAMB to 5.4: {want}x fewer" in said[1]
  assert said[1].endswith("; no other median reached a target.")


def test_a_run_that_rises_far_above_its_best_is_reported_as_diverged():
  results = _synthetic(np.random.default_rng(0))
  assert report.diverged(results) == []  # the synthetic curves only fall
  run = next(r for r in results["runs"] if (r["family"], r["batch"]) == ("adamw", 512))
  run["test"] = [6.0, 4.0, 6.5, 5.9, 5.8]  # 2.5 above its best of 4.0
  ((got, rise),) = report.diverged(results)
  assert got is run and rise == pytest.approx(2.5)
  assert report.diverged(results, rise=3.0) == []
  run["test"] = [6.0, 4.0, None, None, None]  # the loss stopped being finite
  ((got, rise),) = report.diverged(results, rise=3.0)
  assert got is run and rise == np.inf
  run["test"] = [6.0, 4.0, 6.5, 5.9, 5.8]
  (said,) = [s for s in report.findings(results) if s.startswith("Diverged")]
  others = [r for r in results["runs"] if (r["family"], r["batch"]) == ("adamw", 512)][1:]
  assert "AdamW B=512 4x seed 0 (+2.50, ending at 5.800, seed 1 ending at " in said
  assert f"seed 2 ending at {others[1]['test'][-1]:.3f})" in said
