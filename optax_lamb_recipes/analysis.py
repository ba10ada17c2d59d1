"""Statistics of the claim study (``study.json``): arm means with intervals, paired differences.

Every run keeps its final model's loss on each test sequence, and LAMB and AdamW runs of one
seed share the model's initialisation and the order and masks of the training data. A
comparison is therefore paired twice: by seed and by test sequence. Each seed's difference is
first averaged over the test sequences (the pairing by sequence cancels the sequences' shared
difficulty); the interval is then a Student t-interval over those per-seed values, with n - 1
degrees of freedom (`t_interval`). It keeps its 95% coverage at three to five seeds, where a
percentile bootstrap over the seeds cannot reach past the smallest and the largest per-seed
value and covers far less (`bootstrap`, kept for the test set's own sampling error of one run).
The interval is conditional on the test set: it covers the spread from seed to seed (model
initialisation, data order and masks) on these 768 test sequences.
"""

from __future__ import annotations

import numpy as np
from scipy import stats  # a dependency of jax

from optax_lamb_recipes import records, report, steps

RESAMPLES = 4000
LEVEL = 0.95
# Test-loss targets for steps-to-target: between the context-free baseline (5.93) and the best
# final losses (5.34), each reached by batch 16 after its first evaluation (at 480 steps).
STEP_TARGETS = (5.7, 5.6, 5.5)
# Seeds a verdict (a side of zero, a median) needs; with fewer a table shows the plain mean.
MIN_SEEDS = 3


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


def t_quantile(probability: float, df: int) -> float:
  """The ``probability`` quantile of Student's t distribution with ``df`` degrees of freedom."""
  return float(stats.t.ppf(probability, df))


def t_interval(table: np.ndarray) -> dict:
  """Mean of ``table[seed, sequence]`` and its Student t-interval at ``LEVEL`` over the seeds.

  Each seed's mean over the test sequences first (``per_seed``); then the mean of those, and
  ``t * s / sqrt(n)`` either side of it, ``s`` their standard deviation and ``t`` the two-sided
  quantile with ``n - 1`` degrees of freedom. One seed has no spread to measure: its interval is
  unbounded, so no verdict rests on it.
  """
  table = np.asarray(table, float)
  if table.ndim != 2 or table.shape[0] == 0:
    raise ValueError(f"table must be [seeds, sequences] with a seed, got shape {table.shape}")
  per_seed = table.mean(axis=1)
  n, mean = len(per_seed), float(per_seed.mean())
  half = np.inf
  if n > 1:
    t = t_quantile((1 + LEVEL) / 2, n - 1)
    half = t * float(per_seed.std(ddof=1)) / np.sqrt(n)
  return {
    "mean": mean, "low": mean - half, "high": mean + half, "seeds": n,
    "per_seed": per_seed.tolist(),
  }  # fmt: skip


