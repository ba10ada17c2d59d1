"""Steps to a target with the resolution of the evaluations: crossings, medians over seeds,
ratios and doublings judged at both ends of the brackets."""

import math

import numpy as np
import pytest

from optax_lamb_recipes import steps


def _run(curve, batch=16, every=10):
  return {"batch": batch, "samples": [batch * every * (i + 1) for i in range(len(curve))],
          "test": curve}  # fmt: skip


def test_crossing_is_bracketed_by_the_evaluations_around_it():
  x = np.array([10.0, 20.0, 30.0])
  assert steps.crossing(x, [6.0, 5.0, 4.0], 5.5) == (15.0, 10.0, 20.0)
  assert steps.crossing(x, [5.0, 4.0, 3.0], 5.5) == (10.0, 0.0, 10.0)  # before the first
  assert steps.crossing(x, [6.0, 5.9, 5.8], 5.5) is None
  # a loss that stopped being finite never reaches the target
  assert steps.run_crossing(_run([6.0, None, None]), 1.0) is None


def test_median_over_seeds_counts_a_seed_that_never_reaches_as_infinite():
  runs = [_run([6.0, 5.0, 4.0]), _run([6.0, 5.8, 5.0]), _run([6.0, 5.9, 5.8])]
  got = steps.median(runs, 5.5)
  # crossings at 15 (10-20) and 20 + 10 * 0.3 / 0.8 (20-30); the third never: after step 30
  assert got["median"] == pytest.approx(20 + 10 * 0.3 / 0.8)
  assert (got["low"], got["high"]) == (20.0, 30.0)
  assert (got["reached"], got["seeds"], got["spacing"]) == (2, 3, 10.0)
  worse = steps.median(runs[1:], 5.5)  # one of two: the median never
  assert not steps.reached(worse) and math.isinf(worse["median"])
  assert steps.cell(worse) == "never (1/2 seeds)"
  assert steps.cell(got) == "24 (20-30, 2/3 seeds)"
  assert steps.median([], 5.5) is None and steps.cell(None) == "-"


def _m(median, low, high):
  return {"median": median, "low": low, "high": high, "reached": 3, "seeds": 3, "spacing": 1}


def test_ratio_and_doubling_hold_at_both_ends_of_the_brackets():
  small, big = _m(900, 800, 1000), _m(400, 350, 450)
  r = steps.ratio(small, big)
  assert r == pytest.approx((900 / 400, 800 / 450, 1000 / 350))
  assert steps.doubling(small, big) == "pays"  # 450 <= 2/3 of 800
  assert steps.doubling(small, _m(600, 500, 700)) == "unresolved"  # 2/3 of 800-1000: 533-667
  assert steps.doubling(small, _m(800, 700, 900)) == "does not pay"  # 700 > 667
  never = {"median": math.inf, "low": 1000.0, "high": math.inf, "reached": 0, "seeds": 3}
  assert steps.doubling(small, never) == "does not pay"  # its runs ended past 2/3 of 1000
  assert steps.doubling(small, never | {"low": 500.0}) == "unresolved"  # ended too early to say
  assert steps.doubling(never, small) is None and steps.ratio(small, never) is None
  by_batch = {16: _m(900, 800, 1000), 32: _m(400, 350, 450), 64: _m(250, 200, 300), 128: None}
  assert steps.paying_range(by_batch) == (32, 64)  # 300 > 2/3 of 350: unresolved at 64
  assert steps.paying_range({16: small, 32: _m(800, 700, 900)}) == (None, None)
