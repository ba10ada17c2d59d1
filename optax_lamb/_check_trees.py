"""Checks of the trees handed to each update: dtypes, shapes, structure, emptiness.

Hyper-parameters are checked once, when the optimizer is built (`_check_args`);
the state is checked against ``init(params)`` by `_check_state`.

They run on shapes and dtypes only (no traced values), so they work under jit,
and they raise before anything is computed, so a bad call changes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lamb import _tree


def _is_masked_node(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in leaves]


def _dtype(leaf: Any) -> np.dtype:
  """The leaf's dtype; NumPy's for a Python value (a str is <U.., an object is object)."""
  return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def check_float_leaves(tree: Any, tree_name: str, who: str) -> None:
  """Raise a TypeError naming the first leaf that is not a real floating-point array.

  Integer and boolean leaves are rejected rather than frozen: a silent zero update
  hides a mistake (a step counter or an index table inside the optimized tree),
  and optax itself adds a float update to them and truncates it. Complex leaves
  are rejected because the trust ratio and the second moment are defined here
  for real numbers only.
  """
  for path, leaf in _leaves_with_paths(tree):
    dtype = _dtype(leaf)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise TypeError(
        f"{who}: {tree_name}{path} has complex dtype {dtype}; LAMB supports real "
        "floating-point leaves only. Split complex parameters into real and imaginary "
        "parts, e.g. with optax.contrib.split_real_and_imaginary(tx)."
      )
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"{who}: {tree_name}{path} has dtype {dtype}; LAMB updates floating-point leaves "
        "only. Keep integer and boolean leaves out of the optimized tree, or give them "
        "optax.set_to_zero() through optax.partition."
      )


def check_not_empty(params: Any, who: str) -> None:
  """Raise a ValueError if `params` has no array leaves and no optax.masked placeholders.

  A tree emptied by ``optax.masked``/``optax.multi_transform`` (only ``MaskedNode``s)
  is accepted, since those wrappers hand every inner optimizer such a tree when a
  label has no leaves.
  """
  if jax.tree.leaves(params, is_leaf=_is_masked_node):
    return
  raise ValueError(
    f"{who}: params has no array leaves (got {params!r}); there is nothing to optimize. "
    "Check the filter that selected the parameters."
  )


def check_same_shapes(updates: Any, updates_name: str, params: Any, who: str) -> None:
  """Raise a ValueError naming the first leaf whose shape differs from its param's."""
  for (path, u), (_, p) in zip(
    _leaves_with_paths(updates), _leaves_with_paths(params), strict=True
  ):
    if jnp.shape(u) != jnp.shape(p):
      raise ValueError(
        f"{who}: {updates_name}{path} has shape {jnp.shape(u)} but params{path} has shape "
        f"{jnp.shape(p)}; each gradient must have its parameter's shape."
      )


def check_params(params: Any, who: str) -> None:
  check_not_empty(params, who)
  check_float_leaves(params, "params", who)


def check_update_args(updates: Any, params: Any, who: str) -> None:
  """The checks run before every update: params given, same structure, shapes and dtypes."""
  if params is None:
    raise ValueError(f"{who} needs params for the trust ratio: call update(grads, state, params)")
  _tree.check_same_structure(updates, "updates (gradients)", params, "params")
  check_params(params, who)
  check_float_leaves(updates, "updates (gradients)", who)
  check_same_shapes(updates, "updates (gradients)", params, who)
