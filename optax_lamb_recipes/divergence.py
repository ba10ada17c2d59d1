"""Why LAMB diverged at 16x the samples (batch 512, seed 0): the optimizer, or its settings?

    python -m optax_lamb_recipes.divergence    # notebooks/results/divergence.json (about 30 min CPU)
    LAMB_QUICK=1 python -m optax_lamb_recipes.divergence   # a tiny model, seconds, to divergence_ci.json

The longer-training job (``budget.py``) ran the search's LAMB settings at batch 512 (peak learning
rate 0.0349, warm-up 877 of 2,400 steps, the chosen trial of ``search.json``) for 16x the samples,
and the run's test loss went from 3.92 at step 960 to 7.05 at step 1,200. This replays that run step
by step, with two implementations of the same LAMB side by side on the same micro-batches:
``optax_lamb.lamb`` (the recipe's optimizer) and a chain of optax's own stages
(``clip_by_global_norm``, ``scale_by_adam``, ``add_decayed_weights``, ``scale_by_trust_ratio``
and ``scale_by_learning_rate``, masked as the recipe masks). It records, at every step, each
one's training loss and the largest relative difference between their parameters, and the
trust ratio of every layer of ``optax_lamb.lamb``; the test loss every ``eval_every`` steps. Then
the same run at half the peak learning rate, further. If both implementations blow up at the same
step, the divergence belongs to the settings, not to this library's LAMB.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lamb
from optax_lamb_recipes import budget_report, presets, records, schedules, splits
from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes import train as train_lib

CHAINS = ("optax_lamb.lamb", "optax chain")


@dataclasses.dataclass(frozen=True)
class Replay:
  """One replay: the budget run it follows, where it stops, and how often it evaluates."""

  name: str
  budget: str  # the budget results JSON ("" = a tiny run for CI)
  multiple: int  # which of its runs: LAMB at the largest batch, seed 0, this many times the samples
  steps: int  # both implementations, this far
  half_lr_steps: int  # optax_lamb.lamb at half the peak learning rate, this far
  eval_every: int


PRESETS = {
  "claim": Replay("claim", os.path.join("notebooks", "results", "budget.json"), 16, 1200, 1500, 60),
  "ci": Replay("ci", "", 2, 8, 8, 4),
}
DEFAULT_OUT = {
  "claim": os.path.join("notebooks", "results", "divergence.json"),
  "ci": "divergence_ci.json",
}


def optax_chain(schedule, opt: train_lib.OptimizerConfig) -> optax.GradientTransformation:
  """LAMB from optax's own stages, with the recipe's clipping and masks (no decay and ratio 1 on
  biases and LayerNorm parameters)."""
  return optax.chain(
    optax.clip_by_global_norm(opt.max_grad_norm),
    optax.scale_by_adam(opt.b1, opt.b2, opt.eps),
    optax.add_decayed_weights(opt.weight_decay, mask=train_lib.decay_mask),
    optax.masked(optax.scale_by_trust_ratio(), train_lib.decay_mask),
    optax.scale_by_learning_rate(schedule),
  )


def _settings(searched_run: dict, steps: int, lr_scale: float):
  """The run's schedule and optimizer settings (a search trial's), ``lr_scale`` times the peak."""
  h = searched_run["hyper"]
  warmup = max(1, round(h["warmup_frac"] * steps))
  schedule = schedules.warmup_poly_decay(searched_run["peak_lr"] * lr_scale, warmup, steps)
  opt = dataclasses.replace(
    train_lib.OptimizerConfig(), b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"]
  )
  return schedule, opt, warmup


def _step_fn(graphdef, txs):
  """One optimizer step of every implementation on the same ``k`` micro-batches (optax.MultiSteps
  accumulates them, as in training): the new params and states, each one's mean loss."""

  def step(params, states, micro_batches):
    def one(carry, mb):
      ps, ss = carry
      out_p, out_s, losses = [], [], []
      for tx, p, s in zip(txs, ps, ss, strict=True):
        loss, g = jax.value_and_grad(model_lib.loss_fn, argnums=1)(graphdef, p, mb)
        u, s = tx.update(g, s, p)
        out_p.append(optax.apply_updates(p, u))
        out_s.append(s)
        losses.append(loss)
      return (tuple(out_p), tuple(out_s)), jnp.stack(losses)

    (params, states), losses = jax.lax.scan(one, (params, states), micro_batches)
    return params, states, losses.mean(axis=0)

  return jax.jit(step)


