"""The lowest versions CI installs (.ci/lowest-versions.txt) are pyproject.toml's lower bounds.

.ci/run's lowest-versions job installs that file's pins and runs a subset of the suite
(.ci/lowest-versions-tests.txt) with them, so the ranges pyproject.toml declares are tested at
their lower ends, not assumed. Run under that job, this also checks the installed versions.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PINNED = ("jax", "optax", "flax", "orbax-checkpoint", "chex")


def _pins() -> dict[str, str]:
  lines = (ROOT / ".ci" / "lowest-versions.txt").read_text().splitlines()
  pairs = (line.split("==") for line in lines if line and not line.startswith("#"))
  return {name.strip(): version.strip() for name, version in pairs}


def _lower_bounds() -> dict[str, str]:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  requirements = project["dependencies"] + project["optional-dependencies"]["test"]
  bounds = {}
  for requirement in requirements:
    match = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*>=\s*([0-9.]+)", requirement)
    if match:
      bounds[match.group(1)] = match.group(3)
  return bounds


def _release(version: str) -> tuple[int, ...]:
  parts = [int(p) for p in version.split(".")]
  return tuple(parts + [0] * (3 - len(parts)))


@pytest.mark.parametrize("name", PINNED)
def test_ci_pins_the_lowest_version_pyproject_allows(name):
  pins, bounds = _pins(), _lower_bounds()
  assert _release(pins[name]) == _release(bounds[name]), (
    f"{name}: pyproject.toml allows >= {bounds[name]}, .ci/lowest-versions.txt pins {pins[name]}"
  )


def test_jaxlib_is_pinned_with_jax():
  pins = _pins()
  assert pins["jaxlib"] == pins["jax"]


@pytest.mark.skipif(
  importlib.metadata.version("jax") != _pins()["jax"], reason="not the lowest-versions job"
)
@pytest.mark.parametrize("name", PINNED + ("jaxlib",))
def test_lowest_versions_job_runs_the_pinned_versions(name):
  assert importlib.metadata.version(name) == _pins()[name]
