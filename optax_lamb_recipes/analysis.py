"""Statistics of the claim study (``study.json``): arm means with intervals, paired differences.

Every run keeps its final model's loss on each test sequence, and LAMB and AdamW runs of one
seed share the model's initialisation and the order and masks of the training data. A
comparison is therefore paired twice: by seed and by test sequence. The intervals come from a
two-level bootstrap that resamples both (seeds with replacement, then test sequences with
replacement, the same draws for both arms of a difference), so they cover both the seed-to-seed
spread and the sampling error of a finite test set.
"""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes import records, report

RESAMPLES = 4000
LEVEL = 0.95
# Test-loss targets for steps-to-target: between the context-free baseline (5.93) and the best
# final losses (5.34), each reached by batch 16 after its first evaluation (at 480 steps).
STEP_TARGETS = (5.7, 5.6, 5.5)
# A doubling of the batch "pays" while it cuts the steps to a target to 2/3 or less.
PAYING_DOUBLING = 2 / 3


def arms(results: dict) -> dict[str, list[float]]:
  return results["tuning"]["chosen_factors"]


def arm_runs(results: dict, arm: str, batch: int) -> list[dict]:
  """The runs (one per seed) an arm reports at ``batch``, by seed."""
  factors = results.get("chosen_factors") or results["tuning"]["chosen_factors"]
  factor = factors[arm][results["config"]["batches"].index(batch)]
  key = (report.FAMILY[arm], batch, factor)
  runs = (r for r in results["runs"] if (r["family"], r["batch"], r["factor"]) == key)
  return sorted(runs, key=lambda r: r["seed"])


def losses(results: dict, arm: str, batch: int) -> tuple[list[int], np.ndarray]:
  """``(seeds, L)``: L[i, q] is the loss on test sequence q of the arm's run with seeds[i]."""
  at = [r for r in arm_runs(results, arm, batch) if r.get("test_per_sequence") is not None]
  return [r["seed"] for r in at], np.array([r["test_per_sequence"] for r in at], float)