def replay(scfg, run: dict, *, steps: int, lr_scale: float, chains, eval_every: int) -> dict:
  """Train ``chains`` side by side from the run's initial model for ``steps`` optimizer steps of
  its schedule (``lr_scale`` times its peak); per step each one's loss and the first one's trust
  ratios; the test losses."""
  batch, seed, total = run["batch"], run["seed"], run["steps"]
  schedule, opt, warmup = _settings(run, total, lr_scale)
  k = batch // scfg.micro
  lamb = train_lib.make_optimizer("lamb", schedule, accumulate=k, opt=opt)
  theirs = optax.MultiSteps(optax_chain(schedule, opt), every_k_schedule=k)
  txs = [{"optax_lamb.lamb": lamb, "optax chain": theirs}[c] for c in chains]
  train_data, _, test, _ = splits.load_data(scfg, seed)
  stream, test = train_data[scfg.seq_len], test[scfg.seq_len]
  graphdef, params0 = model_lib.init_params(scfg.model, seed)
  names = train_lib.leaf_names(params0)
  decayed = [
    n for n, d in zip(names, jax.tree.leaves(train_lib.decay_mask(params0)), strict=True) if d
  ]
  step = _step_fn(graphdef, txs)
  evaluate = jax.jit(lambda p: model_lib.loss_fn(graphdef, p, test))
  params = tuple(params0 for _ in txs)
  states = tuple(tx.init(params0) for tx in txs)
  out = {"chains": list(chains), "lr_scale": lr_scale, "peak_lr": run["peak_lr"] * lr_scale,
         "warmup": warmup, "total_steps": total, "loss": [],
         "trust_ratios": {n: [] for n in decayed}, "eval_steps": [], "test": []}  # fmt: skip
  for t in range(steps):
    mb = jax.tree.map(lambda x, t=t: jnp.asarray(x[t * batch : (t + 1) * batch]), stream)
    mb = jax.tree.map(lambda x: x.reshape(k, scfg.micro, -1), mb)
    params, states, losses = step(params, states, mb)
    out["loss"].append([float(x) for x in losses])
    for n, r in zip(names, jax.tree.leaves(optax_lamb.trust_ratios(states[0])), strict=True):
      if n in out["trust_ratios"]:
        out["trust_ratios"][n].append(round(float(r), 5))
    if (t + 1) % eval_every == 0:
      out["eval_steps"].append(t + 1)
      out["test"].append([float(evaluate(p)) for p in params])
  return out


