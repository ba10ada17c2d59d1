"""Does skipping spikes rescue the run that diverged (LAMB, batch 512, 16x the samples, seed 0)?

    python -m optax_lamb_recipes.spike_rescue    # notebooks/results/spike_rescue.json (hours on CPU)
    LAMB_QUICK=1 python -m optax_lamb_recipes.spike_rescue   # a tiny model, seconds, to spike_rescue_ci.json

The divergence replay (``divergence.py``) trains that run step by step: its training loss goes
from 3.9 to 8.0 within ten steps near step 1,065 of 2,400. This trains it again, the same
micro-batches, schedule and settings, with ``optax_lamb.lamb`` inside
``optax_lamb.skip_nonfinite(..., spikes=SpikeRule(...))`` (in ``optax.MultiSteps``: the rule judges
each accumulated step, and the loss it is given is the mean over the step's micro-batches), once per
variant of `VARIANTS`, to the end of the schedule. Per step it records the training loss, the norm
of the accumulated gradient, whether the step was skipped and the rule's averages; the test loss
every ``eval_every`` steps. Resumable: the params and state are saved beside the results every
``eval_every`` steps (``<out>.<variant>.npz``), and a run started again with the same ``--out``
goes on from there.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lamb
from optax_lamb_recipes import divergence, records, splits
from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes import train as train_lib


@dataclasses.dataclass(frozen=True)
class Variant:
  """A spike rule and its ``max_consecutive_errors`` (after that many skipped steps in a row, the
  next is applied and enters the averages)."""

  rule: optax_lamb.SpikeRule
  max_consecutive_errors: int | None


VARIANTS = {
  "norm x3": Variant(optax_lamb.SpikeRule(factor=3.0, warmup_steps=100, decay=0.99), 50),
  "norm x2": Variant(optax_lamb.SpikeRule(factor=2.0, warmup_steps=100, decay=0.99), 50),
  "norm x3, loss x1.5": Variant(
    optax_lamb.SpikeRule(factor=3.0, warmup_steps=100, decay=0.99, loss_factor=1.5), 50
  ),
}
PRESETS = {
  "claim": dataclasses.replace(divergence.PRESETS["claim"], name="claim", steps=0),
  "ci": dataclasses.replace(divergence.PRESETS["ci"], name="ci", steps=0),
}
DEFAULT_OUT = {
  "claim": os.path.join("notebooks", "results", "spike_rescue.json"),
  "ci": "spike_rescue_ci.json",
}
CI_RULE = optax_lamb.SpikeRule(factor=3.0, warmup_steps=2, decay=0.9, loss_factor=1.5)


def _optimizer(schedule, opt, k: int, variant: Variant) -> optax.GradientTransformation:
  lamb = train_lib.make_optimizer("lamb", schedule, accumulate=1, opt=opt)
  skipping = optax_lamb.skip_nonfinite(
    lamb, spikes=variant.rule, max_consecutive_errors=variant.max_consecutive_errors
  )
  return optax.MultiSteps(skipping, every_k_schedule=k)


def _step_fn(graphdef, tx, k: int):
  """One optimizer step on ``k`` micro-batches: new params and state, the mean loss, and the
  norm of the mean gradient (what the rule judged)."""

  def step(params, state, micro_batches):
    def one(carry, mb):
      p, s, gsum, lsum, i = carry
      loss, g = jax.value_and_grad(model_lib.loss_fn, argnums=1)(graphdef, p, mb)
      gsum = jax.tree.map(jnp.add, gsum, g)
      lsum, i = lsum + loss, i + 1
      u, s = tx.update(g, s, p, value=lsum / i)  # the window's mean loss at its last micro-batch
      return (optax.apply_updates(p, u), s, gsum, lsum, i), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (params, state, zeros, jnp.float32(0), jnp.float32(0))
    (params, state, gsum, lsum, _), _ = jax.lax.scan(one, init, micro_batches)
    return params, state, lsum / k, optax.global_norm(gsum) / k

  return jax.jit(step)


def _save(path: str, params, state) -> None:
  leaves = jax.tree.leaves((params, state))
  tmp = path + ".tmp.npz"
  np.savez(tmp, *[np.asarray(x) for x in leaves])
  os.replace(tmp, path)


def _load(path: str, like) -> tuple:
  with np.load(path) as f:
    leaves = [jnp.asarray(f[f"arr_{i}"]) for i in range(len(f.files))]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def train_variant(scfg, run: dict, variant: Variant, *, done: dict | None, ckpt: str,
                  eval_every: int, save) -> dict:  # fmt: skip
  """The run with `variant` to the end of its schedule, from ``done`` (its record so far, whose
  params and state are in ``ckpt``); ``save(record)`` after every ``eval_every`` steps."""
  batch, seed, total = run["batch"], run["seed"], run["steps"]
  schedule, opt, warmup = divergence._settings(run, total, 1.0)
  k = batch // scfg.micro
  tx = _optimizer(schedule, opt, k, variant)
  train_data, _, test, _ = splits.load_data(scfg, seed)
  stream, test = train_data[scfg.seq_len], test[scfg.seq_len]
  graphdef, params = model_lib.init_params(scfg.model, seed)
  state = tx.init(params)
  out = done or {
    "rule": dataclasses.asdict(variant.rule), "max_consecutive_errors":
    variant.max_consecutive_errors, "peak_lr": run["peak_lr"], "warmup": warmup,
    "total_steps": total, "loss": [], "grad_norm": [], "skipped": [], "norm_average": [],
    "loss_average": [], "eval_steps": [], "test": [],
  }  # fmt: skip
  if out["loss"]:
    params, state = _load(ckpt, (params, state))
  step = _step_fn(graphdef, tx, k)
  evaluate = jax.jit(lambda p: model_lib.loss_fn(graphdef, p, test))
  for t in range(len(out["loss"]), total):
    mb = jax.tree.map(lambda x, t=t: jnp.asarray(x[t * batch : (t + 1) * batch]), stream)
    mb = jax.tree.map(lambda x: x.reshape(k, scfg.micro, -1), mb)
    before = int(optax_lamb.skip_counts(state).total)
    params, state, loss, norm = step(params, state, mb)
    stats = optax_lamb.spike_stats(state)
    out["loss"].append(float(loss))
    out["grad_norm"].append(float(norm))
    out["skipped"].append(int(optax_lamb.skip_counts(state).total) - before)
    out["norm_average"].append(float(stats.norm_average))
    out["loss_average"].append(float(stats.loss_average))
    if (t + 1) % eval_every == 0 or t + 1 == total:
      out["eval_steps"].append(t + 1)
      out["test"].append(float(evaluate(params)))
      _save(ckpt, params, state)
      save(out)
  return out


def run_rescue(preset: str, *, out: str, previous: dict | None = None) -> dict:
  """Every variant of `VARIANTS` (one of `CI_RULE` for ci), each to the end of the schedule;
  ``out`` written as they go, a finished variant not trained again."""
  start = time.perf_counter()
  cfg = PRESETS[preset]
  scfg, run = divergence._source(cfg)
  variants = VARIANTS if preset != "ci" else {"ci": Variant(CI_RULE, 3)}
  results = dict(previous or {})
  results["run"] = {k: run.get(k) for k in ("batch", "seed", "steps", "peak_lr", "hyper")}
  results["run"] |= {"multiple": cfg.multiple, "test": run.get("test"),
                     "samples": run.get("samples")}  # fmt: skip
  results.setdefault("variants", {})
  sessions = list(results.get("sessions", []))

  def save(record: dict, name: str) -> None:
    results["variants"][name] = record
    results["sessions"] = sessions + [records.session(start)]
    results["wall_seconds"] = sum(s["wall_seconds"] for s in results["sessions"])
    results["cpu_seconds"] = sum(s["cpu_seconds"] for s in results["sessions"])
    records.write_json(results, out)

  for name, variant in variants.items():
    done = results["variants"].get(name)
    if done and len(done["loss"]) == run["steps"]:
      continue
    ckpt = f"{out}.{name.replace(' ', '_').replace(',', '')}.npz"
    record = train_variant(scfg, run, variant, done=done, ckpt=ckpt, eval_every=cfg.eval_every,
                           save=lambda r, name=name: save(r, name))  # fmt: skip
    save(record, name)
    print(f"{name}: {len(record['loss'])} steps, {time.perf_counter() - start:.0f} s", flush=True)
  return results


def findings(results: dict) -> list[str]:
  """Per variant: skipped steps (the first few), whether and where the loss blew up, the final
  test loss; and the run without the rule, as recorded."""
  out = []
  for name, v in results["variants"].items():
    skipped = [t + 1 for t, s in enumerate(v["skipped"]) if s]
    up = divergence.blow_up(v["loss"])
    first = ", ".join(f"{t:,}" for t in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
    out.append(
      f"{name}: {len(skipped)} of {len(v['loss']):,} steps skipped"
      + (f" (steps {first})" if skipped else "")
      + ("; the training loss never rose" if up is None else f"; the training loss rose at {up:,}")
      + f" more than the divergence threshold above its best; final test loss {v['test'][-1]:.3f}"
      f" at step {v['eval_steps'][-1]:,}."
    )
  if results["run"].get("test"):
    out.append(
      f"Without the rule (the budget run): final test loss {results['run']['test'][-1]:.3f}."
    )
  return out


def main(argv=None) -> dict:
  epilog = (
    "The claim preset trains each variant 2,400 steps at batch 512 (about 35 min on 2 busy CPUs)."
  )
  run = lambda preset, out, previous: run_rescue(preset, out=out, previous=previous)
  report = lambda results: " ".join(findings(results))
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, run, report)


if __name__ == "__main__":
  main()
