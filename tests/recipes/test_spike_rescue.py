"""The spike-rescue job: the diverging run again with spike skipping, resumable mid-run."""

import copy

import numpy as np
import pytest

pytest.importorskip("flax")

from optax_lamb_recipes import divergence, spike_rescue

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)


class Stop(Exception):
  pass


def test_ci_run_and_resume_from_the_saved_params(tmp_path):
  out = str(tmp_path / "rescue.json")
  results = spike_rescue.main(["--preset", "ci", "--out", out])
  v = results["variants"]["ci"]
  n = results["run"]["steps"]
  assert len(v["loss"]) == len(v["grad_norm"]) == len(v["skipped"]) == n
  assert v["eval_steps"][-1] == n and np.isfinite(v["test"]).all()
  assert spike_rescue.findings(results)[0].startswith("ci: ")
  # Interrupted after 16 steps, then resumed from the record and the saved params and state.
  cfg = spike_rescue.PRESETS["ci"]
  scfg, run = divergence._source(cfg)
  variant = spike_rescue.Variant(spike_rescue.CI_RULE, 3)
  saved = {}

  def save(record):
    saved["record"] = copy.deepcopy(record)
    if len(record["loss"]) == 16:
      raise Stop

  ckpt = str(tmp_path / "part.npz")
  with pytest.raises(Stop):
    spike_rescue.train_variant(scfg, run, variant, done=None, ckpt=ckpt,
                               eval_every=cfg.eval_every, save=save)  # fmt: skip
  resumed = spike_rescue.train_variant(scfg, run, variant, done=saved["record"], ckpt=ckpt,
                                       eval_every=cfg.eval_every, save=lambda r: None)  # fmt: skip
  np.testing.assert_allclose(resumed["loss"], v["loss"], rtol=1e-6)
  np.testing.assert_allclose(resumed["test"], v["test"], rtol=1e-6)
  again = spike_rescue.main(["--preset", "ci", "--out", out])  # finished: nothing trained again
  assert again["variants"] == results["variants"]
