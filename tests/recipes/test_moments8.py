"""8-bit moments against float32 in the recipe: the job on the ci preset (resumed after a stop),
the paired table against NumPy, and the recipe's optimizer with 8-bit moments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from optax_lamb_recipes import analysis, moments8
from optax_lamb_recipes import train as train_lib


def test_the_8bit_config_quantizes_lambs_moments_and_adamw_refuses_it():
  opt = moments8.ARMS["8-bit"]
  params = {"kernel": jnp.ones((32, 128)), "bias": jnp.zeros((128,))}
  state = train_lib.make_optimizer("lamb", 1e-3, opt=opt).init(params)
  dtypes = {str(x.dtype) for x in jax.tree.leaves(state)}
  assert {"int8", "uint8"} <= dtypes
  f32 = train_lib.make_optimizer("lamb", 1e-3, opt=moments8.ARMS["float32"]).init(params)
  assert not {"int8", "uint8"} & {str(x.dtype) for x in jax.tree.leaves(f32)}
  with pytest.raises(TypeError, match="mu_dtype"):
    train_lib.make_optimizer("adamw", 1e-3, opt=opt)


def test_claim_preset_runs_1x_first_on_five_seeds_then_4x_on_ten_at_both_batches():
  runs = moments8.PRESETS["claim"].runs
  assert runs[:5] == tuple((1, s, (16, 512)) for s in range(5))
  at_4x = {(s, b) for m, s, batches in runs[5:] for b in batches if m == 4}
  assert at_4x == {(s, b) for s in range(10) for b in (16, 512)} and len(runs[5:]) == 15


def _synthetic(rng):
  runs = []
  for m in (1, 4):
    for b in (16, 512):
      for seed in range(4 if m == 1 else 2):
        base = 5.0 + rng.normal(0, 0.3, 100)
        for moments, shift in (("float32", 0.0), ("8-bit", 0.01 * m)):
          if (m, seed, moments) == (4, 1, "8-bit"):
            continue  # a stopped job: seed 1's 8-bit run at 4x missing
          per_seq = base + shift + rng.normal(0, 0.01, 100)
          runs.append({"multiple": m, "seed": seed, "batch": b, "moments": moments,
                       "test_per_sequence": per_seq.tolist(), "test": [per_seq.mean()]})  # fmt: skip
  return {"runs": runs, "sessions": []}


def test_table_pairs_by_seed_and_sequence_on_the_seeds_both_arms_have():
  results = _synthetic(np.random.default_rng(0))
  t = moments8.table(results)
  assert sorted(t) == [(1, 16), (1, 512), (4, 16), (4, 512)]
  by = {moments8.key(r): np.array(r["test_per_sequence"]) for r in results["runs"]}
  for (m, b), row in t.items():
    seeds = [0, 1, 2, 3] if m == 1 else [0]
    assert row["seed_list"] == seeds
    diff = np.stack([by[m, s, b, "8-bit"] - by[m, s, b, "float32"] for s in seeds])
    assert row["difference"] == analysis.t_interval(
      diff
    )  # the verdicts' interval (bootstrap before)
    np.testing.assert_allclose(row["per_seed"], diff.mean(axis=1))
    assert row["difference"]["low"] <= row["difference"]["mean"] <= row["difference"]["high"]
  said = moments8.findings(results)
  assert said[0].startswith("1x, B=16: 8-bit worse") and "beyond" not in said[0]
  assert said[-1].startswith("4x, B=512: 1 seed(s) so far, mean difference +0.0")
  report = moments8.format_report(results)
  assert report.count("\n| 1x |") == 2 and "8-bit minus float32" in report


@pytest.mark.slow
def test_ci_job_trains_both_arms_paired_and_resumes_a_stopped_file(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # the ci search's file goes here
  out = str(tmp_path / "moments8.json")
  results = moments8.main(["--preset", "ci", "--out", out])
  cfg = moments8.PRESETS["ci"]
  want = [(m, s, b, a) for m, s, bs in cfg.runs for b in bs for a in moments8.ARMS]
  assert [moments8.key(r) for r in results["runs"]] == want
  for r in results["runs"]:
    assert r["family"] == "lamb" and "trust_ratios" in r and len(r["test_per_sequence"]) > 0
  by = {moments8.key(r): r for r in results["runs"]}
  for m, s, b, a in want:  # quantized, so not bit-identical, but close on the tiny model
    if a == "8-bit":
      x, y = (np.array(by[m, s, b, k]["test_per_sequence"]) for k in ("8-bit", "float32"))
      assert 0 < np.abs(x - y).max() < 0.05
      assert by[m, s, b, a]["hyper"] == by[m, s, b, "float32"]["hyper"]
  t = moments8.table(results)
  assert sorted(t) == sorted({(m, b) for m, _, bs in cfg.runs for b in bs})
  # stopped after three runs: the rest trains again and matches
  partial = dict(results, runs=results["runs"][:3])
  searched = moments8.records.input_results("moments8_search_ci.json", None)
  resumed = moments8.run_moments8(cfg, searched, out=str(tmp_path / "again.json"),
                                  previous=partial)  # fmt: skip
  assert [moments8.key(r) for r in resumed["runs"]] == want
  for r in resumed["runs"][3:]:
    np.testing.assert_allclose(r["test_per_sequence"], by[moments8.key(r)]["test_per_sequence"],
                               rtol=1e-5, err_msg=str(moments8.key(r)))  # fmt: skip
  again = moments8.main(["--preset", "ci", "--out", out])  # finished: nothing trained again
  assert again["runs"] == results["runs"]
