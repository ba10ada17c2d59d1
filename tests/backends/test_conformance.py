"""Every implementation runs the conformance suite (`conformance.py`); a new one joins by one line."""

import jax
import pytest
from conformance import Conformance


class TestXla(Conformance):
  IMPLEMENTATION = "xla"


@pytest.mark.slow  # the XLA path's big-leaf pass 2 forced on every leaf: CI runs it
class TestXlaRecomputeU(Conformance):
  IMPLEMENTATION = "xla-recompute-u"


@pytest.mark.slow  # the GPU kernels' logic in interpret mode: for their developers (CI runs it)
class TestPallasInterpret(Conformance):
  IMPLEMENTATION = "pallas"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
class TestPallasCompiled(Conformance):
  IMPLEMENTATION = "pallas-compiled"


class TestReference(Conformance):
  IMPLEMENTATION = "reference"