def bootstrap(table: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
  """Mean of ``table[seed, sequence]`` and its two-level bootstrap interval at ``LEVEL``."""
  n_seeds, n_seq = table.shape
  rng = np.random.default_rng(seed)
  seed_counts = _counts(rng.integers(0, n_seeds, (resamples, n_seeds)), n_seeds)
  seq_counts = _counts(rng.integers(0, n_seq, (resamples, n_seq)), n_seq)
  means = np.einsum("rs,sq,rq->r", seed_counts, table, seq_counts) / (n_seeds * n_seq)
  lo, hi = np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
  return {"mean": float(table.mean()), "low": float(lo), "high": float(hi), "seeds": n_seeds}


def paired(lamb: tuple[list[int], np.ndarray], adamw: tuple[list[int], np.ndarray], seeds=None):
  """``lamb``, ``adamw`` and ``difference`` (LAMB minus AdamW), each a `bootstrap` over the seeds
  both have (and in ``seeds``, when given), paired by seed and test sequence; None if none."""
  (s1, l1), (s2, l2) = lamb, adamw
  common = sorted(set(s1) & set(s2) & (set(s1) if seeds is None else set(seeds)))
  if not common:
    return None
  l1, l2 = l1[[s1.index(s) for s in common]], l2[[s2.index(s) for s in common]]
  return {"lamb": bootstrap(l1), "adamw": bootstrap(l2), "difference": bootstrap(l1 - l2)}


def _counts(draws: np.ndarray, n: int) -> np.ndarray:
  """How often each of ``n`` items was drawn in each resample (rows of ``draws``)."""
  return np.stack([np.bincount(row, minlength=n) for row in draws]).astype(float)


def arm_table(results: dict) -> dict[str, dict[int, dict]]:
  """Arm -> batch -> mean final test loss with its interval."""
  out = {}
  for arm in arms(results):
    out[arm] = {}
    for b in results["config"]["batches"]:
      seeds, table = losses(results, arm, b)
      if len(seeds):
        out[arm][b] = bootstrap(table) | {"seed_list": seeds}
  return out


def paired_differences(results: dict) -> dict[str, dict[int, dict]]:
  """Protocol -> batch -> LAMB minus AdamW (negative: LAMB better), on the seeds both have."""
  out = {}
  for protocol in report.PROTOCOLS:
    out[protocol] = {}
    for b in results["config"]["batches"]:
      s1, lamb = losses(results, report.arm_name("lamb", protocol), b)
      s2, adamw = losses(results, report.arm_name("adamw", protocol), b)
      common = sorted(set(s1) & set(s2))
      if common:
        diff = lamb[[s1.index(s) for s in common]] - adamw[[s2.index(s) for s in common]]
        out[protocol][b] = bootstrap(diff) | {"seed_list": common}
  return out


def baseline(results: dict) -> float | None:
  """The context-free (token frequency) test loss at the study's sequence length, if known."""
  return (results["data"].get("unigram_loss") or {}).get(str(results["config"]["seq_len"]))


def gain_kept(results: dict, table: dict | None = None) -> dict[str, dict[int, float]]:
  """Arm -> batch -> (baseline - loss at B) / (baseline - loss at the smallest B), in [0, 1]."""
  table = table or arm_table(results)
  base, b_min = baseline(results), min(results["config"]["batches"])
  return {
    arm: {b: (base - c["mean"]) / (base - cells[b_min]["mean"]) for b, c in cells.items()}
    for arm, cells in table.items()
    if b_min in cells
  }


def steps_to_target(results: dict, arm: str, target: float) -> dict[int, float | None]:
  """Batch -> optimizer steps until the arm's test loss (mean over its seeds) first reaches
  ``target``, interpolated linearly between evaluations; None where it never does.

  Shallue et al. (2019) measure this with the schedule tuned for each target; here each run's
  schedule is the one tuned for the final loss of the whole budget, so a run that reaches the
  target early would have reached it with fewer steps under a shorter schedule: an upper bound.
  """
  out = {}
  for b in results["config"]["batches"]:
    runs = arm_runs(results, arm, b)
    if not runs:
      continue
    curve = np.nanmean([records.curve(r, "test") for r in runs], axis=0)
    steps = np.asarray(runs[0]["samples"], float) / b
    out[b] = first_crossing(steps, curve, target)
  return out


def first_crossing(steps: np.ndarray, curve: np.ndarray, target: float) -> float | None:
  """The step where ``curve`` first reaches ``target``, linear between evaluations; or None."""
  below = np.flatnonzero(curve <= target)
  if not below.size:
    return None
  i = below[0]
  if i == 0:
    return float(steps[0])
  x0, x1, y0, y1 = steps[i - 1], steps[i], curve[i - 1], curve[i]
  return float(x0 + (x1 - x0) * (y0 - target) / (y0 - y1))


def largest_paying_batch(steps: dict[int, float | None]) -> int | None:
  """The largest batch B reached by doublings from the smallest that each took the steps to the
  target to `PAYING_DOUBLING` or less of the previous batch's (None: not even the first)."""
  batches, last = sorted(steps), None
  for small, big in zip(batches, batches[1:], strict=False):
    if steps[small] is None or steps[big] is None or steps[big] > PAYING_DOUBLING * steps[small]:
      break
    last = big
  return last


def format_steps_to_target(
  results: dict, targets=STEP_TARGETS, protocol="retuned per batch"
) -> str:
  """Markdown: steps to each target per optimizer and batch, and the largest paying batch."""
  batches = results["config"]["batches"]
  lines = [
    f"Optimizer steps until the test loss (mean over seeds, both {protocol}) first reaches a "
    f"target; '-': never within the budget. Last column: the largest batch up to which every "
    f"doubling cut the steps to {PAYING_DOUBLING:.2f} or less.",
    "",
    "| target | optimizer | " + " | ".join(f"B={b}" for b in batches) + " | paying up to |",
    "|---:|---|" + "---:|" * (len(batches) + 1),
  ]
  for target in targets:
    for family, label in report.OPTIMIZERS.items():
      steps = steps_to_target(results, report.arm_name(family, protocol), target)
      cells = ["-" if steps.get(b) is None else f"{steps[b]:.0f}" for b in batches]
      paying = largest_paying_batch(steps)
      lines.append(f"| {target:.2f} | {label} | " + " | ".join(cells) + f" | {paying or '-'} |")
  return "\n".join(lines)


def steps_findings(results: dict, targets=STEP_TARGETS, protocol="retuned per batch") -> str:
  """One paragraph from the steps-to-target table: the largest paying batch per optimizer, and
  at how many (batch, target) points each needed fewer steps, or reached a target at all."""
  steps = {
    (f, t): steps_to_target(results, report.arm_name(f, protocol), t)
    for f in report.OPTIMIZERS
    for t in targets
  }
  points = [(t, b) for t in targets for b in results["config"]["batches"]]
  reached = lambda f, t, b: steps[f, t].get(b) is not None  # noqa: E731
  both = [(t, b) for t, b in points if reached("lamb", t, b) and reached("adamw", t, b)]
  lamb_fewer = sum(steps["lamb", t][b] < steps["adamw", t][b] for t, b in both)
  only = lambda f, g: sum(reached(f, t, b) and not reached(g, t, b) for t, b in points)  # noqa: E731
  largest = lambda f: ", ".join(str(largest_paying_batch(steps[f, t]) or "-") for t in targets)  # noqa: E731
  return (
    f"Steps to test loss {'/'.join(f'{t:.2f}' for t in targets)} (both {protocol}): doubling "
    f"the batch cut the steps to {PAYING_DOUBLING:.2f} or less up to B={largest('lamb')} for "
    f"LAMB and B={largest('adamw')} for AdamW. Where both reached a target, LAMB took fewer steps "
    f"at {lamb_fewer} of {len(both)} (target, batch) points; LAMB reached a target AdamW never "
    f"did at {only('lamb', 'adamw')} points, AdamW one LAMB never did at {only('adamw', 'lamb')}."
  )


def markdown_row(cells) -> str:
  """One row of a Markdown table."""
  return "| " + " | ".join(map(str, cells)) + " |"


def loss_cell(c: dict) -> str:
  """A loss as ``mean [low, high]`` (a `bootstrap` result)."""
  return f"{c['mean']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"


def difference_cell(c: dict) -> str:
  """A difference as ``+mean [+low, +high]`` (a `bootstrap` result)."""
  return f"{c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"


def _row(label: str, by_batch: dict, batches, cell) -> str:
  return markdown_row([label, *(cell(by_batch[b]) if b in by_batch else "-" for b in batches)])


def format_differences(results: dict) -> str:
  """Markdown: LAMB minus AdamW per protocol and batch, mean [95% interval] and seed count."""
  batches = results["config"]["batches"]
  cell = lambda c: difference_cell(c) + f" n={c['seeds']}"
  lines = [
    "LAMB minus AdamW, final test loss (nats; negative: LAMB better), mean [95% interval], "
    "n seeds:",
    "",
    "| both tuned | " + " | ".join(f"B={b}" for b in batches) + " |",
    "|---|" + "---:|" * len(batches),
  ]
  lines += [_row(p, d, batches, cell) for p, d in paired_differences(results).items()]
  return "\n".join(lines)


def format_arms(results: dict) -> str:
  """Markdown: each arm's final test loss per batch, mean [95% interval]."""
  batches = results["config"]["batches"]
  lines = [
    "Final test loss per arm (nats), mean [95% interval]:",
    "",
    "| arm | " + " | ".join(f"B={b}" for b in batches) + " |",
    "|---|" + "---:|" * len(batches),
  ]
  lines += [_row(arm, d, batches, loss_cell) for arm, d in arm_table(results).items()]
  if baseline(results) is not None:
    lines.append(f"\nContext-free baseline (token frequencies): {baseline(results):.3f} nats")
  return "\n".join(lines)


def format_compute(results: dict) -> str:
  """One sentence: runs, wall and CPU time, sessions, machine, the tuning grid's size."""
  trials = results["tuning"]["trials_per_batch"]
  return (
    f"{len(results['runs'])} runs, {records.compute_used(results)}; learning rates from a grid "
    f"of {trials['lamb']} (LAMB) and "
    f"{trials['adamw']} (AdamW) factors per batch, seed 0, validation split"
  )


def sides_of_zero(by_batch: dict[int, dict]) -> str:
  """The batches whose LAMB-minus-AdamW interval lies below zero (LAMB better), above zero (AdamW
  better), or spans it, as one clause each."""
  parts = []
  for label, keep in (
    ("LAMB better", lambda d: d["high"] < 0),
    ("AdamW better", lambda d: d["low"] > 0),
    ("no difference resolved", lambda d: d["low"] <= 0 <= d["high"]),
  ):
    batches = [str(b) for b, d in by_batch.items() if keep(d)]
    if batches:
      parts.append(f"{label} at B={', '.join(batches)}")
  return "; ".join(parts)


def findings(results: dict) -> list[str]:
  """Per protocol, one sentence: where LAMB minus AdamW lies relative to zero (`sides_of_zero`)."""
  return [
    f"Both {protocol}: {sides_of_zero(by_batch)}."
    for protocol, by_batch in paired_differences(results).items()
  ]


def format_report(results: dict) -> str:
  """Markdown: the paired differences, then every arm's loss, with intervals and seed counts."""
  return format_differences(results) + "\n\n" + format_arms(results)
