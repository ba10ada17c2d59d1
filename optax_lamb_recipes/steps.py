"""Steps to a test-loss target (Shallue et al. 2019), per seed, with the resolution runs give.

A run's test loss is known only at its evaluations (ten per run here: every 480 steps at batch
16 and 4,800 steps, every 15 at batch 512 and 150), so the step where it first reaches a target
is known to lie between the last evaluation above the target and the first at or below it, its
bracket; the linear interpolation between them is one guess inside it. Over seeds, the median
is reported with the medians of the brackets' ends, which bracket it in turn (a seed that never
reaches the target counts as infinitely many steps, so a median needs more than half the seeds
to reach it). A comparison (a doubling of the batch that pays, one optimizer needing fewer steps)
is called only where it holds at both ends of the brackets.
"""

from __future__ import annotations

import math

import numpy as np

from optax_lamb_recipes import records

# A doubling of the batch "pays" while it cuts the steps to a target to 2/3 or less.
PAYING_DOUBLING = 2 / 3


def crossing(steps, curve, target: float) -> tuple[float, float, float] | None:
  """``(interpolated, low, high)``: the first evaluation at or below ``target`` (``high``), the
  one before it (``low``; 0 before the first) and the linear interpolation between; None if the
  curve never reaches it (a non-finite loss does not)."""
  curve = np.asarray(curve, float)
  below = np.flatnonzero(np.isfinite(curve) & (curve <= target))
  if not below.size:
    return None
  i = int(below[0])
  if i == 0:
    return float(steps[0]), 0.0, float(steps[0])
  x0, x1, y0, y1 = steps[i - 1], steps[i], curve[i - 1], curve[i]
  at = x1 if not np.isfinite(y0) else x0 + (x1 - x0) * (y0 - target) / (y0 - y1)
  return float(at), float(x0), float(x1)


def run_crossing(run: dict, target: float) -> tuple[float, float, float] | None:
  """`crossing` of one run's test curve, in optimizer steps."""
  steps = np.asarray(run["samples"], float) / run["batch"]
  return crossing(steps, records.curve(run, "test"), target)


def median(runs: list[dict], target: float) -> dict | None:
  """Over ``runs`` (one per seed): ``median`` of the interpolated steps to ``target``, ``low`` and
  ``high`` (the medians of the brackets' ends), ``reached`` and ``seeds`` (counts) and
  ``spacing`` (the evaluations' spacing in steps, the largest over the runs); None without runs.
  A run that never reaches the target counts as infinitely many steps, at least its last."""
  if not runs:
    return None
  got = [run_crossing(r, target) for r in runs]
  # never: after the run's last step, if ever
  last = [r["samples"][-1] / r["batch"] for r in runs]
  ends = np.array([g or (math.inf, s, math.inf) for g, s in zip(got, last, strict=True)], float)
  spacing = max(float(np.diff(np.asarray(r["samples"], float)).max()) / r["batch"] for r in runs)
  mid, low, high = (float(np.median(ends[:, j])) for j in range(3))
  return {"median": mid, "low": low, "high": high, "reached": sum(g is not None for g in got),
          "seeds": len(runs), "spacing": spacing}  # fmt: skip


def reached(m: dict | None) -> bool:
  return m is not None and math.isfinite(m["median"])


def cell(m: dict | None) -> str:
  """``median (low-high)``, with how many seeds reached the target where not all did; ``never``
  where the median did not; ``-`` without runs."""
  if m is None:
    return "-"
  some = "" if m["reached"] == m["seeds"] else f", {m['reached']}/{m['seeds']} seeds"
  if not reached(m):
    return f"never ({m['reached']}/{m['seeds']} seeds)"
  high = "never" if math.isinf(m["high"]) else f"{m['high']:,.0f}"
  return f"{m['median']:,.0f} ({m['low']:,.0f}-{high}{some})"


def ratio(small: dict | None, big: dict | None) -> tuple[float, float, float] | None:
  """``(median ratio, lowest, highest)`` of ``small``'s steps over ``big``'s that the brackets
  allow; None unless both medians reached the target."""
  if not (reached(small) and reached(big)):
    return None
  lowest = small["low"] / big["high"]
  highest = math.inf if big["low"] == 0 else small["high"] / big["low"]
  return small["median"] / big["median"], lowest, highest


def ratio_cell(r: tuple[float, float, float] | None) -> str:
  if r is None:
    return "n/a"
  return f"{r[0]:.1f} ({r[1]:.1f}-{'inf' if math.isinf(r[2]) else f'{r[2]:.1f}'})"


def doubling(small: dict | None, big: dict | None) -> str | None:
  """Whether going from ``small``'s batch to ``big``'s (twice as large) cut the median steps to
  `PAYING_DOUBLING` or less: ``"pays"`` or ``"does not pay"`` where the brackets agree,
  ``"unresolved"`` where they do not; None unless the small batch reached the target."""
  if not reached(small):
    return None
  if big["high"] <= PAYING_DOUBLING * small["low"]:
    return "pays"
  if big["low"] > PAYING_DOUBLING * small["high"]:
    return "does not pay"
  return "unresolved"


def paying_range(by_batch: dict[int, dict | None]) -> tuple[int | None, int | None]:
  """``(largest, first unresolved)``: the largest batch up to which every doubling from the
  smallest surely paid (None: not the first), and the batch where the first doubling that was
  not surely paying stayed unresolved (None where it surely did not pay, or all paid)."""
  batches, last = sorted(by_batch), None
  for small, big in zip(batches, batches[1:], strict=False):
    said = doubling(by_batch[small], by_batch[big])
    if said != "pays":
      return last, big if said == "unresolved" else None
    last = big
  return last, None
