"""Check the tests' derived tolerances over many seeds, and print each test's worst margin.

The margin of a check is |error| / tolerance (1 fails). Tests whose compiled steps
do not depend on the seed run once per seed of ``OPTAX_LAMB_TEST_SEED=A:B``; the
property tests (hypothesis) run with ``OPTAX_LAMB_TEST_SEED=random``: fresh
examples, 8 times their CI count. From the repository root:

    python tests/tools/seed_sweep.py                 # 300 seeds; pallas: --pallas-seeds
    python tests/tools/seed_sweep.py --seeds 50 -- -x  # extra pytest arguments after --
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Checked per seed: the comparisons of the conformance suite (compiled once per case).
SEEDED = (
  "each_step or ends_at or agrees_with_the_stage_chain or update_and_apply"
  " or (low_precision_params and not track)"
)
PROPERTY_TESTS = [
  "tests/backends/test_conformance.py::TestReference::test_agrees_with_xla_step_by_step_on_random_options",
  "tests/backends/test_conformance.py::TestXlaLargeTree::test_agrees_with_xla_step_by_step_on_random_options",
  "tests/backends/test_conformance.py::TestPallasInterpret::test_agrees_with_xla_step_by_step_on_random_options",
  "tests/integration/test_properties.py",
]


def pytest(env_seed: str, args: list[str]) -> int:
  env = dict(os.environ, OPTAX_LAMB_TEST_SEED=env_seed)
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
  print("$ OPTAX_LAMB_TEST_SEED=" + env_seed, " ".join(command[1:]), flush=True)
  return subprocess.call(command, env=env)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=300, help="seeds per test (xla, reference)")
  parser.add_argument("--pallas-seeds", type=int, default=100, help="seeds per pallas test")
  parser.add_argument("extra", nargs="*", help="more pytest arguments")
  args = parser.parse_args()
  conformance = "tests/backends/test_conformance.py"
  failed = 0
  failed |= pytest(f"0:{args.seeds}",
                   [conformance, "-k", f"not Pallas and ({SEEDED})", *args.extra])  # fmt: skip
  failed |= pytest(f"0:{args.pallas_seeds}",
                   [conformance, "-k", f"Pallas and ({SEEDED})", *args.extra])  # fmt: skip
  failed |= pytest("random", [*PROPERTY_TESTS, *args.extra])
  return failed


if __name__ == "__main__":
  sys.exit(main())
