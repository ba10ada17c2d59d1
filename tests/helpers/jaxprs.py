"""Counting a jaxpr's matrix multiplications (the pretraining FLOP model's tests)."""

import numpy as np


def dot_flops(jaxpr) -> int:
  """2 x multiply-adds of every dot_general in ``jaxpr`` (sub-jaxprs included, scans x length)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in contract])
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        total += times * dot_flops(inner)
  return int(total)
