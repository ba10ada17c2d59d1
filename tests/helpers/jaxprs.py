"""Counting in a jaxpr: its matrix multiplications (the pretraining FLOP model's tests) and its
reductions (how many times a step reads its arrays)."""

import jax
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


def reductions(jaxpr, in_loop: bool = False) -> tuple[int, int, int]:
  """(while loops, reductions inside one, reductions outside any) in ``jaxpr``, each sub-jaxpr
  (a call, a branch, a loop body) counted once where it appears."""
  loops = inside = outside = 0
  for eqn in jaxpr.eqns:
    is_reduction = eqn.primitive.name.startswith("reduce_") or eqn.primitive.name == "reduce"
    inside, outside = inside + (is_reduction and in_loop), outside + (is_reduction and not in_loop)
    loops += eqn.primitive.name == "while"
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      counts = reductions(sub, in_loop or eqn.primitive.name == "while")
      loops, inside, outside = loops + counts[0], inside + counts[1], outside + counts[2]
  return loops, inside, outside
