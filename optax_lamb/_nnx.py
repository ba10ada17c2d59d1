"""Flax NNX interop without importing flax: Variable wrappers taken off values read from a state."""

from __future__ import annotations

import sys
from typing import Any

import jax


def plain_values(tree: Any) -> Any:
  """`tree` with every ``flax.nnx.Variable`` (``OptVariable``, ``Param``, ...) replaced by its value.

  ``nnx.Optimizer(model, tx, wrt=nnx.Param).opt_state`` wraps each array of the
  state in an ``OptVariable`` (and the state's layouts keep the ``Param`` nodes of
  the params ``init`` saw). Without flax loaded no Variable can be in the tree, so
  flax is not imported here.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  if hasattr(nnx, "as_pure"):
    return nnx.as_pure(tree)
  is_variable = lambda x: isinstance(x, nnx.Variable)  # flax before as_pure
  return jax.tree.map(lambda x: x.value if is_variable(x) else x, tree, is_leaf=is_variable)
