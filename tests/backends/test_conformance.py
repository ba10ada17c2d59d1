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


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestPallasMosaicGpuCompiled(Conformance):
  IMPLEMENTATION = "pallas-mosaic-gpu-compiled"


class TestReference(Conformance):
  IMPLEMENTATION = "reference"

  @pytest.mark.slow  # 30 s on 2 cores (hypothesis, 25 examples): CI runs it
  def test_agrees_with_xla_step_by_step_on_random_options(self):
    Conformance.test_agrees_with_xla_step_by_step_on_random_options(self)
