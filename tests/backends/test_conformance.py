"""Every implementation runs the conformance suite (`conformance.py`); a new one joins by one line."""

import jax
import pytest
from conformance import Conformance


class TestXlaOneDevice(Conformance):  # as shipped to a process of one device: most users
  IMPLEMENTATION = "xla-one-device"


@pytest.mark.slow  # as shipped to a process of several devices (this one's eight): CI runs it
class TestXla(Conformance):
  IMPLEMENTATION = "xla"


@pytest.mark.slow  # the XLA path of large trees forced on every tree: CI runs it
class TestXlaLargeTree(Conformance):
  IMPLEMENTATION = "xla-large-tree"


@pytest.mark.slow  # the GPU kernels' logic in interpret mode: for their developers (CI runs it)
class TestPallasInterpret(Conformance):
  IMPLEMENTATION = "pallas"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestPallasCompiled(Conformance):
  IMPLEMENTATION = "pallas-compiled"


@pytest.mark.slow  # the Mosaic GPU kernels' logic in interpret mode (CI runs it)
class TestPallasMosaicGpuInterpret(Conformance):
  IMPLEMENTATION = "pallas-mosaic-gpu"

  # Pallas interpret mode evaluates the kernel's jaxpr, traced without manual axes, on the
  # shards' varying values, and shard_map's check (check_vma) rejects the mix (jax 0.10.2: "mul
  # requires varying manual axes to match"); the compiled kernels' class runs it on a GPU.
  @pytest.mark.xfail(raises=ValueError, strict=True, reason="interpret mode inside shard_map")
  @pytest.mark.parametrize("replicated", [(), ("b",)], ids=["one-name", "per-leaf"])
  def test_sharded_leaves_match_unsharded(self, replicated, rng):
    Conformance.test_sharded_leaves_match_unsharded(self, replicated, rng)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestPallasMosaicGpuCompiled(Conformance):
  IMPLEMENTATION = "pallas-mosaic-gpu-compiled"


class TestReference(Conformance):
  IMPLEMENTATION = "reference"

  @pytest.mark.slow  # 30 s on 2 cores (hypothesis, 25 examples): CI runs it
  def test_agrees_with_xla_step_by_step_on_random_options(self):
    Conformance.test_agrees_with_xla_step_by_step_on_random_options(self)
