"""Why a tree or a state does not fit: the descriptions behind the errors of `optax_lamb.faults._checks`.

Only a call that is about to fail (or a Flax NNX state, whose layouts' tree
metadata differ between init and update) comes here; a call whose trees and
state fit never does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core import _options
from optax_lamb.core._options import RatioLayout

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


class Mismatch(Exception):
  """Where the given state first differs from the expected one, and how."""

  def __init__(self, path: tuple, message: str, hint: str) -> None:
    super().__init__(message)
    self.path, self.message, self.hint = path, message, hint


def _type_name(t: type) -> str:
  if t.__module__ == "builtins":
    return t.__qualname__
  return f"{t.__module__.split('.')[0]}.{t.__qualname__}"


def _node(x: Any) -> tuple[type, list[tuple[Any, Any]]] | None:
  """(node type, [(key, child)]) one level down, or None when `x` is a leaf."""
  if x is None:
    return type(None), []
  treedef: Any
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
    info = _options.leaf_info(x)
    return f"an array of shape {tuple(jnp.shape(x))} and dtype {info[1] if info else '?'}"
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


def _compare_layout(got: Any, want: RatioLayout, path: tuple) -> None:
  if not isinstance(got, RatioLayout):
    raise Mismatch(
      path,
      f"is {_describe(got)} where the trust-ratio layout (a static RatioLayout) is expected",
      RESTORE_HINT if _restored(got) else _OPTIONS_HINT,
    )
  if got.shapes != want.shapes:
    raise Mismatch(
      path,
      f"is the trust-ratio layout of other params or stacked_axes: ratio shapes per leaf "
      f"{list(got.shapes)}, these params need {list(want.shapes)}",
      "Initialize the state with init(params) for the params you update.",
    )


def _compare_array(got: Any, want: Any, path: tuple) -> None:
  expected = f"an array of shape {tuple(want.shape)} and dtype {np.dtype(want.dtype)}"
  if _node(got) is not None:
    hint = RESTORE_HINT if _restored(got) else _OPTIONS_HINT
    raise Mismatch(path, f"is {_describe(got)} where {expected} is expected", hint)
  info = _options.leaf_info(got)
  if info is None:
    hint = _ABSTRACT_HINT if isinstance(got, jax.ShapeDtypeStruct) else _OPTIONS_HINT
    raise Mismatch(path, f"is {got!r} ({type(got).__name__}) where {expected} is expected", hint)
  shape, dtype = info
  if shape != tuple(want.shape):
    raise Mismatch(
      path,
      f"has shape {shape} where init(params) gives shape {tuple(want.shape)} for these params",
      _OTHER_PARAMS_HINT,
    )
  if not _options.same_kind(dtype, want.dtype):
    counter = jnp.issubdtype(want.dtype, jnp.integer)
    raise Mismatch(
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
  want_node = _node(want)
  assert want_node is not None  # `compare` sends leaves to `_compare_array`
  want_type, want_kids = want_node
  got_node = _node(got)
  if got_node is None or got_node[0] is not want_type:
    restored = _restored(got) and not isinstance(want, dict | list)
    raise Mismatch(
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
    raise Mismatch(
      path,
      f"is {_describe(got)} where init(params) gives {_describe(want)}"
      + (f" ({details})" if details else ""),
      "The state was made for other params or by another optimizer. " + _OPTIONS_HINT,
    )
  for (key, g), (_, w) in zip(got_kids, want_kids, strict=True):
    compare(g, w, (*path, key))


def compare(got: Any, want: Any, path: tuple) -> None:
  """Raise _Mismatch at the first place where `got` differs from the expected `want`."""
  if isinstance(want, RatioLayout):
    _compare_layout(got, want, path)
  elif _node(want) is None:  # an array leaf of init's state
    _compare_array(got, want, path)
  else:
    _compare_node(got, want, path)


def state_mismatch(state: Any, expected: Any, who: str) -> str | None:
  """Why `state` is not what `who`'s init gives (`expected`, its shapes), or None where it fits
  up to the trust-ratio layouts' tree metadata (compared by their ratio shapes)."""
  try:
    compare(state, expected, ())
  except Mismatch as m:
    where = "state" + jax.tree_util.keystr(m.path)
    return (
      f"{who}: the optimizer state does not fit this optimizer and these params: {where} "
      f"{m.message}. {m.hint}"
    )
  return None


def _paths(tree) -> list[str]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
  return [jax.tree_util.keystr(path) or "<root>" for path, _ in leaves]


def _none_paths(tree) -> set[str]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
  return {jax.tree_util.keystr(path) or "<root>" for path, leaf in leaves if leaf is None}


def structure_mismatch(tree: Any, tree_name: str, reference: Any, reference_name: str) -> str:
  """Why two pytrees differ: the paths in one and not the other, None entries, containers."""
  ours, theirs = _paths(tree), _paths(reference)
  only_ours = [p for p in ours if p not in set(theirs)]
  only_theirs = [p for p in theirs if p not in set(ours)]
  details = []
  if only_ours:
    details.append(f"in {tree_name} but not in {reference_name}: {only_ours[:10]}")
  if only_theirs:
    details.append(f"in {reference_name} but not in {tree_name}: {only_theirs[:10]}")
  none_ours, none_theirs = _none_paths(tree), _none_paths(reference)
  common = set(ours) & set(theirs)
  if none_ours - none_theirs & common:
    details.append(
      f"None in {tree_name} but not in {reference_name}: {sorted(none_ours - none_theirs & common)[:10]}"
    )
  if none_theirs - none_ours & common:
    details.append(
      f"None in {reference_name} but not in {tree_name}: {sorted(none_theirs - none_ours & common)[:10]}"
    )
  if not details:
    details.append(
      f"same leaf paths, different containers: {jax.tree.structure(tree)} vs "
      f"{jax.tree.structure(reference)}"
    )
  return f"The structure of {tree_name} does not match {reference_name}; " + "; ".join(details)


def _is_none(x: Any) -> bool:
  return x is None


def _short(treedef: Any, limit: int = 300) -> str:
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + "...)"


def prefix_mismatch(option: Any, name: str, params: Any) -> str:
  """Why `option` is not a pytree prefix of `params`: both structures, and the paths that differ."""
  ours, theirs = _paths(option), _paths(params)
  under = lambda path, prefix: prefix == "<root>" or path.startswith(prefix)
  only_ours = [p for p in ours if not any(under(q, p) for q in theirs)]
  only_theirs = [q for q in theirs if not any(under(q, p) for p in ours)]
  details = [
    f"in {name} but not in params: {only_ours[:10]}" if only_ours else "",
    f"in params but not in {name}: {only_theirs[:10]}" if only_theirs else "",
  ]
  details = [d for d in details if d] or ["same paths, different containers"]
  return (
    f"{name} must be a pytree prefix of the params (or a callable(params) returning one): "
    f"params structure {_short(jax.tree.structure(params))}, {name} structure "
    f"{_short(jax.tree.structure(option, is_leaf=_is_none))}; " + "; ".join(details)
  )
