"""The 8-bit moments diagnostic: its shadow quantization against a float64 NumPy transcription on a
hand-made leaf (one v element that loads as 0, one m element that does), and the ci preset end to
end."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from helpers import quantize_reference as qref

pytest.importorskip("flax")

from optax_lamb.core import _moment_storage
from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes import moments8, moments8_diagnose, presets, records, search
from optax_lamb_recipes import train as train_lib

pytestmark = pytest.mark.slow

B = 256
STEP = dict(count=7, b1=0.9, b2=0.98, eps=1e-6)


def _hand_made(rng):
  """m and v of shape (16, 300) (blocks of 256 and 44): v[3, 5] far below its block's smallest
  code (loads as 0), v[3, 6] exactly 0 (not counted), m[7, 10] far below m's smallest code."""
  m = rng.normal(size=(16, 300)).astype(np.float32)
  v = (m.astype(np.float64) ** 2 + rng.uniform(0.1, 1.0, size=m.shape)).astype(np.float32)
  v[3, 5] = np.float32(1e-9 * v[3, :B].max())
  v[3, 6], m[3, 5], m[3, 6] = 0.0, 0.5, 0.25
  m[7, 10] = np.float32(1e-9 * np.abs(m[7, :B]).max())
  return m, v, rng.normal(size=m.shape).astype(np.float32)


def _reference(m, v, p, wd, top):
  """The metrics and worst blocks in float64 from the reference quantization (paper's tables)."""
  m, v, p = (np.asarray(x, np.float64) for x in (m, v, p))
  mq, vq = (qref.dequantize(*qref.quantize(x, s), s) for x, s in ((m, True), (v, False)))
  bc1, bc2 = 1 - STEP["b1"] ** STEP["count"], 1 - STEP["b2"] ** STEP["count"]
  u = lambda a, b: (a / bc1) / (np.sqrt(b / bc2) + STEP["eps"])
  ref, uq, n = u(m, v), u(mq, vq), np.linalg.norm
  lost = (vq == 0) & (v > 0)
  rows, blocks = m.shape[0], -(-m.shape[1] // B)
  cut = lambda x, r, b: x[r, b * B : (b + 1) * B]
  per_block = {(r, b): np.sum(cut(uq - ref, r, b) ** 2) for r in range(rows) for b in range(blocks)}
  order = sorted(per_block, key=lambda k: -per_block[k])[:top]
  total = sum(per_block.values())
  spread = lambda x: np.abs(x[x != 0]).max() / np.abs(x[x != 0]).min()
  worst = [
    {
      "index": list(k),
      "u_error_share": per_block[k] / total,
      "v_zero": int(cut(lost, *k).sum()),
      "m_spread": spread(cut(m, *k)),
      "v_spread": spread(cut(v, *k)),
    }
    for k in order
  ]
  metrics = {
    "m_rel_rms": n(mq - m) / n(m),
    "v_rel_rms": n(vq - v) / n(v),
    "m_zero": np.mean((mq == 0) & (m != 0)),
    "v_zero": np.mean(lost),
    "v_zero_blocks": np.mean([cut(lost, r, b).any() for r in range(rows) for b in range(blocks)]),
    "u_rel_rms": n(uq - ref) / n(ref),
    "u_rel_rms_m": n(u(mq, v) - ref) / n(ref),
    "u_rel_rms_v": n(u(m, vq) - ref) / n(ref),
    "u_max": np.abs(uq - ref).max() / np.sqrt(np.mean(ref**2)),
    "u_norm": n(uq) / n(ref) - 1,
    "trust_ratio": n(ref + wd * p) / n(uq + wd * p) - 1,
  }
  return metrics, worst


def test_shadow_leaf_equals_a_float64_numpy_transcription_with_known_zero_loads():
  m, v, p = _hand_made(np.random.default_rng(0))
  got, worst = moments8_diagnose.shadow_leaf(m, v, p, **STEP, weight_decay=0.01, ratio=True, top=3)
  want, want_worst = _reference(m, v, p, 0.01, 3)
  assert set(got) == set(moments8_diagnose.METRICS) == set(want)
  # the known elements: one v of 4,800 loads as 0, in one block of 32; one m
  assert got["v_zero"] == want["v_zero"] == 1 / m.size
  assert got["v_zero_blocks"] == want["v_zero_blocks"] == 1 / 32
  assert got["m_zero"] == want["m_zero"] == 1 / m.size
  for k in want:  # float32 moments and direction against float64: a few roundings
    np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-9, err_msg=k)
  assert worst[0]["index"] == [3, 0] and worst[0]["v_zero"] == 1  # m / eps dominates u's error
  assert [w["index"] for w in worst] == [w["index"] for w in want_worst]
  for w, ww in zip(worst, want_worst, strict=True):
    assert w["v_zero"] == ww["v_zero"]
    for k in ("u_error_share", "m_spread", "v_spread"):
      np.testing.assert_allclose(w[k], ww[k], rtol=1e-4, err_msg=k)


