"""Runs of lamb on the option tree, each compiled once per (implementation, case) and cached.

A run takes `options.STEPS` steps from `trees.make_params(seed)`: one jitted step
advances both ``update`` + ``optax.apply_updates`` (every intermediate params
and state kept) and ``update_and_apply``. `reference_run` is the float64 NumPy
LAMB on the same gradients; `assert_runs_agree` compares two runs with the
tolerances of `helpers.asserts`, widened by the reference's bound on how far
runs that store rounded moments may drift apart.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import numpy as np
import optax
from helpers import asserts, fast_compile
from helpers.options import CASES, STEPS, build, reference
from helpers.trees import by_path, make_grads, make_params

import optax_lamb


class Run(NamedTuple):
  params: list  # params[t]: after t steps of update + apply_updates (params[0]: the start)
  states: list  # states[t]: likewise
  grads: list
  fused: tuple  # (params, state) after every step of update_and_apply


def update_then_apply(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@functools.cache
def stepper(implementation: str, case: str):
  """(tx, a jitted step advancing (params, state) by update + apply and by update_and_apply)."""
  tx = build(CASES[case].lamb, implementation)

  def step(unfused, fused, grads):
    fused_params, fused_state = optax_lamb.update_and_apply(tx, grads, fused[1], fused[0])
    return update_then_apply(tx, *unfused, grads), (fused_params, fused_state)

  return tx, fast_compile.jit(step)


def inputs(case: str, seed: int, steps: int = STEPS):
  params = make_params(seed)
  return params, [make_grads(params, seed + 1 + t, CASES[case].grad_scale) for t in range(steps)]


@functools.lru_cache(maxsize=256)
def run(implementation: str, case: str, seed: int) -> Run:
  tx, step = stepper(implementation, case)
  params, grads = inputs(case, seed)
  unfused = fused = (params, tx.init(params))
  runs = [unfused]
  for g in grads:
    unfused, fused = step(unfused, fused, g)
    runs.append(unfused)
  return Run([p for p, _ in runs], [s for _, s in runs], grads, fused)


class ReferenceRun(NamedTuple):
  params: dict  # by path, after every step
  ref: Any  # the NumpyLamb after the last step (ratios, condition numbers, drift bounds)
  moved: dict  # by path: the sum over the steps of the largest |update| of the leaf
  constants_drift: dict  # by path: what float32 b1, b2 may move the leaf by, over the steps


def _float64(tree) -> dict:
  return {name: np.asarray(x, np.float64) for name, x in by_path(tree).items()}


@functools.lru_cache(maxsize=64)
def reference_run(case: str, seed: int) -> ReferenceRun:
  params, grads = inputs(case, seed)
  ref = reference(CASES[case].reference)
  p = _float64(params)
  moved, constants_drift = dict.fromkeys(p, 0.0), dict.fromkeys(p, 0.0)
  for g in grads:
    new = ref.step(p, _float64(g))
    for n in p:
      largest = float(np.max(np.abs(new[n] - p[n]), initial=0.0))
      moved[n] += largest
      constants_drift[n] += largest * ref.float32_constants_rtol
    p = new
  return ReferenceRun(p, ref, moved, constants_drift)


def params_atol(ref_run: ReferenceRun, name: str, rtol: float, float64: bool = False) -> float:
  """rtol on each step's update of the leaf, the moment-storage drift, one rounding of the params.

  Against the float64 reference (`float64`), also the drift from float32 b1 and b2.
  """
  largest = float(np.max(np.abs(ref_run.params[name]), initial=0.0))
  constants = ref_run.constants_drift[name] if float64 else 0.0
  return (
    rtol * ref_run.moved[name]
    + constants
    + ref_run.ref.storage_drift.get(name, 0.0)
    + asserts.FLOAT32_EPS * largest
  )


def ratio_rtol(ref_run: ReferenceRun, name: str, rtol: float, float64: bool = False) -> float:
  """The last ratios: rtol and the params' drift (relative), times the ratio's condition number.

  Plus the moment-storage drift, and against float64 the float32 b1, b2.
  """
  ref = ref_run.ref
  largest = float(np.max(np.abs(ref_run.params[name]), initial=0.0))
  drift = params_atol(ref_run, name, rtol, float64) / largest if largest else 0.0
  constants = ref.float32_constants_rtol if float64 else 0.0
  return ref.ratio_condition[name] * (rtol + drift) + ref.storage_ratio_rtol + constants


def assert_params_agree(got, want, ref_run: ReferenceRun, rtol: float) -> None:
  got, want = by_path(got), by_path(want)
  assert got.keys() == want.keys()
  for name in got:
    assert got[name].dtype == want[name].dtype, name
    asserts.assert_close_to_reference(
      got[name], want[name], rtol=rtol, atol=params_atol(ref_run, name, rtol), err_msg=name
    )


def assert_states_agree(got, want, ref_run: ReferenceRun, rtol: float) -> None:
  """Same structure, shapes and dtypes; moments, ratios and counts agree."""
  chex.assert_trees_all_equal_structs(got, want)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  assert_moments_agree(got, want, rtol)
  got_ratios, want_ratios = (by_path(optax_lamb.trust_ratios(s)) for s in (got, want))
  for name, r in got_ratios.items():
    tolerance = ratio_rtol(ref_run, name, rtol)
    asserts.assert_close_to_reference(r, want_ratios[name], rtol=tolerance, atol=0, err_msg=name)
  counts = [x for x in jax.tree.leaves((got, want)) if np.issubdtype(x.dtype, np.integer)]
  half = len(counts) // 2
  for a, b in zip(counts[:half], counts[half:], strict=True):
    np.testing.assert_array_equal(a, b)


def assert_moments_agree(got, want, rtol: float) -> None:
  """The states' moments: to rtol in float32, within one ulp where stored narrower."""
  for field in ("mu", "nu"):
    for name, a in by_path(optax.tree_utils.tree_get(got, field)).items():
      b = by_path(optax.tree_utils.tree_get(want, field))[name]
      if np.dtype(a.dtype).itemsize < 4:  # stored rounded: one unit in the last place
        asserts.assert_within_ulps(a, b, a.dtype, 1, err_msg=f"{field}{name}")
      else:
        scale = asserts.FLOAT32_EPS * float(np.max(np.abs(np.asarray(b, np.float64)), initial=0))
        asserts.assert_close_to_reference(a, b, rtol=rtol, atol=scale, err_msg=f"{field}{name}")


def assert_runs_agree(got: tuple, want: tuple, ref_run: ReferenceRun, rtol: float) -> None:
  """Two (params, state) pairs reached from the same start and gradients."""
  assert_params_agree(got[0], want[0], ref_run, rtol)
  assert_states_agree(got[1], want[1], ref_run, rtol)
