"""Shared jax configuration, set before anything imports jax.

Eight host CPU devices for the data-parallel tests (set once, here); float64 is
enabled so the NumPy references and float64 checks run in double precision
where a test asks for it (jax arrays default to float32 either way).
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def fresh_rng():
  """A NumPy generator with a seed drawn for this run; the seed is printed on failure."""
  seed = int(np.random.SeedSequence().entropy % (2**32))
  print(f"fresh_rng seed: {seed}")
  return np.random.default_rng(seed)