def bootstrap(table: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
  """Mean of ``table[seed, sequence]`` and its two-level bootstrap interval at ``LEVEL``.

  Not used for verdicts: over three to five seeds its interval cannot reach past the smallest
  and the largest seed and covers less than ``LEVEL``. With one seed it measures the sampling
  error of the test set alone."""
  n_seeds, n_seq = table.shape
  rng = np.random.default_rng(seed)
  seed_counts = _counts(rng.integers(0, n_seeds, (resamples, n_seeds)), n_seeds)
  seq_counts = _counts(rng.integers(0, n_seq, (resamples, n_seq)), n_seq)
  means = np.einsum("rs,sq,rq->r", seed_counts, table, seq_counts) / (n_seeds * n_seq)
  lo, hi = np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
  return {"mean": float(table.mean()), "low": float(lo), "high": float(hi), "seeds": n_seeds}


def paired(lamb: tuple[list[int], np.ndarray], adamw: tuple[list[int], np.ndarray], seeds=None):
  """``lamb``, ``adamw`` and ``difference`` (LAMB minus AdamW), each a `t_interval` over the
  seeds both have (and in ``seeds``, when given), paired by seed and test sequence; None if none."""
  (s1, l1), (s2, l2) = lamb, adamw
  common = sorted(set(s1) & set(s2) & (set(s1) if seeds is None else set(seeds)))
  if not common:
    return None
  l1, l2 = l1[[s1.index(s) for s in common]], l2[[s2.index(s) for s in common]]
  return {"lamb": t_interval(l1), "adamw": t_interval(l2), "difference": t_interval(l1 - l2)}


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
        out[arm][b] = t_interval(table) | {"seed_list": seeds}
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
        out[protocol][b] = t_interval(diff) | {"seed_list": common}
  return out


def baseline(results: dict) -> float | None:
  """The context-free (token frequency) test loss at the study's sequence length, if known."""
  return (results["data"].get("unigram_loss") or {}).get(str(results["config"]["seq_len"]))


def steps_to_target(results: dict, arm: str, target: float) -> dict[int, dict | None]:
  """Batch -> `steps.median` of the arm's runs (one per seed): the median over seeds of the
  optimizer steps until the test loss first reaches ``target``, with its bracket.

  Shallue et al. (2019) measure this with the schedule tuned for each target; here each run's
  schedule is the one tuned for the final loss of the whole budget, so a run that reaches the
  target early would have reached it with fewer steps under a shorter schedule: an upper bound.
  """
  return {b: steps.median(arm_runs(results, arm, b), target) for b in results["config"]["batches"]}


def _spacing(results: dict) -> str:
  """The evaluations' spacing in steps at the smallest and the largest batch."""
  batches = results["config"]["batches"]
  run = lambda b: next(r for r in results["runs"] if r["batch"] == b)  # noqa: E731
  every = [float(np.diff(run(b)["samples"]).max()) / b for b in (min(batches), max(batches))]
  return (
    f"every {every[0]:,.0f} steps at B={min(batches)} to every {every[1]:,.0f} at B={max(batches)}"
  )


def format_steps_to_target(
  results: dict, targets=STEP_TARGETS, protocol="retuned per batch"
) -> str:
  """Markdown: the median steps to each target per optimizer and batch, with brackets, and how
  far doubling the batch surely paid (`steps.paying_range`)."""
  batches = results["config"]["batches"]
  lines = [
    f"Optimizer steps until the test loss first reaches a target: median over seeds (both "
    f"{protocol}), interpolated between evaluations, and in brackets the steps of the evaluations "
    f"around it (medians over seeds; evaluations {_spacing(results)}). Last column: the largest "
    f"batch up to which every doubling surely cut the steps to {steps.PAYING_DOUBLING:.2f} or "
    f"less, at both ends of the brackets, or where the first doubling stays unresolved.",
    "",
    "| target | optimizer | " + " | ".join(f"B={b}" for b in batches) + " | doubling pays |",
    "|---:|---|" + "---:|" * (len(batches) + 1),
  ]
  for target in targets:
    for family, label in report.OPTIMIZERS.items():
      got = steps_to_target(results, report.arm_name(family, protocol), target)
      cells = [steps.cell(got.get(b)) for b in batches]
      lines.append(markdown_row([f"{target:.2f}", label, *cells, _paying(got)]))
  return "\n".join(lines)


def _paying(by_batch: dict[int, dict | None]) -> str:
  """``up to B=X``, then where the next doubling stays unresolved; ``-``: not even the first."""
  largest, unresolved = steps.paying_range(by_batch)
  said = [f"up to B={largest}"] if largest else []
  if unresolved:
    said.append(f"unresolved from B={unresolved // 2} to B={unresolved}")
  return "; ".join(said) or "-"


def _per_target(texts: list[str], targets) -> str:
  """One text for every target where they agree, else each target's."""
  if len(set(texts)) == 1:
    return f"{texts[0]} at every target"
  return ", ".join(f"{x} at {t:.2f}" for x, t in zip(texts, targets, strict=True))


def steps_findings(results: dict, targets=STEP_TARGETS, protocol="retuned per batch") -> str:
  """One paragraph from the steps-to-target table: how far doubling surely paid per optimizer,
  and at how many (target, batch) points one optimizer surely took fewer steps (brackets apart;
  a median that never reached the target counts from the run's last step)."""
  got = {
    (f, t): steps_to_target(results, report.arm_name(f, protocol), t)
    for f in report.OPTIMIZERS
    for t in targets
  }
  fewer = {"lamb": 0, "adamw": 0, "unresolved": 0}
  for t in targets:
    for b in results["config"]["batches"]:
      lamb, adamw = got["lamb", t][b], got["adamw", t][b]
      if steps.reached(lamb) or steps.reached(adamw):
        key = (
          "lamb"
          if lamb["high"] < adamw["low"]
          else "adamw"
          if adamw["high"] < lamb["low"]
          else "unresolved"
        )
        fewer[key] += 1
  paying = lambda f: _per_target([_paying(got[f, t]) for t in targets], targets)  # noqa: E731
  return (
    f"Steps to test loss {'/'.join(f'{t:.2f}' for t in targets)} (median over seeds, both "
    f"{protocol}; ten evaluations per run, {_spacing(results)}). Doubling the batch, judged at "
    f"both ends of the brackets (paying: steps cut to {steps.PAYING_DOUBLING:.2f} or less): LAMB "
    f"{paying('lamb')}; AdamW {paying('adamw')}. Where either reached a target, LAMB surely took "
    f"fewer steps at {fewer['lamb']} (target, batch) points, AdamW at {fewer['adamw']}, and the "
    f"brackets overlap at {fewer['unresolved']}."
  )


def markdown_row(cells) -> str:
  """One row of a Markdown table."""
  return "| " + " | ".join(map(str, cells)) + " |"


def per_seed_text(c: dict, signed: bool = False) -> str:
  """`` (a, b, c)``: each seed's value of a `t_interval` result, in seed order; empty for one."""
  values = c.get("per_seed") or []
  if len(values) < 2:
    return ""
  return " (" + ", ".join(f"{v:+.3f}" if signed else f"{v:.3f}" for v in values) + ")"


def loss_cell(c: dict) -> str:
  """A loss as ``mean [low, high] (per seed)`` (a `t_interval` result); without the interval
  with fewer than `MIN_SEEDS` seeds."""
  text = f"{c['mean']:.3f}"
  if c["seeds"] >= MIN_SEEDS:
    text += f" [{c['low']:.3f}, {c['high']:.3f}]"
  return text + per_seed_text(c)


def difference_cell(c: dict, per_seed: bool = True) -> str:
  """A difference as ``+mean [+low, +high] (+per seed)`` (as `loss_cell`; the per-seed values
  left out without ``per_seed``)."""
  text = f"{c['mean']:+.3f}"
  if c["seeds"] >= MIN_SEEDS:
    text += f" [{c['low']:+.3f}, {c['high']:+.3f}]"
  return text + (per_seed_text(c, signed=True) if per_seed else "")


def _row(label: str, by_batch: dict, batches, cell) -> str:
  return markdown_row([label, *(cell(by_batch[b]) if b in by_batch else "-" for b in batches)])


def format_differences(results: dict) -> str:
  """Markdown: LAMB minus AdamW per protocol and batch, mean [95% interval] and seed count."""
  batches = results["config"]["batches"]
  cell = difference_cell
  lines = [
    "LAMB minus AdamW, final test loss (nats; negative: LAMB better), mean over seeds [95% "
    "t-interval] (each seed's difference):",
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
    "Final test loss per arm (nats), mean over seeds [95% t-interval] (each seed's loss):",
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


def side(d: dict, better=("LAMB better", "AdamW better")) -> str:
  """Where a difference's interval lies: below zero (``better[0]``), above zero (``better[1]``)
  or across it (no difference resolved)."""
  return better[0] if d["high"] < 0 else better[1] if d["low"] > 0 else "no difference resolved"


def sides_of_zero(by_batch: dict[int, dict]) -> str:
  """The batches whose LAMB-minus-AdamW interval lies below zero (LAMB better), above zero (AdamW
  better), or spans it, as one clause each."""
  parts = []
  for label in ("LAMB better", "AdamW better", "no difference resolved"):
    batches = [str(b) for b, d in by_batch.items() if side(d) == label]
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
