"""8-bit moments, measured for quality: LAMB with block-wise quantized moments against float32.

    python -m optax_lamb_recipes.moments8                # trains what notebooks/results/moments8.json lacks
    LAMB_QUICK=1 python -m optax_lamb_recipes.moments8   # the CI preset (seconds), to moments8_ci.json

LAMB trains twice on every seed: once with float32 moments and once with
``optax_lamb.lamb(..., mu_dtype=jnp.int8, nu_dtype=jnp.uint8)`` (docs/quantized_moments.md), all
else the same: the searched LAMB settings of ``search.py`` at batch 16 and batch 512, the sample
budget of the search (1x) and 4x of it, the schedule stretched as in the longer runs
(``budget.py``), seeds 0 to 4 (model initialisation, data order and masks). The final test losses
are compared paired by seed and test sequence (``analysis.t_interval``: 8-bit minus float32, with
its 95% t-interval over the seeds). Nothing is tuned for the 8-bit moments. The results file is written after every
run; running the command again resumes where it stopped (a run cut short trains again from its
start).

In the recipe's model (hidden 64) the leaves of 4,096 elements or more are quantized: the
embedding, the MLP kernels and the attention kernels, whose last axes (64, 256, 16) give blocks
of 16 to 256 elements; biases and LayerNorm scales keep float32 moments.

Prediction, written before the runs. docs/quantized_moments.md predicts (and measures) a relative
RMS error of about 1.1% in m and below 0.6% in v per step, unbiased, about 1% per element of
the Adam direction and well under 0.1% in its norm, hence in the trust ratio. That is a small
unbiased perturbation of each step, far smaller than the minibatch noise of the gradient, and it
does not accumulate as a bias (each step re-quantizes the new moments, rounding to nearest). So:

- At 1x, where every seed of the float32 runs ends within about 0.03 (batch 16) and 0.05 nats
  (batch 512) of the others (search.json), the difference 8-bit minus float32 lies within
  +-0.02 nats at both batches, and its 95% interval contains zero (no difference resolved; the
  interval's half-width about 0.02 at batch 16 and 0.04 at batch 512).
- At 4x the float32 runs leave the plateau (about 5.3 nats) at seed-dependent times, and the
  final test losses of one setting range over 2 nats across seeds (budget.json: 3.3 to 5.2 at
  batch 16). A perturbation of the trajectory can move that drop either way, so the paired
  differences of single seeds may reach a nat either way while the mean has no systematic sign:
  the interval contains zero and is wide (half-width of several tenths of a nat), so 4x can
  bound the difference only loosely. A mean beyond +0.1 nats with an interval above zero would
  contradict this prediction.

CPU budget, from the wall times the committed files record (2 CPUs, AMD EPYC, the machine to
itself): a float32 run at 1x took 37 to 42 s at either batch (search.json, seeds 1 to 4), one at
4x 125 to 144 s (budget.json, seeds 1 and 2). The 8-bit step costs more on the CPU (codes
decoded and encoded, in one fused pass): taking it at up to 1.5x, the 20 runs at 1x need about
16 min and the 20 runs at 4x about 55 min, about 70 min of wall time in all on a quiet
machine; the process uses up to 2 CPUs, so up to about 2 h of CPU time, the issue's limit.
The runs are ordered so that the most informative come first: 1x, both batches and all five
seeds (both arms of a seed and batch one after the other), then 4x seed by seed; a job stopped
at the limit leaves the 1x comparison whole and the 4x one on the seeds it reached (the report
says how many).

Measured after the job started (2026-11-26, 2 CPUs, Intel Xeon, load average near 10, nice 15):
1x seed 0, both batches and both arms (4 runs, compilation included) took 460 s of CPU and 512 s
of wall time, the 8-bit runs 1.2x to 1.6x the float32 ones' wall time. At that rate the 20 runs at
1x take about 40 min of CPU and the 20 at 4x (each about 4x the steps) about 2 to 2.5 h more:
the whole grid, about 3 h of CPU, exceeds the issue's limit by about an hour on this busy
machine. Stopped at 2 h, it ends within 4x near seed 2 (three seeds, the fewest a verdict takes);
1x comes first for that reason.

Seeds 5 to 9 at 4x (added 2026-12-02, before their runs): the five seeds at 4x left the batch-16
verdict to one seed (+1.1 nats; the other four -0.001 to +0.15), so 4x runs on ten. Budget, from
this file's wall times: float32 at 4x took about 125-145 s at batch 512 and about 480 s at batch
16 with the machine to itself, 8-bit up to 1.5x that: about 30 min for batch 512's ten runs
(first: the cheaper batch) and about 100 min for batch 16's, at low priority beside other jobs
up to twice that. Prediction: as for seeds 0 to 4, no systematic sign, an interval containing
zero, narrower by about the square root of two.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from optax_lamb_recipes import analysis, budget, presets, records, search
from optax_lamb_recipes import train as train_lib

ARMS = {
  "float32": train_lib.OptimizerConfig(),
  "8-bit": train_lib.OptimizerConfig(mu_dtype="int8", nu_dtype="uint8"),
}
PREDICTION = 0.02  # nats: the predicted bound on |8-bit minus float32| at 1x (module docstring)


@dataclasses.dataclass(frozen=True)
class Moments8Config:
  name: str
  search: str  # the random search's results JSON ("": a fresh ci search, for CI)
  runs: tuple[tuple[int, int, tuple[int, ...]], ...]  # (multiple, seed, batches), in order


PRESETS = {
  "claim": Moments8Config(
    "claim",
    os.path.join("notebooks", "results", "search.json"),
    runs=tuple((1, s, (16, 512)) for s in range(5))
    + tuple((4, s, (16, 512)) for s in range(5))
    # 4x on five more seeds (issue 55: ten seeds where learning happens), the cheaper batch first
    + tuple((4, s, (512,)) for s in range(5, 10))
    + tuple((4, s, (16,)) for s in range(5, 10)),
  ),
  "ci": Moments8Config("ci", "", runs=((1, 0, (16,)), (1, 1, (16,)), (2, 0, (16,)))),
}
DEFAULT_OUT = {
  "claim": os.path.join("notebooks", "results", "moments8.json"),
  "ci": "moments8_ci.json",
}


def key(run: dict) -> tuple:
  return run["multiple"], run["seed"], run["batch"], run["moments"]


def run_moments8(cfg: Moments8Config, searched: dict, *, out: str, previous: dict | None = None):
  """Train every missing run (float32, then 8-bit, per budget, seed and batch), writing ``out``
  after each; the results dict."""
  start = time.perf_counter()
  scfg = presets.from_json(searched["config"])
  settings = {b: s for (f, b), s in budget.chosen_settings(searched).items() if f == "lamb"}
  runs = list(previous["runs"]) if previous else []
  earlier = list(previous["sessions"]) if previous else []
  have = {key(r) for r in runs}

  def save(group, multiple, moments):
    runs.extend(g | {"multiple": multiple, "moments": moments} for g in group)
    records.write_json(_results(cfg, searched, runs, earlier + [records.session(start)]), out)
    r = group[0]
    print(
      f"{multiple}x seed {r['seed']} B={r['batch']} {moments}: test {records.final(r, 'test'):.3f}"
      f", {r['group_seconds']:.0f} s",
      flush=True,
    )

  for multiple, seed, batches in cfg.runs:
    longer = dataclasses.replace(scfg, samples=scfg.samples * multiple)
    for b in batches:
      for moments, opt in ARMS.items():
        if (multiple, seed, b, moments) in have:
          continue
        s = settings[b]
        search.train_trials(
          longer, seed, "lamb", b, {s["trial"]: s["hyper"]}, 1,
          lambda g, m=multiple, a=moments: save(g, m, a), keep_ratios=True, opt=opt,
        )  # fmt: skip
  sessions = earlier + [records.session(start)] if len(runs) > len(have) else earlier
  return _results(cfg, searched, runs, sessions)


def _results(cfg: Moments8Config, searched: dict, runs: list[dict], sessions: list[dict]) -> dict:
  return {
    "moments8": dataclasses.asdict(cfg),
    "arms": {k: dataclasses.asdict(v) for k, v in ARMS.items()},
    "config": searched["config"],
    "data": searched["data"],
    "chosen": [
      {"family": f, "batch": b} | s
      for (f, b), s in budget.chosen_settings(searched).items()
      if f == "lamb"
    ],
    "runs": runs,
    "sessions": sessions,
    "wall_seconds": sum(s["wall_seconds"] for s in sessions),
    "cpu_seconds": sum(s["cpu_seconds"] for s in sessions),
  }


def table(results: dict) -> dict[tuple[int, int], dict]:
  """``(multiple, batch) -> {"float32", "8-bit", "difference"}``: each a `analysis.t_interval`
  (mean and 95% t-interval over the seeds) of the final test loss over the seeds both arms have, the difference
  8-bit minus float32 paired by seed and test sequence; ``seed_list`` and ``per_seed`` (each
  seed's mean difference) with it."""
  by = {key(r): r for r in results["runs"]}
  out = {}
  for multiple, b in sorted({(r["multiple"], r["batch"]) for r in results["runs"]}):
    seeds = sorted(
      s for m, s, bb, a in by if (m, bb, a) == (multiple, b, "8-bit")
      and (m, s, bb, "float32") in by
    )  # fmt: skip
    if not seeds:
      continue
    loss = {
      a: np.array([by[multiple, s, b, a]["test_per_sequence"] for s in seeds], float) for a in ARMS
    }
    diff = loss["8-bit"] - loss["float32"]
    out[multiple, b] = {
      "float32": analysis.t_interval(loss["float32"]),
      "8-bit": analysis.t_interval(loss["8-bit"]),
      "difference": analysis.t_interval(diff),
      "seed_list": seeds,
      "per_seed": diff.mean(axis=1).tolist(),
    }
  return out


def format_table(results: dict) -> str:
  """Markdown: per budget and batch, each arm's final test loss and the paired difference."""
  lines = [
    "LAMB with 8-bit block-wise quantized moments against float32 moments, the searched settings "
    "of each batch; final test loss (nats), mean over seeds [95% t-interval] (each seed's), and "
    "8-bit minus float32 paired by seed and test sequence (positive: 8-bit worse):",
    "",
    "| budget | batch | float32 | 8-bit | 8-bit minus float32 | seeds |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  for (m, b), row in table(results).items():
    d = row["difference"]
    cells = analysis.loss_cell(row["float32"]), analysis.loss_cell(row["8-bit"])
    lines.append(
      analysis.markdown_row([f"{m}x", b, *cells, analysis.difference_cell(d), d["seeds"]])
    )
  return "\n".join(lines)


def findings(results: dict) -> list[str]:
  """Per budget and batch, one sentence: is the difference resolved (its interval off zero), and
  is it within the prediction (`PREDICTION` at 1x)."""
  out = []
  for (m, b), row in table(results).items():
    d = row["difference"]
    if d["seeds"] < analysis.MIN_SEEDS:
      out.append(f"{m}x, B={b}: {d['seeds']} seed(s) so far, mean difference {d['mean']:+.3f}.")
      continue
    side = analysis.side(d, better=("8-bit better", "8-bit worse"))
    said = f"{m}x, B={b}: {side} ({analysis.difference_cell(d, False)} nats, {d['seeds']} seeds)"
    if m == 1:
      within = max(abs(d["low"]), abs(d["high"])) <= PREDICTION
      said += (
        f"; the interval lies within the predicted +-{PREDICTION}"
        if within
        else f"; the interval reaches beyond the predicted +-{PREDICTION}"
      )
    out.append(said + ".")
  return out


def format_report(results: dict) -> str:
  """Markdown: the paired table, the findings, the compute."""
  compute = f"{len(results['runs'])} runs, {records.compute_used(results)}." if results[
    "sessions"
  ] else ""  # fmt: skip
  return "\n\n".join([format_table(results), " ".join(findings(results)), compute])


# The ci search's model with an MLP of 128, so that its MLP kernels (32 x 128) reach the 4,096
# elements from which moments are quantized (`optax_lamb.core._quantize.MIN_SIZE`): the ci model's
# leaves are all smaller.
_CI = search.PRESETS["ci"]
CI_SEARCH = dataclasses.replace(
  _CI,
  sweep=dataclasses.replace(_CI.sweep, model=dataclasses.replace(_CI.sweep.model, mlp=128)),
  trials=1,  # the ci job trains batch 16 only, from one trial per optimizer on one seed
  seeds=(0,),
  batches=(16,),
)


def _job(preset: str, out: str, previous: dict | None) -> dict:
  cfg = PRESETS[preset]
  ci_search = lambda: search.run_search(CI_SEARCH, out="moments8_search_ci.json")
  return run_moments8(cfg, records.input_results(cfg.search, ci_search), out=out, previous=previous)


def main(argv=None) -> dict:
  claim = PRESETS["claim"].runs
  epilog = (
    f"The claim preset trains {len(ARMS) * sum(len(b) for _, _, b in claim)} runs (float32 and "
    "8-bit moments, 5 seeds, batch 16 and 512, 1x then 4x the search's samples); measured times "
    "are in the results' sessions. The ci preset takes seconds."
  )
  return records.run_resumable(argv, __doc__, epilog, PRESETS, DEFAULT_OUT, _job, format_report)


if __name__ == "__main__":
  main()
