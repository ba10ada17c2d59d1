"""The sweep's protocol: tune on validation with the first seed, report test over seeds; reuse."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("flax")

from helpers.recipes import TINY_SWEEP as _TINY_SWEEP

from optax_lamb_recipes import presets, report, splits, sweep

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tuning_run(family, batch, factor, validation, test):
  return {
    "family": family, "batch": batch, "factor": factor, "seed": 0,
    "validation": [9.0, validation], "test": [9.0, test],
  }  # fmt: skip


def test_choose_factors_uses_validation_not_test():
  cfg = dataclasses.replace(_TINY_SWEEP, lamb_grid=(0.5, 1.0, 2.0), adamw_grid=(0.5, 1.0))
  # (family, batch, factor): (validation, test); test ranks the other way round everywhere
  losses = {
    ("lamb", 16, 0.5): (1.0, 3.0), ("lamb", 16, 1.0): (2.0, 2.0), ("lamb", 16, 2.0): (None, 1.0),
    ("lamb", 32, 0.5): (3.0, 1.0), ("lamb", 32, 1.0): (2.0, 2.0), ("lamb", 32, 2.0): (1.0, 3.0),
    ("adamw", 16, 0.5): (2.0, 1.0), ("adamw", 16, 1.0): (1.0, 2.0),
    ("adamw", 32, 0.5): (1.0, 2.0), ("adamw", 32, 1.0): (2.0, 1.0),
  }  # fmt: skip
  runs = [_tuning_run(*k, *v) for k, v in losses.items()]
  runs.append({**_tuning_run("lamb", 32, 0.5, 0.0, 0.0), "seed": 1})  # other seeds don't tune
  assert report.choose_factors(dataclasses.asdict(cfg), runs) == {
    "LAMB tuned at B_min": [0.5, 0.5],  # the best at the smallest batch, sqrt-scaled up
    "LAMB tuned at B_max": [2.0, 2.0],  # the best at the largest batch, sqrt-scaled down
    "LAMB retuned per batch": [0.5, 2.0],
    "AdamW tuned at B_min": [1.0, 1.0],
    "AdamW tuned at B_max": [0.5, 0.5],
    "AdamW retuned per batch": [1.0, 0.5],
  }


def test_summary_mean_spread_and_diverged_seeds():
  cfg = dataclasses.replace(_TINY_SWEEP, batches=(16,), seeds=(0, 1, 2))
  tests = {"lamb": [5.0, 5.2, None], "adamw": [4.0, 4.5, 4.1]}
  runs = [
    {"family": f, "batch": 16, "factor": 1.0, "seed": s, "steps": 8, "peak_lr": 0.1, "test": [t]}
    for f, ts in tests.items()
    for s, t in enumerate(ts)
  ]
  factors = {a: [1.0] for a in report.ARMS}
  (row,) = report.summarize(
    {"config": dataclasses.asdict(cfg), "runs": runs, "chosen_factors": factors}
  )
  assert (
    row["LAMB tuned at B_min"]["test"] == [5.0, 5.2, None]
    and row["LAMB tuned at B_min"]["diverged"] == 1
  )
  assert row["LAMB tuned at B_min"]["mean"] == pytest.approx(5.1)
  assert row["LAMB tuned at B_min"]["std"] == pytest.approx(np.std([5.0, 5.2], ddof=1))
  assert row["AdamW retuned per batch"]["mean"] == pytest.approx(np.mean(tests["adamw"]))
  assert row["AdamW retuned per batch"]["std"] == pytest.approx(np.std(tests["adamw"], ddof=1))
  assert row["LAMB tuned at B_min"][
    "at_grid_edge"
  ]  # 1.0 is the top of the tiny lamb_grid (0.5, 1.0)
  assert "5.100 ± 0.141 (1 diverged)" in report.format_cell(row["LAMB tuned at B_min"])


def test_epochs_visit_every_sequence_once_per_pass_with_fresh_masks():
  seqs = np.arange(5, 15, dtype=np.int32)[:, None] + np.zeros((1, 20), np.int32)
  out = splits._epochs(seqs, 25, np.random.default_rng(0), mask_id=4, vocab_size=20)
  firsts = np.take_along_axis(out.targets, np.zeros((25, 1), int), 1)[:, 0]
  for p in range(2):
    assert sorted(firsts[10 * p : 10 * p + 10]) == list(range(5, 15))
  assert len(firsts) == 25
  by_seq = {}
  for row, pos in zip(firsts, out.positions, strict=True):
    by_seq.setdefault(int(row), []).append(tuple(pos))
  assert any(len(set(v)) > 1 for v in by_seq.values())  # re-masked on the second pass


def test_eval_splits_do_not_depend_on_the_seed():
  tr0, val0, test0, _ = splits.load_data(_TINY_SWEEP, 0)
  tr1, val1, test1, _ = splits.load_data(_TINY_SWEEP, 1)
  n = _TINY_SWEEP.seq_len
  for a, b in ((val0, val1), (test0, test1)):
    for x, y in zip(a[n], b[n], strict=True):
      np.testing.assert_array_equal(x, y)
  assert not np.array_equal(val0[n].inputs, test0[n].inputs)
  assert not np.array_equal(tr0[n].inputs, tr1[n].inputs)


def test_run_sweep_tunes_on_the_first_seed_and_reruns_the_choices():
  res = sweep.run_sweep(_TINY_SWEEP, progress=False)
  cfg, factors = _TINY_SWEEP, res["chosen_factors"]
  first = [r for r in res["runs"] if r["seed"] == 0]
  assert len(first) == len(cfg.batches) * (len(cfg.lamb_grid) + len(cfg.adamw_grid))
  for j, b in enumerate(cfg.batches):
    for family in ("lamb", "adamw"):
      chosen = {factors[a][j] for a in report.ARMS if report.FAMILY[a] == family}
      again = [r for r in res["runs"] if (r["seed"], r["family"], r["batch"]) == (1, family, b)]
      assert sorted(r["factor"] for r in again) == sorted(chosen)
  assert all(len(r["test"]) == len(r["validation"]) == cfg.evals for r in res["runs"])
  for row in res["summary"]:
    assert all(len(row[a]["test"]) == len(cfg.seeds) for a in report.ARMS)
  assert report.format_table(res).count("\n|") == len(cfg.batches) + 1
  # a wider grid reuses every run already made and trains only the new factor
  wider = dataclasses.replace(cfg, adamw_grid=(0.5, *cfg.adamw_grid))
  more = sweep.run_sweep(wider, progress=False, previous=res)
  assert all(r in more["runs"] for r in res["runs"])
  new = [r for r in more["runs"] if r not in res["runs"]]
  assert {r["factor"] for r in new if r["seed"] == 0} == {0.5}
  assert len(more["sessions"]) == 2


def test_reuse_takes_only_runs_of_the_same_sweep_and_grid():
  previous = {
    "config": json.loads(json.dumps(dataclasses.asdict(_TINY_SWEEP))),
    "runs": [
      {"seed": 0, "family": "lamb", "factor": 0.5},
      {"seed": 0, "family": "lamb", "factor": 4.0},  # not in the new grid
      {"seed": 7, "family": "adamw", "factor": 1.0},  # not a seed of the new sweep
      {"seed": 1, "family": "adamw", "factor": 2.0},
    ],
  }
  wider = dataclasses.replace(_TINY_SWEEP, lamb_grid=(0.25, 0.5, 1.0))
  assert sweep._reusable_runs(wider, previous) == [previous["runs"][0], previous["runs"][3]]
  with pytest.raises(ValueError, match=r"differ from this sweep in \['samples'\]"):
    sweep._reusable_runs(dataclasses.replace(wider, samples=256), previous)
  with pytest.raises(ValueError, match="tuned on seed 0, not 1"):
    sweep._reusable_runs(dataclasses.replace(wider, seeds=(1, 0)), previous)


@pytest.mark.parametrize("quick", ["", "1"])
def test_help_shows_each_options_default_and_never_none(quick, monkeypatch, capsys):
  monkeypatch.setenv("LAMB_QUICK", quick)
  with pytest.raises(SystemExit):
    sweep.main(["--help"])
  text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
  cfg = presets.PRESETS[presets.default_preset()]
  assert "(default: None)" not in text and "(default: False)" not in text
  assert f"the preset (default: {cfg.name})" in text
  batches = " ".join(str(b) for b in cfg.batches)
  assert f"override the batch sizes (default: the preset's; {cfg.name}: {batches})" in text


def _summarized(factors: dict, tests: dict) -> dict:
  """A one-seed sweep at batches 16 and 32 whose arms chose ``factors``; ``tests``:
  (family, batch, factor) -> final test loss."""
  cfg = dataclasses.replace(_TINY_SWEEP, seeds=(0,), lamb_grid=(0.5, 1.0), adamw_grid=(0.5, 1.0))
  runs = [
    {"family": f, "batch": b, "factor": x, "seed": 0, "steps": 64 // b, "peak_lr": x, "test": [t]}
    for (f, b, x), t in tests.items()
  ]
  results = {"config": dataclasses.asdict(cfg), "runs": runs, "chosen_factors": factors}
  results["data"] = {"unigram_loss": {str(cfg.seq_len): 6.0}}
  results["summary"] = report.summarize(results)
  return results


def test_table_merges_the_protocols_that_chose_the_same_runs_and_flags_runs_that_did_not_learn():
  factors = {
    "LAMB tuned at B_min": [1.0, 1.0], "LAMB tuned at B_max": [1.0, 1.0],
    "LAMB retuned per batch": [1.0, 1.0],
    "AdamW tuned at B_min": [0.5, 0.5], "AdamW tuned at B_max": [1.0, 1.0],
    "AdamW retuned per batch": [0.5, 1.0],
  }  # fmt: skip
  tests = {
    ("lamb", 16, 1.0): 5.5, ("lamb", 32, 1.0): 5.6,
    ("adamw", 16, 0.5): 5.7, ("adamw", 32, 0.5): 5.95, ("adamw", 16, 1.0): 5.8,
    ("adamw", 32, 1.0): 5.92,
  }  # fmt: skip
  results = _summarized(factors, tests)
  assert list(report.columns(results)) == [
    "LAMB, every protocol", "AdamW tuned at B_min", "AdamW tuned at B_max",
    "AdamW retuned per batch",
  ]  # fmt: skip
  header = report.format_table(results).splitlines()[0]
  assert header.count("LAMB") == 1 and header.count("AdamW") == 3
  # 5.95 and 5.92 are within 0.1 nats of the baseline (6.0); 5.8 is not
  assert report.not_learned(results, 0.1) == [
    ("AdamW tuned at B_min", 32, 5.95), ("AdamW tuned at B_max", 32, 5.92),
    ("AdamW retuned per batch", 32, 5.92),
  ]  # fmt: skip
  said = sweep.learned_line(results)
  assert said.startswith("NOT LEARNED") and "AdamW tuned at B_min at B=32 (5.950)" in said
  factors["AdamW retuned per batch"] = [0.5, 0.5]  # now the same runs as tuned at B_min
  results = _summarized(factors, {k: v - 0.5 for k, v in tests.items()})
  assert "AdamW tuned at B_min = retuned per batch" in report.columns(results)
  assert sweep.learned_line(results).startswith("Every run in the table learned")
  results["data"]["unigram_loss"] = {results["config"]["seq_len"]: 6.0}  # a fresh run's int key
  assert sweep.learned_line(results).startswith("Every run in the table learned")
  text = sweep.caveats(results)
  assert "one seed, no interval" in text and "batch grows from 16 to 32" in text


MAIN_JOB_START = "<!-- the main job's output: tests/recipes/test_sweep.py runs it and compares -->"
MAIN_JOB_END = "<!-- end the main job's output -->"
LOSS = re.compile(r"\d+\.\d{3}(?= \(lr )")


def _committed_main_job_output() -> list[str]:
  with open(os.path.join(ROOT, "docs", "recipe.md")) as f:
    text = f.read()
  block = text.split(MAIN_JOB_START)[1].split(MAIN_JOB_END)[0]
  return [line for line in block.splitlines() if line and not line.startswith("```")]


def test_the_main_job_learns_in_every_cell_and_prints_the_committed_table(
  tmp_path, monkeypatch, capsys
):
  """The README's main job (the quick preset, minutes): a fresh run prints the table committed in
  docs/recipe.md (the same columns, steps and learning rates; losses within 0.01 nats, the
  rounding of float32 sums on other CPUs), says every run learned, and what the table cannot
  show."""
  monkeypatch.delenv("LAMB_QUICK", raising=False)
  monkeypatch.chdir(tmp_path)
  sweep.main(["--no-progress", "--plot", ""])
  printed = [line for line in capsys.readouterr().out.splitlines() if line]
  want = _committed_main_job_output()
  got = printed[printed.index(want[0]) : printed.index(want[0]) + len(want)]
  assert len(got) == len(want)
  for line, expected in zip(got, want, strict=True):
    assert LOSS.sub("x", line) == LOSS.sub("x", expected), line
    for a, b in zip(LOSS.findall(line), LOSS.findall(expected), strict=True):
      assert float(a) == pytest.approx(float(b), abs=0.01), line
  assert any(line.startswith("Every run in the table learned") for line in got)
  assert any(line.startswith("What it shows") for line in got)
