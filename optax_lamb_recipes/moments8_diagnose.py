"""Which 8-bit moment and which blocks lose what: one float32 LAMB run's moments, shadow-quantized.

    python -m optax_lamb_recipes.moments8_diagnose --preset ci --out moments8_diagnose_ci.json
    python -m optax_lamb_recipes.moments8_diagnose --preset claim --out diagnose.json  # 4x, seed 1

moments8.py's float32 arm trains once, as ``search.train_trials`` trains it there: the search's
chosen LAMB settings at the batch, ``multiple`` times the search's samples, the recipe's trainer,
model, data and seed, cut into ``points`` equal segments (the largest divisor of the steps up to
it) instead of the sweep's evaluations. After each segment the trainer hands over its state
(``Trainer.run``'s ``on_segment``). Every moment leaf that ``lamb(mu_dtype=jnp.int8,
nu_dtype=jnp.uint8)`` stores quantized (``_moment_storage.quantizes``) then goes through the
library's own store and load (``_quantize.quantize_all``, the block absmax and ``encode``, as the
step stores; ``_quantize.dequantize``, ``decode``), and the loaded moments are compared with
float32's. Cost: one float32 run and up to ``points`` evaluations; the claim preset's run (4x,
batch 16) took about 480 s of a quiet 2-CPU machine in moments8.py, the ci preset about a minute
of CPU.

The run is never perturbed: each point measures one store and load on float32's trajectory, the
error the next step of an 8-bit run inherits there (its gradient then enters m with weight 1 - b1
and v with 1 - b2), not the drift an 8-bit run accumulates. The Adam direction
u = (m / bc1) / (sqrt(v / bc2) + eps) is ``_leaf.adam_direction`` at the moments' own step count,
from float32's moments and from the loaded ones; the trust ratio is LAMB's ||p|| / ||u + wd p||
(the recipe sets no clamps). Per leaf and point the results hold `METRICS`, and the ``top`` blocks
that carry most of the direction's squared error: their index in the scales' shape (the rows, then
the block along the last axis), that share, how many of their v > 0 load as 0, and the spread
(largest over smallest non-zero magnitude) of m and of v inside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lamb.core import _leaf, _moment_storage, _quantize
from optax_lamb.core._options import StepScalars
from optax_lamb_recipes import budget, moments8, presets, records, search, splits
from optax_lamb_recipes import train as train_lib

METRICS = {
  "m_rel_rms": "||m~ - m|| / ||m||: m stored and loaded (signed map)",
  "v_rel_rms": "||v~ - v|| / ||v||: v stored and loaded (unsigned map)",
  "m_zero": "the fraction of elements with m != 0 that load as 0",
  "v_zero": "the fraction of elements with v > 0 that load as 0",
  "v_zero_blocks": "the fraction of blocks with an element of v > 0 that loads as 0",
  "u_rel_rms": "||u~ - u|| / ||u||, u~ from both loaded moments",
  "u_rel_rms_m": "the same, m loaded and v float32's: the first moment's share",
  "u_rel_rms_v": "the same, v loaded and m float32's: the second moment's share",
  "u_max": "max |u~ - u| / RMS(u): the largest element's error (v loaded as 0 gives m / eps)",
  "u_norm": "||u~|| / ||u|| - 1",
  "trust_ratio": "r~ / r - 1, r = ||p|| / ||u + wd p|| (None on leaves without LAMB's ratio)",
}


@dataclasses.dataclass(frozen=True)
class DiagnoseConfig:
  name: str
  search: str  # the random search's results JSON ("": a fresh ci search, moments8.CI_SEARCH)
  multiple: int  # of the search's samples
  seed: int
  batch: int
  points: int = 20  # at most this many points along the run
  top: int = 3  # blocks kept per leaf and point


PRESETS = {
  # moments8.json: at 4x and batch 16, seed 1's 8-bit run ended 1.1 nats above float32's
  "claim": DiagnoseConfig(
    "claim", os.path.join("notebooks", "results", "search.json"), 4, seed=1, batch=16
  ),
  "ci": DiagnoseConfig("ci", "", 2, seed=0, batch=16),
}


@jax.jit
def _shadow(m, v, bc1, bc2, eps):
  """m and v stored and loaded as the 8-bit step does, and u of each mix of float32 and loaded."""
  qm, qv = _quantize.quantize_all([m, v], [True, False])
  mq = _quantize.dequantize(qm.codes, qm.scales, True)
  vq = _quantize.dequantize(qv.codes, qv.scales, False)
  s = StepScalars(eps=eps, bc1=bc1, bc2=bc2)
  mixes = {"float32": (m, v), "m": (mq, v), "v": (m, vq), "both": (mq, vq)}
  return mq, vq, {k: _leaf.adam_direction(a, b, s) for k, (a, b) in mixes.items()}


def _blocks(x: np.ndarray, block_size: int = _quantize.BLOCK_SIZE) -> np.ndarray:
  """``[..., blocks, block_size]``: the storage's blocks of the last axis, the last padded with 0."""
  n = x.shape[-1]
  padded = np.zeros((*x.shape[:-1], -(-n // block_size) * block_size), x.dtype)
  padded[..., :n] = x
  return padded.reshape(*x.shape[:-1], -1, block_size)


def _ratio(a: float, b: float) -> float:
  return float(a / b) if b > 0 else math.nan


def _spread(x: np.ndarray) -> float:
  """Largest over smallest non-zero magnitude (nan where none is non-zero)."""
  a = np.abs(x[x != 0])
  return float(a.max() / a.min()) if a.size else math.nan


def shadow_leaf(
  m,
  v,
  p,
  *,
  count: int,
  b1: float,
  b2: float,
  eps: float,
  weight_decay: float,
  ratio: bool,
  top: int = 3,
) -> tuple[dict, list[dict]]:
  """One leaf's `METRICS` and its ``top`` worst blocks (module docstring), for float32 moments
  ``m``, ``v`` after ``count`` steps and the params ``p``; ``ratio``: LAMB's trust ratio applies."""
  bc1, bc2 = _leaf.bias_corrections(jnp.asarray(count, jnp.int32), b1, b2)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  mq, vq, us = _shadow(f32(m), f32(v), f32(bc1), f32(bc2), f32(eps))
  m, v, mq, vq, p = (np.asarray(x, np.float64) for x in (m, v, mq, vq, p))
  u = {k: np.asarray(x, np.float64) for k, x in us.items()}
  ref, norm = u["float32"], np.linalg.norm
  v_lost = (vq == 0) & (v > 0)
  err = lambda k: _ratio(norm(u[k] - ref), norm(ref))
  out = {
    "m_rel_rms": _ratio(norm(mq - m), norm(m)),
    "v_rel_rms": _ratio(norm(vq - v), norm(v)),
    "m_zero": float(np.mean((mq == 0) & (m != 0))),
    "v_zero": float(np.mean(v_lost)),
    "v_zero_blocks": float(np.mean(_blocks(v_lost).any(axis=-1))),
    "u_rel_rms": err("both"),
    "u_rel_rms_m": err("m"),
    "u_rel_rms_v": err("v"),
    "u_max": _ratio(np.abs(u["both"] - ref).max(), np.sqrt(np.mean(ref**2))),
    "u_norm": _ratio(norm(u["both"]), norm(ref)) - 1,
    "trust_ratio": None,
  }
  if ratio:
    out["trust_ratio"] = (
      _ratio(norm(ref + weight_decay * p), norm(u["both"] + weight_decay * p)) - 1
    )
  return out, _worst_blocks((u["both"] - ref) ** 2, v_lost, m, v, top)


def _worst_blocks(sq: np.ndarray, v_lost: np.ndarray, m, v, top: int) -> list[dict]:
  """The ``top`` blocks with the largest sum of ``sq`` (the direction's squared error)."""
  per_block = _blocks(sq).sum(axis=-1)
  total = per_block.sum()
  bm, bv, lost = _blocks(m), _blocks(v), _blocks(v_lost)
  out = []
  for flat in np.argsort(-per_block, axis=None, kind="stable")[:top]:
    i = np.unravel_index(flat, per_block.shape)
    out.append(
      {
        "index": [int(j) for j in i],
        "u_error_share": _ratio(per_block[i], total),
        "v_zero": int(lost[i].sum()),
        "m_spread": _spread(bm[i]),
        "v_spread": _spread(bv[i]),
      }
    )
  return out


def shadow_tree(params, adam: optax.ScaleByAdamState, hyper: dict, opt, top: int = 3) -> dict:
  """``name -> (metrics, worst blocks)`` of each leaf whose moments quantize, for one run's
  (unstacked) params and Adam state, the run's searched ``hyper`` over the trainer's ``opt``."""
  names = train_lib.leaf_names(params)
  decayed = jax.tree.leaves(train_lib.decay_mask(params))  # the recipe's trust-ratio mask too
  ratio_on = lambda d: d or opt.ratio_on_no_decay
  trees = (jax.tree.leaves(t) for t in (params, adam.mu, adam.nu))
  leaves = zip(names, decayed, *trees, strict=True)
  count = int(adam.count)
  return {
    name: shadow_leaf(
      m,
      v,
      p,
      count=count,
      b1=opt.b1,
      b2=hyper["b2"],
      eps=hyper["eps"],
      weight_decay=hyper["weight_decay"] if d else 0.0,
      ratio=ratio_on(d),
      top=top,
    )
    for name, d, p, m, v in leaves
    if _moment_storage.quantizes(tuple(np.shape(p)))
  }


def _adam_state(state: Any) -> optax.ScaleByAdamState:
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  (adam,) = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
  return adam


def _points(phases, want: int) -> int:
  """Segments per phase: the largest divisor of every phase's steps up to ``want``."""
  steps = math.gcd(*(ph.steps for ph in phases))
  return max(d for d in range(1, max(1, want) + 1) if steps % d == 0)


def diagnose(cfg: DiagnoseConfig, searched: dict) -> dict:
  """Train the float32 run, shadow-quantizing its moments after each segment; the results."""
  start = time.perf_counter()
  scfg = presets.from_json(searched["config"])
  longer = dataclasses.replace(scfg, samples=scfg.samples * cfg.multiple)
  chosen = budget.chosen_settings(searched)["lamb", cfg.batch]
  hyper, opt = chosen["hyper"], moments8.ARMS["float32"]
  train_data, val, test, _ = splits.load_data(longer, cfg.seed)
  trainer = train_lib.Trainer(longer.model, opt=opt, micro=longer.micro, seed=cfg.seed)
  lr = hyper["factor"] * presets.base_lrs(longer, cfg.batch)["lamb"]
  phases = presets.phases_for(longer, cfg.batch, lr)
  steps, leaves = [], {}

  def on_segment(params, state):
    adam = jax.tree.map(lambda x: np.asarray(x[0]), _adam_state(state))  # the one learning rate
    params = jax.tree.map(lambda x: np.asarray(x[0]), params)
    shapes = dict(
      zip(train_lib.leaf_names(params), map(np.shape, jax.tree.leaves(params)), strict=True)
    )
    steps.append(int(adam.count))
    for name, (metrics, worst) in shadow_tree(params, adam, hyper, opt, cfg.top).items():
      leaf = leaves.setdefault(name, _new_leaf(shapes[name]))
      for k, x in metrics.items():
        leaf["series"][k].append(x)
      leaf["worst_blocks"].append(worst)

  t0 = time.perf_counter()
  res = trainer.run(
    "lamb",
    [lr],
    phases,
    train_data,
    val,
    test=test,
    evals_per_phase=_points(phases, cfg.points),
    trials=[hyper],
    on_segment=on_segment,
  )[0]
  run = records.record(res, hyper["factor"], cfg.seed, time.perf_counter() - t0, keep_ratios=True)
  return _finite(
    {
      "diagnose": dataclasses.asdict(cfg),
      "metrics": METRICS,
      "config": searched["config"],
      "chosen": {"family": "lamb", "batch": cfg.batch} | chosen,
      "run": run | {"multiple": cfg.multiple, "moments": "float32"},
      "points": [{"step": s, "samples": n} for s, n in zip(steps, res.samples, strict=True)],
      "leaves": leaves,
      "summary": summary(leaves),
      "session": records.session(start),
    }
  )


def _new_leaf(shape: tuple[int, ...]) -> dict:
  return {
    "shape": list(shape),
    "blocks": int(np.prod(_quantize.scales_shape(shape))),
    "block_size": _quantize.BLOCK_SIZE,
    "series": {k: [] for k in METRICS},
    "worst_blocks": [],
  }


def _finite(x: Any) -> Any:
  """``x`` with every non-finite float None (JSON has no NaN)."""
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def _values(series: list) -> np.ndarray:
  return np.array([math.nan if x is None else x for x in series], float)


def summary(leaves: dict) -> dict:
  """Per leaf over the points: the mean relative RMS errors, the largest of the rest (in absolute
  value), the moment whose load errs the direction more (``carried_by``), and the worst block
  at the point of the largest direction error."""
  out = {}
  for name, leaf in leaves.items():
    s = {k: _values(v) for k, v in leaf["series"].items()}
    row = {k: _nan_stat(np.nanmean, s[k]) for k in METRICS if "rel_rms" in k}
    for k in ("m_zero", "v_zero", "v_zero_blocks", "u_max", "u_norm", "trust_ratio"):
      row[k] = _nan_stat(lambda x: x[np.nanargmax(np.abs(x))], s[k])
    row["carried_by"] = "m" if row["u_rel_rms_m"] >= row["u_rel_rms_v"] else "v"
    at = int(np.nanargmax(s["u_rel_rms"])) if np.isfinite(s["u_rel_rms"]).any() else 0
    row["worst_point"] = at
    row["worst_block"] = leaf["worst_blocks"][at][0] if leaf["worst_blocks"][at] else None
    out[name] = row
  return _finite(out)


def _nan_stat(fn, x: np.ndarray) -> float:
  return float(fn(x)) if np.isfinite(x).any() else math.nan


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:.2f}%"


def format_table(results: dict) -> str:
  """Markdown: per quantized leaf, what its m and v lose and which of them errs the direction."""
  d = results["diagnose"]
  lines = [
    f"Shadow quantization of float32 LAMB's moments, {d['multiple']}x, seed {d['seed']}, batch "
    f"{d['batch']}, {len(results['points'])} points (steps {results['points'][0]['step']} to "
    f"{results['points'][-1]['step']}); relative RMS errors are means over the points, the rest "
    "the largest in magnitude (`METRICS` in moments8_diagnose.py):",
    "",
    "| leaf | blocks | m err | v err | v to 0 | blocks with v to 0 | u err from m / v / both "
    "| max u err / RMS u | norm of u | trust ratio | carried by | worst block (step): index, "
    "share, v spread |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for name, r in results["summary"].items():
    w = r["worst_block"]
    step = results["points"][r["worst_point"]]["step"]
    spread = "-" if w is None or w["v_spread"] is None else f"{w['v_spread']:.3g}"
    block = "-" if w is None else f"({step}) {w['index']}, {_pct(w['u_error_share'])}, {spread}"
    u_errs = " / ".join(_pct(r[k]) for k in ("u_rel_rms_m", "u_rel_rms_v", "u_rel_rms"))
    cells = [name, results["leaves"][name]["blocks"], _pct(r["m_rel_rms"]), _pct(r["v_rel_rms"])]
    cells += [_pct(r["v_zero"]), _pct(r["v_zero_blocks"]), u_errs]
    cells += ["-" if r["u_max"] is None else f"{r['u_max']:.3g}", _pct(r["u_norm"])]
    cells += [_pct(r["trust_ratio"]), r["carried_by"], block]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  run = results["run"]
  lines += ["", f"The float32 run's final test loss: {records.final(run, 'test'):.4f} nats."]
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n")[0], formatter_class=records.DefaultsHelpFormatter
  )
  parser.add_argument("--preset", choices=sorted(PRESETS), default=presets.default_preset(PRESETS))
  for name in ("seed", "batch", "multiple", "points"):
    parser.add_argument(f"--{name}", type=int, help=f"the preset's {name}, replaced")
  parser.add_argument("--out", required=True, help="results JSON (replaced)")
  args = parser.parse_args(argv)
  given = {k: getattr(args, k) for k in ("seed", "batch", "multiple", "points")}
  cfg = dataclasses.replace(
    PRESETS[args.preset], **{k: v for k, v in given.items() if v is not None}
  )
  here = os.path.dirname(os.path.abspath(args.out))
  ci_search = lambda: search.run_search(
    moments8.CI_SEARCH, out=os.path.join(here, "moments8_diagnose_search_ci.json")
  )
  results = diagnose(cfg, records.input_results(cfg.search, ci_search))
  records.write_json(results, args.out)
  print(format_table(results))
  print(f"\nresults: {args.out}")
  return results


if __name__ == "__main__":
  main()
