"""The random search: its draws, that each trial's settings reach the optimizer, choosing on
validation, resuming, and the paired table."""

import dataclasses
import math

import numpy as np
import pytest

pytest.importorskip("flax")

from helpers.recipes import TINY_SWEEP

from optax_lamb_recipes import presets, search, splits
from optax_lamb_recipes import train as train_lib

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)

TINY = search.SearchConfig("tiny", dataclasses.replace(TINY_SWEEP, seeds=(0,)), 2, (0, 1), group=1)


def test_trials_are_log_uniform_draws_in_the_spaces_the_same_every_time():
  for family, space in search.SPACES.items():
    trials = search.draw_trials(family, 16, 200)
    assert trials == search.draw_trials(family, 16, 200)
    assert trials != search.draw_trials(family, 512, 200)
    drawn = {
      "factor": [t["factor"] for t in trials],
      "warmup_frac": [t["warmup_frac"] for t in trials],
      "one_minus_b2": [1 - t["b2"] for t in trials],
      "weight_decay": [t["weight_decay"] for t in trials],
      "eps": [t["eps"] for t in trials],
    }
    for name, (lo, hi) in space.items():
      logs = np.log(drawn[name])
      assert np.all((logs >= math.log(lo) - 1e-9) & (logs <= math.log(hi) + 1e-9)), name
      # uniform in the log: each half of the log range holds about half of the draws
      assert 70 < np.sum(logs < (math.log(lo) + math.log(hi)) / 2) < 130, name
    if "eps" not in space:
      assert set(drawn["eps"]) == {search.FIXED_EPS}


def _train(trials, lrs):
  cfg = TINY.sweep
  train_data, val, _, _ = splits.load_data(cfg, 0)
  trainer = train_lib.Trainer(cfg.model, micro=cfg.micro, seed=0)
  phases = presets.phases_for(cfg, 16, lrs[0])
  return trainer.run("lamb", lrs, phases, train_data, val, evals_per_phase=cfg.evals, trials=trials)


def test_each_trial_trains_with_its_own_settings():
  cfg = TINY.sweep
  steps = presets.phases_for(cfg, 16, 1.0)[0].steps
  default = train_lib.OptimizerConfig()
  warmup = presets.phases_for(cfg, 16, 1.0)[0].warmup_steps
  as_default = {
    "warmup_frac": warmup / steps, "b2": default.b2, "eps": default.eps,
    "weight_decay": default.weight_decay,
  }  # fmt: skip
  other_b2 = as_default | {"b2": 0.5}
  late = as_default | {"warmup_frac": 0.5}
  lr = presets.base_lrs(cfg, 16)["lamb"]
  plain, with_b2, with_warmup = _train([as_default, other_b2, late], [lr, lr, lr])
  train_data, val, _, _ = splits.load_data(cfg, 0)
  trainer = train_lib.Trainer(cfg.model, micro=cfg.micro, seed=0)
  (untried,) = trainer.run(
    "lamb", [lr], presets.phases_for(cfg, 16, lr), train_data, val, evals_per_phase=cfg.evals
  )
  np.testing.assert_allclose(plain.held_out, untried.held_out, rtol=1e-6)
  assert np.max(np.abs(np.subtract(with_b2.held_out, plain.held_out))) > 1e-3
  assert int(np.argmax(with_warmup.lr)) == round(0.5 * steps)
  assert int(np.argmax(plain.lr)) == warmup


def test_search_chooses_on_validation_trains_the_choice_on_every_seed_and_resumes(tmp_path):
  out = str(tmp_path / "search.json")
  first = search.run_search(TINY, out=out)
  edges = (min(TINY_SWEEP.batches), max(TINY_SWEEP.batches))
  assert len(first["runs"]) == 2 * 2 * (TINY.trials + 1)  # 2 optimizers x 2 batches
  for c in first["chosen"]:
    cell = [
      r
      for r in first["runs"]
      if (r["seed"], r["family"], r["batch"]) == (0, c["family"], c["batch"])
    ]
    best = min(cell, key=lambda r: r["validation"][-1])
    assert c["trial"] == best["trial"] and c["batch"] in edges
    again = [
      r
      for r in first["runs"]
      if (r["seed"], r["family"], r["batch"]) == (1, c["family"], c["batch"])
    ]
    assert [r["trial"] for r in again] == [c["trial"]]
    assert again[0]["peak_lr"] == pytest.approx(best["peak_lr"])
  # a run stopped after some groups: the rest is trained, the rest identical to the first time
  partial = dict(first, runs=first["runs"][:3], sessions=first["sessions"])
  resumed = search.run_search(TINY, out=str(tmp_path / "again.json"), previous=partial)
  key = lambda r: (r["seed"], r["family"], r["batch"], r["trial"])
  assert sorted(map(key, resumed["runs"])) == sorted(map(key, first["runs"]))
  want = {key(r): r["test_per_sequence"] for r in first["runs"]}
  for r in resumed["runs"][3:]:
    np.testing.assert_allclose(r["test_per_sequence"], want[key(r)], rtol=1e-5, err_msg=str(key(r)))
  assert len(resumed["sessions"]) == len(first["sessions"]) + 1


def test_table_pairs_lamb_and_adamw_by_seed_and_sequence():
  rng = np.random.default_rng(2)
  shared = rng.normal(0, 1.0, (5, 1)) + rng.normal(0, 1.0, (1, 300))
  # AdamW's own noise: per sequence, centred in each seed, plus a spread of the seeds around 0.2
  # that averages to zero, so that the true difference is -0.2 exactly (a 95% interval around a
  # random draw's mean misses it one time in 20)
  noise = rng.normal(0, 0.01, (5, 300))
  noise += np.linspace(-0.002, 0.002, 5)[:, None] - noise.mean(axis=1, keepdims=True)
  tables = {"lamb": shared + 5.0, "adamw": shared + 5.2 + noise}
  runs = [
    {"family": f, "batch": 16, "trial": 3, "seed": s, "test_per_sequence": row.tolist()}
    for f, t in tables.items()
    for s, row in enumerate(t)
  ]
  chosen = [{"family": f, "batch": 16, "trial": 3} for f in tables]
  row = search.table({"chosen": chosen, "runs": runs})[16]
  d = row["difference"]
  assert d["low"] < -0.2 < d["high"] and d["high"] - d["low"] < 0.01
  assert row["lamb"]["high"] - row["lamb"]["low"] > 0.5  # unpaired, the shared effects stay
