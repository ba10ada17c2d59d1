"""Every implementation runs the conformance suite (`conformance.py`); a new one joins by one line."""

from conformance import Conformance


class TestXla(Conformance):
  IMPLEMENTATION = "xla"


class TestXlaRecomputeU(Conformance):
  IMPLEMENTATION = "xla-recompute-u"


class TestPallasInterpret(Conformance):
  IMPLEMENTATION = "pallas"


class TestReference(Conformance):
  IMPLEMENTATION = "reference"
