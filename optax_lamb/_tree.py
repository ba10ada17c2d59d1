"""Pytree helpers: structure checks, per-leaf options, unzipping per-leaf tuples."""

from __future__ import annotations

from typing import Any

import jax

from optax_lamb import _check_args
from optax_lamb._check_args import is_axis_name

try:  # private in optax; absent in some versions, then nothing is a placeholder
  from optax.tree_utils._state_utils import _ParamsPlaceholder
except ImportError:  # pragma: no cover
  _ParamsPlaceholder = ()


def is_params_placeholder(x: Any) -> bool:
  """optax.tree_map_params calls init with this placeholder to find the param-shaped state."""
  return isinstance(x, _ParamsPlaceholder)


def _paths(tree) -> list[str]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
  return [jax.tree_util.keystr(path) or "<root>" for path, _ in leaves]


def _none_paths(tree) -> set[str]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
  return {jax.tree_util.keystr(path) or "<root>" for path, leaf in leaves if leaf is None}


def check_same_structure(tree, tree_name: str, reference, reference_name: str) -> None:
  """Raise a ValueError naming the paths that differ between two pytrees."""
  if jax.tree.structure(tree) == jax.tree.structure(reference):
    return
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
  raise ValueError(
    f"The structure of {tree_name} does not match {reference_name}; " + "; ".join(details)
  )


def _is_none(x: Any) -> bool:
  return x is None


def _short(treedef: Any, limit: int = 300) -> str:
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + "...)"


def _prefix_mismatch(option: Any, name: str, params: Any) -> str:
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


def resolve_per_leaf(option: Any, params: Any, default: Any, name: str, kind: str) -> Any:
  """A per-leaf option given as a value, a pytree prefix of `params` or a callable(params).

  Returns a pytree with the structure of `params` whose leaves are the option's
  value for each leaf (`default` where the option is None). `name` is the
  argument's name for errors, `kind` the kind of its values ("bool" or "int").
  """
  if option is None:
    return jax.tree.map(lambda _: default, params)
  if callable(option):
    option = option(params)
    _check_args.check_per_leaf_values(f"{name}(params)", option, kind)
  option_def = jax.tree.structure(option, is_leaf=_is_none)
  try:
    subtrees = option_def.flatten_up_to(params)
  except (ValueError, TypeError) as e:
    raise ValueError(_prefix_mismatch(option, name, params)) from e
  values = option_def.flatten_up_to(option)
  return option_def.unflatten(
    [
      jax.tree.map(lambda _, v=v: default if v is None else v, sub)
      for v, sub in zip(values, subtrees, strict=True)
    ]
  )


def resolve_stacked_axes(stacked_axes: Any, params: Any) -> Any:
  """Per-leaf number of leading stacked-layer axes, validated against leaf ranks."""
  axes = resolve_per_leaf(stacked_axes, params, 0, "stacked_axes", "int")

  def check(path, k, leaf):
    if k > jax.numpy.ndim(leaf):
      raise ValueError(
        f"stacked_axes={k} at {jax.tree_util.keystr(path)} exceeds the leaf's rank "
        f"{jax.numpy.ndim(leaf)} (shape {jax.numpy.shape(leaf)})"
      )
    return int(k)

  return jax.tree_util.tree_map_with_path(check, axes, params)


def tree_unzip(out: Any, treedef: Any, n: int) -> tuple[Any, ...]:
  """Split a tree (of structure `treedef`) whose leaves are n-tuples into n trees."""
  columns = treedef.flatten_up_to(out)
  return tuple(jax.tree.unflatten(treedef, [c[i] for c in columns]) for i in range(n))


def resolve_axis_names(axis_name: Any, tree: Any) -> list[Any]:
  """Per-leaf mapped-axis names, one per leaf of `tree` (in `jax.tree.leaves` order).

  `axis_name` is one name (str), a tuple of names, None, a pytree prefix of
  `tree` whose leaves are such values, or a callable(tree) returning one.
  """
  if callable(axis_name):
    axis_name = axis_name(tree)
  n_leaves = len(jax.tree.leaves(tree))
  if is_axis_name(axis_name):
    return [axis_name] * n_leaves
  with_paths, names_def = jax.tree_util.tree_flatten_with_path(axis_name, is_leaf=is_axis_name)
  try:
    subtrees = names_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    check_same_structure(axis_name, "axis_name", tree, "params")
    raise ValueError(f"axis_name is not a pytree prefix of the params: {e}") from e
  out = []
  for (path, name), sub in zip(with_paths, subtrees, strict=True):
    if not is_axis_name(name):
      raise ValueError(
        f"axis_name must be None, a str or a tuple of str per leaf, got {name!r} at "
        f"{jax.tree_util.keystr(path) or '<root>'}"
      )
    out.extend([name] * len(jax.tree.leaves(sub)))
  return out


def find_states(opt_state: Any, state_type: type, missing: str) -> list[Any]:
  """Every `state_type` inside any nesting of optax states; ValueError(`missing`) if none."""
  is_match = lambda x: isinstance(x, state_type)
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_match) if is_match(s)]
  if not found:
    raise ValueError(missing)
  return found
