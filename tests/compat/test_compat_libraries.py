"""optax_lamb.compat against each library: every case of cases.py, on every implementation.

Each constructor runs its library's case for problem.STEPS steps (one jitted scan per case and
implementation) and must land within TOLERANCE of each leaf's largest value, after the first
step and after the last, of:

  * the library itself, recorded by record_goldens.py (timm, torch_optimizer, Keras, TF Addons);
  * the library's float64 NumPy reference (all six; the only check for apex and DeepSpeed,
    which need CUDA).

float32 rounding stays near 1e-5 here; one formula choice apart is 1e-3 or more
(test_references.test_problem_tells_choices_apart). Run with -s to see the worst differences.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import cases
import numpy as np
import problem
import pytest
import run_references
from compat_runs import CONSTRUCTORS, IMPLEMENTATIONS, compat_kwargs, trajectory
from test_references import worst_difference

GOLDENS = Path(__file__).resolve().parent / "goldens"
TOLERANCE = 1e-4  # of each leaf's largest value: float32 against the libraries' own runs
LIBRARY_CASES = [(library, case) for library in cases.CASES for case in cases.CASES[library]]


@functools.cache
def _golden(library: str) -> dict[str, dict[str, dict[str, np.ndarray]]]:
  """{case: {'step1' | 'final': params}} recorded from the library."""
  arrays = np.load(GOLDENS / f"{library}.npz")
  recorded = json.loads((GOLDENS / f"{library}.json").read_text())["cases"]
  return {
    case: {
      when: {name: arrays[f"{case}/{when}/{name}"] for name in problem.NAMES}
      for when in ("step1", "final")
    }
    for case in recorded
  }


@functools.cache
def _reference(library: str, case: str):
  return run_references.trajectory(library, case)


def _expected(library: str, case: str) -> dict[str, dict]:
  """{source: {'step1' | 'final': params}}: the reference, and the library where recorded."""
  expected = {"reference": _reference(library, case)}
  if library in cases.RECORDED:
    expected[library] = _golden(library)[case]
  return expected


def _fallbacks(caught) -> list[str]:
  return [str(w.message) for w in caught if "runs on the xla path" in str(w.message)]


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("library,case", LIBRARY_CASES)
def test_compat_reproduces_library(library, case, implementation):
  kwargs = compat_kwargs(library, case)
  tx = CONSTRUCTORS[library](**kwargs, implementation=IMPLEMENTATIONS[implementation])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ours = trajectory(tx)
  if implementation == "pallas" and kwargs.get("caution"):
    assert len(_fallbacks(caught)) == 1 and "caution" in _fallbacks(caught)[0], caught
  else:
    assert _fallbacks(caught) == []
  for source, theirs in _expected(library, case).items():
    for when in ("step1", "final"):
      worst, leaf = worst_difference(ours[when], theirs[when])
      print(f"{library} {case} {implementation} vs {source} after {when}: {worst:.1e} on {leaf}")
      assert worst <= TOLERANCE, (
        f"{library} {case} on {implementation}, after {when}: {worst:.2e} of {source} on {leaf}"
      )


def test_every_recorded_case_is_checked():
  """The goldens hold exactly the cases run here (record_goldens.py and cases.py agree)."""
  for library in cases.RECORDED:
    assert set(_golden(library)) == set(cases.CASES[library])