def _source(cfg: Replay) -> tuple[presets.SweepConfig, dict]:
  """The sweep at the run's budget and the budget run itself (LAMB, largest batch, seed 0)."""
  if not cfg.budget:  # CI: a made-up run of the ci preset
    scfg = dataclasses.replace(presets.PRESETS["ci"], samples=1024 * cfg.multiple)
    hyper = {"warmup_frac": 0.3, "b2": 0.99, "weight_decay": 0.01, "eps": 1e-6}
    run = {"batch": 64, "seed": 0, "steps": scfg.samples // 64, "peak_lr": 0.02, "hyper": hyper}
    return scfg, run
  with open(cfg.budget) as f:
    results = json.load(f)
  b = max(c["batch"] for c in results["chosen"])
  run = budget_report.run_at(results, "lamb", b, cfg.multiple, 0)
  scfg = presets.from_json(results["config"])
  return dataclasses.replace(scfg, samples=scfg.samples * cfg.multiple), run


def run_replays(cfg: Replay, *, out: str, previous: dict | None = None) -> dict:
  """Both implementations at the run's settings, then ``optax_lamb.lamb`` at half its peak
  learning rate; ``out`` written after each (a finished replay is not trained again)."""
  start = time.perf_counter()
  scfg, run = _source(cfg)
  results = dict(previous or {})
  results["run"] = {k: run.get(k) for k in ("family", "batch", "seed", "steps", "peak_lr", "hyper")}
  results["run"] |= {
    "multiple": cfg.multiple,
    "test": run.get("test"),
    "samples": run.get("samples"),
  }
  sessions = list(results.get("sessions", []))
  todo = {"same": (cfg.steps, 1.0, CHAINS), "half lr": (cfg.half_lr_steps, 0.5, CHAINS[:1])}
  for key, (steps, scale, chains) in todo.items():
    if key not in results:
      results[key] = replay(scfg, run, steps=steps, lr_scale=scale, chains=chains,
                            eval_every=cfg.eval_every)  # fmt: skip
      results["sessions"] = sessions + [records.session(start)]
      results["wall_seconds"] = sum(s["wall_seconds"] for s in results["sessions"])
      results["cpu_seconds"] = sum(s["cpu_seconds"] for s in results["sessions"])
      records.write_json(results, out)
      print(f"{key}: {steps} steps, {time.perf_counter() - start:.0f} s", flush=True)
  return results


# The training losses of the two implementations "agree" within the first and "part" beyond the
# second (nats; float32 rounding differs between them, and the replay amplifies it).
AGREE, PART = 1e-5, 1e-3


def blow_up(losses, rise: float = budget_report.DIVERGED_RISE) -> int | None:
  """The first step (1-based) whose training loss is more than ``rise`` above its best so far
  (a non-finite loss counts), or None."""
  x = np.array([np.inf if v is None else v for v in losses], float)
  x[~np.isfinite(x)] = np.inf
  over = np.flatnonzero(x - np.minimum.accumulate(x) > rise)
  return int(over[0]) + 1 if over.size else None


def climbs(ratios: dict[str, list[float]], until: int, level: float = 1.0) -> list[tuple[int, str]]:
  """``(step, layer)``, earliest first: for each layer whose trust ratio is above ``level`` at
  step ``until`` (1-based), the step from which it stayed above it through ``until``."""
  out = []
  for name, v in ratios.items():
    above = np.asarray(v[:until], float) > level
    if above.size == until and above[-1]:
      below = np.flatnonzero(~above)
      out.append((int(below[-1]) + 2 if below.size else 1, name))
  return sorted(out)


def _first_step(mask) -> int | None:
  hit = np.flatnonzero(mask)
  return int(hit[0]) + 1 if hit.size else None


def _matched(results: dict) -> tuple[int, float] | None:
  """``(last step, largest difference)`` of the prefix of the recorded run's evaluations where
  the replay's test loss (``optax_lamb.lamb``) is within `PART` of the recorded one."""
  run, same = results["run"], results["same"]
  if not run.get("test"):
    return None
  replayed = dict(zip(same["eval_steps"], (t[0] for t in same["test"]), strict=True))
  recorded = [
    (round(n / run["batch"]), x) for n, x in zip(run["samples"], run["test"], strict=True)
  ]
  gaps = []
  for step, x in recorded:
    if step not in replayed or x is None or abs(replayed[step] - x) > PART:
      break
    gaps.append((step, abs(replayed[step] - x)))
  return (gaps[-1][0], max(g for _, g in gaps)) if gaps else None


def findings(results: dict) -> list[str]:
  """Sentences: where the two implementations part and blow up, which layers' trust ratios climb
  above 1 for good first, and the run at half the learning rate."""
  same, half, run = results["same"], results["half lr"], results["run"]
  loss = np.array(same["loss"], float)
  gap = np.abs(loss[:, 0] - loss[:, 1])
  ups = [blow_up(loss[:, i]) for i in range(loss.shape[1])]
  agree, part = _first_step(~(gap <= AGREE)), _first_step(~(gap <= PART))
  said = [
    f"agree within {AGREE:g} nats " + (f"until step {agree - 1:,}" if agree else "throughout")
  ]
  if part:
    said.append(f"first differ by more than {PART:g} at step {part:,}")
  if any(ups):
    said.append(
      f"rise more than {budget_report.DIVERGED_RISE} nats above their best at steps "
      + " and ".join("never" if u is None else f"{u:,}" for u in ups)
    )
  out = [
    f"Replayed step by step (LAMB, B={run['batch']}, {run['multiple']}x, seed {run['seed']}: peak "
    f"learning rate {same['peak_lr']:.4f}, warm-up {same['warmup']:,} of {same['total_steps']:,} "
    f"steps), the training losses of {same['chains'][0]} and the {same['chains'][1]} "
    + ", ".join(said)
    + "."
  ]
  matched = _matched(results)
  if matched:
    out.append(
      f"The replay reproduces the longer-training run's test loss at its evaluations through step "
      f"{matched[0]:,} within {matched[1]:.0e} nats."
    )
  up = min((u for u in ups if u), default=None)
  went = climbs(same["trust_ratios"], up) if up else []
  if went:
    out.append(
      f"Of the trust ratios above 1 at step {up:,}, the first to climb there for good were "
      + ", ".join(f"{n} (from step {t:,})" for t, n in went[:3])
      + "."
    )
  h = np.array(half["loss"], float)[:, 0]
  up, tests = blow_up(h), half["test"]
  rose = "never rose" if up is None else f"first rose at step {up:,}"
  out.append(
    f"At half the peak learning rate ({half['peak_lr']:.4f}) the training loss {rose} more than "
    f"{budget_report.DIVERGED_RISE} nats above its best through step {len(h):,}; test loss "
    f"{tests[-1][0]:.3f} at step {half['eval_steps'][-1]:,}."
  )
  return out


def format_report(results: dict) -> str:
  return " ".join(findings(results))


def main(argv=None) -> dict:
  epilog = "The claim preset trains 3,900 steps at batch 512 (about 30 min on 2 CPUs)."
  run = lambda preset, out, previous: run_replays(PRESETS[preset], out=out, previous=previous)
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, run, format_report)


if __name__ == "__main__":
  main()
