"""The optimizer state handed to an update, against what ``init(params)`` gives for those params.

Runs on shapes and dtypes only (``jax.eval_shape(init, params)``), at trace
time, so a jitted step pays nothing for it; it raises before anything is
computed, naming the first path where the state differs and how to fix it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb._state import RatioLayout

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
_OTHER_PARAMS_HINT = (
  "The state was made for other params (or other stacked_axes): initialize it with "
  "init(params) for the params you update (re-initialize after changing a parameter's shape)."
)
_COUNT_HINT = (
  "A step count is an integer array: pass the state init(params) returned, or restore a "
  "checkpoint into it (jax.eval_shape(tx.init, params) as the target)."
)
_DTYPE_HINT = (
  "The state was made for params of another dtype, or with other mu_dtype/nu_dtype, or was "
  "cast: initialize it with init(params) for the params you update (to keep float32 moments "
  "for low-precision params, build lamb with mu_dtype=jnp.float32, nu_dtype=jnp.float32 or "
  "master_weights=True)."
)
_ABSTRACT_HINT = (
  "A ShapeDtypeStruct (from jax.eval_shape) holds no values: pass init(params), or restore a "
  "checkpoint into it."
)


class _Mismatch(Exception):
  """Where the given state first differs from the expected one, and how."""

  def __init__(self, path: tuple, message: str, hint: str):
    super().__init__(message)
    self.path, self.message, self.hint = path, message, hint


def _dtype(leaf: Any) -> np.dtype:
  return jnp.asarray(leaf).dtype if not hasattr(leaf, "dtype") else np.dtype(leaf.dtype)


def _type_name(t: type) -> str:
  if t.__module__ == "builtins":
    return t.__qualname__
  return f"{t.__module__.split('.')[0]}.{t.__qualname__}"


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


def _restored(got: Any) -> bool:
  """Whether `got` looks like a checkpoint restored without a target (plain containers)."""
  return got is None or isinstance(got, dict | list)


def _same_kind(got: np.dtype, want: Any) -> bool:
  if jnp.issubdtype(want, jnp.integer):  # step counts: any integer width (a restore may widen)
    return jnp.issubdtype(got, jnp.integer)
  return got == np.dtype(want)


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


def _compare_layout(got: Any, want: RatioLayout, path: tuple) -> None:
  if not isinstance(got, RatioLayout):
    raise _Mismatch(
      path,
      f"is {_describe(got)} where the trust-ratio layout (a static RatioLayout) is expected",
      RESTORE_HINT if _restored(got) else _OPTIONS_HINT,
    )
  if got.shapes != want.shapes:
    raise _Mismatch(
      path,
      f"is the trust-ratio layout of other params or stacked_axes: ratio shapes per leaf "
      f"{list(got.shapes)}, these params need {list(want.shapes)}",
      "Initialize the state with init(params) for the params you update.",
    )


def _compare_array(got: Any, want: Any, path: tuple) -> None:
  expected = f"an array of shape {tuple(want.shape)} and dtype {np.dtype(want.dtype)}"
  if _node(got) is not None:
    hint = RESTORE_HINT if _restored(got) else _OPTIONS_HINT
    raise _Mismatch(path, f"is {_describe(got)} where {expected} is expected", hint)
  info = _leaf_info(got)
  if info is None:
    hint = _ABSTRACT_HINT if isinstance(got, jax.ShapeDtypeStruct) else _OPTIONS_HINT
    raise _Mismatch(path, f"is {got!r} ({type(got).__name__}) where {expected} is expected", hint)
  shape, dtype = info
  if shape != tuple(want.shape):
    raise _Mismatch(
      path,
      f"has shape {shape} where init(params) gives shape {tuple(want.shape)} for these params",
      _OTHER_PARAMS_HINT,
    )
  if not _same_kind(dtype, want.dtype):
    counter = jnp.issubdtype(want.dtype, jnp.integer)
    raise _Mismatch(
      path,
      f"has dtype {dtype} where init(params) gives dtype {np.dtype(want.dtype)} for these params",
      _COUNT_HINT if counter else _DTYPE_HINT,
    )


def _key_differences(got_keys: list[str], want_keys: list[str]) -> str:
  missing = [k for k in want_keys if k not in got_keys]
  extra = [k for k in got_keys if k not in want_keys]
  parts = [
    f"missing {missing[:10]}" if missing else "",
    f"not expected {extra[:10]}" if extra else "",
  ]
  return "; ".join(p for p in parts if p)


def _compare_node(got: Any, want: Any, path: tuple) -> None:
  want_type, want_kids = _node(want)
  got_node = _node(got)
  if got_node is None or got_node[0] is not want_type:
    restored = _restored(got) and not isinstance(want, dict | list)
    raise _Mismatch(
      path,
      f"is {_describe(got)} where init(params) gives {_describe(want)}",
      RESTORE_HINT if restored else _OPTIONS_HINT,
    )
  got_kids = got_node[1]
  got_keys = [jax.tree_util.keystr((k,)) for k, _ in got_kids]
  want_keys = [jax.tree_util.keystr((k,)) for k, _ in want_kids]
  if got_keys != want_keys:
    sequence = want_type in (tuple, list) or hasattr(want_type, "_fields")
    details = "" if sequence else _key_differences(got_keys, want_keys)  # a sequence: both said
    raise _Mismatch(
      path,
      f"is {_describe(got)} where init(params) gives {_describe(want)}"
      + (f" ({details})" if details else ""),
      "The state was made for other params or by another optimizer. " + _OPTIONS_HINT,
    )
  for (key, g), (_, w) in zip(got_kids, want_kids, strict=True):
    _compare(g, w, (*path, key))


def _compare(got: Any, want: Any, path: tuple) -> None:
  """Raise _Mismatch at the first place where `got` differs from the expected `want`."""
  if isinstance(want, RatioLayout):
    _compare_layout(got, want, path)
  elif _node(want) is None:  # an array leaf of init's state
    _compare_array(got, want, path)
  else:
    _compare_node(got, want, path)


def _fits(got: Any, want: Any) -> bool:
  info = _leaf_info(got)
  return info is not None and info[0] == tuple(want.shape) and _same_kind(info[1], want.dtype)


def _is_layout(x: Any) -> bool:
  return isinstance(x, RatioLayout)


def _with_placeholder_layouts_filled(state: Any, expected: Any) -> Any:
  """`state` with each layout that ``optax.tree_map_params`` left as its placeholder's replaced.

  tree_map_params maps a state made by ``init(placeholder)``, which knows no params.
  """
  leaves, treedef = jax.tree.flatten(state, is_leaf=_is_layout)
  if not any(_is_layout(x) and x.treedef is None for x in leaves):
    return state
  expected_leaves = jax.tree.leaves(expected, is_leaf=_is_layout)
  if len(expected_leaves) != len(leaves):
    return state
  leaves = [
    w if _is_layout(g) and g.treedef is None and _is_layout(w) else g
    for g, w in zip(leaves, expected_leaves, strict=True)
  ]
  return jax.tree.unflatten(treedef, leaves)


def check_state(state: Any, expected: Any, who: str) -> Any:
  """Raise a ValueError if `state` is not a state that `who`'s init gives for these params.

  `expected` is ``jax.eval_shape(init, params)``. The structure (node types, keys),
  each array's shape and each dtype must match (step counts may have any integer
  dtype); trust-ratio layouts are compared by their ratio shapes (flax's nnx.State
  params give layouts whose tree metadata differs between init and update).

  Returns `state`, where a trust-ratio layout left as a placeholder's is replaced
  by the layout of these params.
  """
  state = _with_placeholder_layouts_filled(state, expected)
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