def test_shadow_tree_takes_the_leaves_the_library_quantizes_and_the_trust_ratio_where_lamb_has_it():
  rng = np.random.default_rng(1)
  m, v, p = _hand_made(rng)
  small = rng.normal(size=(300,)).astype(np.float32)
  square = rng.normal(size=(64, 64)).astype(np.float32)
  tree = lambda a, b, c: {"dense": {"bias": a, "kernel": b}, "norm": {"scale": c}}
  adam = optax.ScaleByAdamState(
    count=np.int32(STEP["count"]),
    mu=tree(small, m, square),
    nu=tree(small**2, v, square**2 + 0.1),
  )
  hyper = {"b2": STEP["b2"], "eps": STEP["eps"], "weight_decay": 0.01}
  opt = train_lib.OptimizerConfig(b1=STEP["b1"])
  out = moments8_diagnose.shadow_tree(tree(small, p, square), adam, hyper, opt, top=2)
  names = train_lib.leaf_names(adam.mu)
  quantized = [
    nm
    for nm, x in zip(names, jax.tree.leaves(adam.mu), strict=True)
    if _moment_storage.quantizes(x.shape)
  ]
  assert sorted(out) == sorted(quantized) == ["dense/kernel", "norm/scale"]
  want, _ = _reference(m, v, p, 0.01, 2)
  np.testing.assert_allclose(out["dense/kernel"][0]["trust_ratio"], want["trust_ratio"], rtol=1e-4)
  assert out["norm/scale"][0]["trust_ratio"] is None  # no decay, no ratio in the recipe
  assert len(out["dense/kernel"][1]) == 2


def test_ci_preset_trains_the_float32_arm_and_writes_the_documented_json(
  tmp_path, monkeypatch, capsys
):
  monkeypatch.chdir(tmp_path)
  out = tmp_path / "diagnose.json"
  results = moments8_diagnose.main(["--preset", "ci", "--out", str(out)])
  with open(out) as f:
    written = json.load(f)
  assert written == json.loads(json.dumps(results))
  assert set(written) == {
    "diagnose",
    "metrics",
    "config",
    "chosen",
    "run",
    "points",
    "leaves",
    "summary",
    "session",
  }
  cfg = moments8_diagnose.PRESETS["ci"]
  steps = written["run"]["steps"]
  points = [p["step"] for p in written["points"]]
  assert points == [steps * (i + 1) // len(points) for i in range(len(points))]
  assert len(points) == max(d for d in range(1, cfg.points + 1) if steps % d == 0)
  # the leaves the 8-bit arm stores quantized, by the library's rule
  _, params = model_lib.init_params(moments8.CI_SEARCH.sweep.model, 0)
  shapes = dict(
    zip(train_lib.leaf_names(params), map(np.shape, jax.tree.leaves(params)), strict=True)
  )
  assert sorted(written["leaves"]) == sorted(
    nm for nm, s in shapes.items() if _moment_storage.quantizes(s)
  )
  for name, leaf in written["leaves"].items():
    assert tuple(leaf["shape"]) == shapes[name]
    assert set(leaf["series"]) == set(moments8_diagnose.METRICS)
    assert all(len(x) == len(points) for x in leaf["series"].values())
    assert len(leaf["worst_blocks"]) == len(points)
    row = written["summary"][name]
    for k in ("m_rel_rms", "v_rel_rms", "u_rel_rms"):
      np.testing.assert_allclose(row[k], np.mean(leaf["series"][k]), rtol=1e-12)
    assert row["carried_by"] in ("m", "v")
  # the same run as moments8's float32 arm (search.train_trials), cut into other segments
  searched = records.input_results(str(tmp_path / "moments8_diagnose_search_ci.json"), None)
  chosen = written["chosen"]
  scfg = presets.from_json(searched["config"])
  longer = dataclasses.replace(scfg, samples=scfg.samples * cfg.multiple)
  arm = []
  search.train_trials(
    longer,
    cfg.seed,
    "lamb",
    cfg.batch,
    {chosen["trial"]: chosen["hyper"]},
    1,
    arm.extend,
    opt=moments8.ARMS["float32"],
  )
  np.testing.assert_allclose(
    written["run"]["test_per_sequence"], arm[0]["test_per_sequence"], rtol=1e-4
  )
  table = capsys.readouterr().out
  assert all(f"| {name} |" in table for name in written["leaves"])
