"""The divergence replay: optax_lamb.lamb against optax's own LAMB chain on the same micro-batches,
and the summaries of where a run blows up and which trust ratios pass 1."""

import numpy as np
import pytest

pytest.importorskip("flax")

from optax_lamb_recipes import divergence

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)


def test_the_two_implementations_train_alike_on_the_ci_replay(tmp_path):
  out = str(tmp_path / "divergence.json")
  results = divergence.main(["--preset", "ci", "--out", out])
  same, half = results["same"], results["half lr"]
  cfg = divergence.PRESETS["ci"]
  loss = np.array(same["loss"])
  assert loss.shape == (cfg.steps, 2) and np.array(half["loss"]).shape == (cfg.half_lr_steps, 1)
  np.testing.assert_allclose(loss[:, 0], loss[:, 1], rtol=1e-5)
  assert same["eval_steps"] == list(range(cfg.eval_every, cfg.steps + 1, cfg.eval_every))
  assert half["peak_lr"] == pytest.approx(same["peak_lr"] / 2)
  assert all(len(v) == cfg.steps for v in same["trust_ratios"].values())
  assert any("embed" in name for name in same["trust_ratios"])
  said = divergence.findings(results)
  assert said[0].startswith("Replayed step by step") and said[-1].startswith("At half the peak")
  again = divergence.main(["--preset", "ci", "--out", out])  # finished: nothing trained again
  assert again["sessions"] == results["sessions"]


def test_blow_up_is_the_first_rise_above_the_best_so_far():
  losses = [6.0, 5.0, 4.0, 4.3, 3.9, 4.5, None, 5.0]
  best = np.minimum.accumulate([6.0, 5.0, 4.0, 4.3, 3.9, 4.5])
  want = next(i + 1 for i, x in enumerate([6.0, 5.0, 4.0, 4.3, 3.9, 4.5]) if x - best[i] > 0.5)
  assert divergence.blow_up(losses) == want == 6
  assert divergence.blow_up(losses, rise=1.0) == 7  # the loss stopped being finite
  assert divergence.blow_up([3.0, 2.0, 2.2]) is None


def test_climbs_gives_each_layers_last_stretch_above_the_level():
  ratios = {"embed": [0.5, 1.5, 0.9, 1.2, 4.0], "mlp": [0.2, 0.3, 0.4, 2.0, 3.0], "head": [0.1] * 5}
  # embed went above 1 at step 2, back below at 3, above for good from step 4
  assert divergence.climbs(ratios, until=5) == [(4, "embed"), (4, "mlp")]
  assert divergence.climbs(ratios, until=2) == [(2, "embed")]
  assert divergence.climbs(ratios, until=5, level=10.0) == []
