"""Checks of the trees handed to each update: dtypes, shapes, structure, emptiness, and the state.

Hyper-parameters are checked once, when the optimizer is built (`_check_args`).

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
from optax_lamb._trust_ratio import RatioLayout


def _is_masked_node(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in leaves]


def _dtype(leaf: Any) -> np.dtype:
  return jnp.asarray(leaf).dtype if not hasattr(leaf, "dtype") else np.dtype(leaf.dtype)


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


# --- the optimizer state against what init gives for these params -----------------------------

RESTORE_HINT = (
  "This looks like a checkpoint restored without a target (orbax and flax.serialization then "
  "give plain dicts, lists and None): restore with the optimizer's state as the target, e.g. "
  "orbax's checkpointer.restore(path, jax.eval_shape(tx.init, params)) or "
  "flax.serialization.from_bytes(tx.init(params), data)."
)
_OPTIONS_HINT = (
  "Pass the state that this optimizer's init(params) returned: a state made by another "
  "optimizer (optax.lamb, optax.adam, ...) or by lamb with other options does not fit "
  "(skip_nonfinite, master_weights, a weight-decay mask, a grad_scale schedule and a "
  "learning_rate or weight_decay schedule each change the state's structure)."
)


class _Mismatch(Exception):
  """Where the given state first differs from the expected one, and how."""

  def __init__(self, path: tuple, message: str, hint: str):
    super().__init__(message)
    self.path, self.message, self.hint = path, message, hint


def _type_name(t: type) -> str:
  if t.__module__ == "builtins":
    return t.__qualname__
  package = t.__module__.split(".")[0]
  return f"{package}.{t.__qualname__}"


def _node(x: Any) -> tuple[type, list[tuple[Any, Any]]] | None:
  """(node type, [(key, child)]) one level down, or None when `x` is a leaf."""
  if x is None:
    return type(None), []
  kids, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:
    return None
  return treedef.node_data()[0], [(path[0], child) for path, child in kids]


def _describe(x: Any) -> str:
  """A short description of a state node: its type and what it holds."""
  if x is None:
    return "None"
  node = _node(x)
  if node is None:
    return f"an array of shape {tuple(jnp.shape(x))} and dtype {_dtype(x)}"
  kind, kids = node
  if isinstance(x, dict):
    return f"a dict with keys {sorted(map(str, x))}"
  if kind in (tuple, list):
    inner = ", ".join(
      _type_name(type(c)) if c is not None and _node(c) is not None else _describe(c)
      for _, c in kids
    )
    return f"a {kind.__name__} of {len(kids)} ({inner})"
  return _type_name(kind)


def _same_kind(got: np.dtype, want: Any) -> bool:
  if jnp.issubdtype(want, jnp.integer):  # step counts: any integer width (a restore may widen)
    return jnp.issubdtype(got, jnp.integer)
  return got == np.dtype(want)


def _compare(got: Any, want: Any, path: tuple) -> None:
  """Raise _Mismatch at the first place where `got` differs from the expected `want`."""
  if isinstance(want, RatioLayout):
    if not isinstance(got, RatioLayout):
      restored = got is None or isinstance(got, dict | list)
      raise _Mismatch(
        path,
        f"is {_describe(got)} where the trust-ratio layout (a static RatioLayout) is expected",
        RESTORE_HINT if restored else _OPTIONS_HINT,
      )
    if got.shapes != want.shapes:
      raise _Mismatch(
        path,
        f"is the trust-ratio layout of other params or stacked_axes: ratio shapes per leaf "
        f"{list(got.shapes)}, these params need {list(want.shapes)}",
        "Initialize the state with init(params) for the params you update.",
      )
    return
  want_node, got_node = _node(want), _node(got)
  if want_node is None:  # an array leaf of init's state
    if got_node is not None:
      restored = got is None or isinstance(got, dict | list)
      raise _Mismatch(
        path,
        f"is {_describe(got)} where an array of shape {tuple(want.shape)} and dtype "
        f"{np.dtype(want.dtype)} is expected",
        RESTORE_HINT if restored else _OPTIONS_HINT,
      )
    info = _leaf_info(got)
    if info is None:
      abstract = isinstance(got, jax.ShapeDtypeStruct)
      raise _Mismatch(
        path,
        f"is {got!r} ({type(got).__name__}) where an array of shape {tuple(want.shape)} and "
        f"dtype {np.dtype(want.dtype)} is expected",
        "A ShapeDtypeStruct (from jax.eval_shape) holds no values: pass init(params), or "
        "restore a checkpoint into it."
        if abstract
        else _OPTIONS_HINT,
      )
    shape, dtype = info
    if shape != tuple(want.shape):
      raise _Mismatch(
        path,
        f"has shape {shape} where init(params) gives shape {tuple(want.shape)} for these params",
        "The state was made for other params (or other stacked_axes): initialize it with "
        "init(params) for the params you update (re-initialize after changing a parameter's "
        "shape).",
      )
    if not _same_kind(dtype, want.dtype):
      counter = jnp.issubdtype(want.dtype, jnp.integer)
      raise _Mismatch(
        path,
        f"has dtype {dtype} where init(params) gives dtype {np.dtype(want.dtype)} for these params",
        "A step count is an integer array: pass the state init(params) returned, or restore a "
        "checkpoint into it (jax.eval_shape(tx.init, params) as the target)."
        if counter
        else "The state was made for params of another dtype, or with other mu_dtype/nu_dtype, "
        "or was cast: initialize it with init(params) for the params you update (to keep "
        "float32 moments for low-precision params, build lamb with mu_dtype=jnp.float32, "
        "nu_dtype=jnp.float32 or master_weights=True).",
      )
    return
  want_type, want_kids = want_node
  if got_node is None or got_node[0] is not want_type:
    restored = (got is None or isinstance(got, dict | list)) and not isinstance(want, dict | list)
    raise _Mismatch(
      path,
      f"is {_describe(got)} where init(params) gives {_describe(want)}",
      RESTORE_HINT if restored else _OPTIONS_HINT,
    )
  got_kids = got_node[1]
  got_keys = [jax.tree_util.keystr((k,)) for k, _ in got_kids]
  want_keys = [jax.tree_util.keystr((k,)) for k, _ in want_kids]
  if got_keys != want_keys:
    missing = [k for k in want_keys if k not in got_keys]
    extra = [k for k in got_keys if k not in want_keys]
    details = "; ".join(
      part
      for part in (
        f"missing {missing[:10]}" if missing else "",
        f"not expected {extra[:10]}" if extra else "",
      )
      if part
    )
    if want_type in (tuple, list) or hasattr(want_type, "_fields"):
      details = ""  # a sequence: the two descriptions say it
    raise _Mismatch(
      path,
      f"is {_describe(got)} where init(params) gives {_describe(want)}"
      + (f" ({details})" if details else ""),
      "The state was made for other params or by another optimizer. " + _OPTIONS_HINT,
    )
  for (key, g), (_, w) in zip(got_kids, want_kids, strict=True):
    _compare(g, w, (*path, key))


def _leaf_info(x: Any) -> tuple[tuple[int, ...], np.dtype] | None:
  """(shape, dtype) of an array-like leaf; None for anything else (a string, an object).

  A ``jax.ShapeDtypeStruct`` (what ``jax.eval_shape(init, params)`` gives) has no
  values: inside ``jit``/``eval_shape`` the state's leaves are tracers instead.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return None
  try:
    return tuple(jnp.shape(x)), _dtype(x)
  except TypeError:
    return None


