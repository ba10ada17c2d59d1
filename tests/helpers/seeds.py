"""The tests' random seeds: fixed by default, one environment variable to explore others.

``OPTAX_LAMB_TEST_SEED`` (read when a test asks for its seed):

- unset or empty: seed 0 for every test, and hypothesis derandomized (the same
  examples every run);
- an integer N: seed N (to replay a failure: the failing test prints the command);
- ``random``: a fresh seed per test, printed on failure, and hypothesis draws new
  examples (more of them; it prints how to reproduce a failure);
- ``A:B``: every test that takes a seed runs once per seed in ``range(A, B)``, and
  each tolerance check reports its worst margin (``tests/tools/seed_sweep.py``).
"""

from __future__ import annotations

import os

import numpy as np

VARIABLE = "OPTAX_LAMB_TEST_SEED"
DEFAULT = 0
EXPLORE_EXAMPLES_FACTOR = 8  # hypothesis examples per test, times its CI count, when exploring


def _value() -> str:
  return os.environ.get(VARIABLE, "").strip()


def exploring() -> bool:
  """Fresh seeds and fresh hypothesis examples were asked for."""
  return _value() == "random"


def sweep() -> range | None:
  """The seeds of a sweep (``A:B``), or None."""
  value = _value()
  if ":" not in value:
    return None
  start, stop = (int(x) for x in value.split(":"))
  return range(start, stop)


def fixed() -> int | None:
  """The one seed every test uses, or None when exploring or sweeping."""
  value = _value()
  if value == "":
    return DEFAULT
  if value == "random" or ":" in value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(
      f"{VARIABLE} must be an integer, 'random' or 'A:B', got {VARIABLE}={value!r}"
    ) from None


def draw() -> int:
  """The seed for one test: the fixed one, else a fresh one."""
  seed = fixed()
  return int(np.random.SeedSequence().entropy % 2**31) if seed is None else seed


def examples(ci_count: int) -> int:
  """Hypothesis examples for a test: its CI count, more when exploring."""
  return ci_count * EXPLORE_EXAMPLES_FACTOR if exploring() else ci_count


def replay_command(seed: int, nodeid: str) -> str:
  return f"{VARIABLE}={seed} python -m pytest '{nodeid}'"
