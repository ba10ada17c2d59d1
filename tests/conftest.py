"""Shared jax configuration (set before anything imports jax), seeds and hypothesis profiles.

Eight host CPU devices for the data-parallel tests (set once, here); float64 is
enabled so the NumPy references and float64 checks run in double precision
where a test asks for it (jax arrays default to float32 either way).

Seeds are fixed by default; ``OPTAX_LAMB_TEST_SEED`` explores others
(`helpers/seeds.py`, tests/README.md). A failed test that drew a seed prints the
command that replays it.
"""

import atexit
import importlib.metadata
import os
import re
import shutil
import tempfile


def _xla_flag_unless_named(name: str, value: str) -> None:
  """Adds --name=value to XLA_FLAGS unless XLA_FLAGS already names that flag (the caller's wins)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if name not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}"


_xla_flag_unless_named("xla_force_host_platform_device_count", "8")
# The tests' programs are small and many: XLA:CPU's expensive LLVM passes (loop unrolling and
# vectorization) cost more compile time than they save at run time (the default run: 9 min 25 s
# with them, 8 min 32 s without, 1,995 passed both ways, 2026-11-27). They are speed
# optimizations; the benchmarks and users keep XLA's default.
_xla_flag_unless_named("xla_llvm_disable_expensive_passes", "true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per run, shared by the xdist workers and the subprocesses
# (they inherit the variable): with caches cleared after each module, the same step compiles
# in many modules. Every compile is cached (min time and size 0). A subset of the suite took
# 22% less wall time with it (benchmarks/NOTES.md).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="optax_lamb_tests_jax_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import asserts, seeds  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# differing_executors: the conformance suite runs one property test per implementation class.
_HYPOTHESIS = dict(deadline=None, suppress_health_check=[
  HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors])  # fmt: skip
settings.register_profile("fixed", derandomize=True, print_blob=True, **_HYPOTHESIS)
settings.register_profile("explore", derandomize=False, print_blob=True, **_HYPOTHESIS)
settings.load_profile("explore" if seeds.exploring() else "fixed")


def pytest_configure(config):
  """XLA:CPU's elemental emitter instead of its fusion emitters (`--xla_cpu_use_fusion_emitters=
  false`) in a run that leaves out the slow tests (the default run, compile-bound): 13 min 43 s ->
  11 min 14 s on 2 cores, 1,991 passed both ways, bit-identical checkpoints included. Not in the
  slow set, whose recipe jobs and notebooks mostly run what they compile: there it cost 21 min 23
  s -> 24 min 45 s (benchmarks/NOTES.md, "The fusion emitters"). Only with jaxlib before 0.11,
  which no longer has the option (an unknown flag aborts the process). Set here, before any test
  starts jax's backend (it reads XLA_FLAGS then); the workers and subprocesses inherit it. Users
  keep XLA's default."""
  markexpr = " ".join((config.getoption("markexpr") or "").split())
  if markexpr != "not slow":
    return
  try:
    jaxlib = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):  # unknown: leave XLA's default
    return
  if jaxlib < (0, 11):
    _xla_flag_unless_named("xla_cpu_use_fusion_emitters", "false")


def pytest_generate_tests(metafunc):
  if "seed" in metafunc.fixturenames and seeds.sweep() is not None:
    metafunc.parametrize("seed", list(seeds.sweep()), indirect=True, ids=lambda s: f"seed{s}")


@pytest.fixture
def seed(request) -> int:
  """This test's seed (0 unless OPTAX_LAMB_TEST_SEED says otherwise); replayable."""
  value = request.param if hasattr(request, "param") else seeds.draw()
  request.node.stash[_SEED] = value
  return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
  """A NumPy generator seeded with this test's seed."""
  return np.random.default_rng(seed)


_SEED = pytest.StashKey[int]()


@pytest.fixture
def rows_layout(monkeypatch) -> None:
  """The norms' sums in the accelerators' layout (optax_lamb.core._ratios.NORM_BLOCKS = "rows"): what
  the memory budget is for; the CPU backend's own takes 2/16 of a large leaf."""
  from optax_lamb.core import _ratios

  monkeypatch.setattr(_ratios, "NORM_BLOCKS", "rows")


@pytest.fixture(params=[False, True], ids=["devices-8", "one-device"])
def device_count_seen(request, monkeypatch) -> bool:
  """The step traced as in this 8-device process, and as in a one-device one (small leaves'
  sums joint: optax_lamb.core._ratios.one_device); the fixture's value says which."""
  import jax

  from optax_lamb.core import _ratios

  if request.param:
    monkeypatch.setattr(jax, "device_count", lambda *args: 1)
  assert _ratios.one_device() == request.param
  return request.param


@pytest.fixture(autouse=True)
def _margins_of_this_test(request):
  asserts.current_test = request.node.nodeid.split("[")[0]
  yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.failed and _SEED in item.stash:
    command = seeds.replay_command(
      item.stash[_SEED], re.sub(r"-?seed\d+(?=\])|\[seed\d+\]", "", item.nodeid)
    )
    report.sections.append(("how to replay", command))
  return report


def pytest_terminal_summary(terminalreporter):
  if (seeds.sweep() is not None or seeds.exploring()) and asserts.MARGINS:
    which = f"seeds {seeds.sweep()}" if seeds.sweep() else "random seeds and examples"
    terminalreporter.section(f"worst margin (|error| / tolerance) over {which}")
    for test, margin in sorted(asserts.MARGINS.items()):
      terminalreporter.write_line(f"{margin:8.3f}  {test}")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_caches():
  """Drop jax's compiled executables after each test module.

  One process compiles a few thousand programs; keeping them all made XLA:CPU's
  compiler crash (segfault) late in the run on jax 0.10.2.
  """
  yield
  import jax

  jax.clear_caches()