def _fits(got: Any, want: Any) -> bool:
  info = _leaf_info(got)
  return info is not None and info[0] == tuple(want.shape) and _same_kind(info[1], want.dtype)


def _is_layout(x: Any) -> bool:
  return isinstance(x, RatioLayout)


def check_state(state: Any, expected: Any, who: str) -> Any:
  """Raise a ValueError if `state` is not a state that `who`'s init gives for these params.

  `expected` is ``jax.eval_shape(init, params)``. The structure (node types, keys),
  each array's shape and each dtype must match (step counts may have any integer
  dtype); trust-ratio layouts are compared by their ratio shapes (flax's nnx.State
  params give layouts whose tree metadata differs between init and update). Runs
  on shapes only, at trace time.

  Returns `state`, where a trust-ratio layout that ``optax.tree_map_params`` left
  as its placeholder's (it maps a state made by ``init(placeholder)``, which knows
  no params) is replaced by the layout of these params.
  """
  leaves, treedef = jax.tree.flatten(state, is_leaf=_is_layout)
  if any(_is_layout(x) and x.treedef is None for x in leaves):
    expected_leaves = jax.tree.leaves(expected, is_leaf=_is_layout)
    if len(expected_leaves) == len(leaves):
      leaves = [
        w if _is_layout(g) and g.treedef is None and _is_layout(w) else g
        for g, w in zip(leaves, expected_leaves, strict=True)
      ]
      state = jax.tree.unflatten(treedef, leaves)
  got_leaves, got_def = jax.tree.flatten(state)
  want_leaves, want_def = jax.tree.flatten(expected)
  if got_def == want_def and all(map(_fits, got_leaves, want_leaves)):
    return state
  try:
    _compare(state, expected, ())
  except _Mismatch as m:
    where = "state" + jax.tree_util.keystr(m.path)
    raise ValueError(
      f"{who}: the optimizer state does not fit this optimizer and these params: {where} "
      f"{m.message}. {m.hint}"
    ) from None
  return state
