"""What every update checks, at trace time, and the per-leaf options resolved against the params.

The trees handed to an update (dtypes, shapes, structure, emptiness) and the
state (against what ``init(params)`` gives) are checked on shapes and dtypes
only, so a jitted step pays nothing, and a bad call raises before anything is
computed, so it changes nothing. Hyper-parameters are checked once, when the
optimizer is built (`_check_args`). A call whose trees fit takes the short
path here; the descriptions of what does not fit are `_explain`'s.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lamb.core import _options
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.core._options import AxisNames, is_axis_name
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.faults import _check_args, _explain

_BOOLS = (bool, np.bool_)

# ------------------------------------------------------------------------- the trees


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in leaves]


def dtype_of(leaf: Any) -> np.dtype:
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
    dtype = dtype_of(leaf)
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


def check_params(params: Any, who: str) -> None:
  """Params with array leaves (or ``optax.masked`` placeholders only), all floating point.

  A tree emptied by ``optax.masked``/``optax.multi_transform`` (only ``MaskedNode``s)
  is accepted, since those wrappers hand every inner optimizer such a tree when a
  label has no leaves.
  """
  if not jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, optax.MaskedNode)):
    raise ValueError(
      f"{who}: params has no array leaves (got {params!r}); there is nothing to optimize. "
      "Check the filter that selected the parameters."
    )
  check_float_leaves(params, "params", who)


def check_same_structure(tree: Any, tree_name: str, reference: Any, reference_name: str) -> None:
  """Raise a ValueError naming the paths that differ between two pytrees."""
  tree_def: Any = jax.tree.structure(tree)
  if tree_def != jax.tree.structure(reference):
    raise ValueError(_explain.structure_mismatch(tree, tree_name, reference, reference_name))


def moment_leaves(moments: Any) -> Any:
  """A moment tree with each quantized leaf (`QuantizedMoment`) as one leaf, its codes (the
  param's shape): the params' structure."""
  is_quantized = lambda x: isinstance(x, QuantizedMoment)
  return jax.tree.map(lambda x: x.codes if is_quantized(x) else x, moments, is_leaf=is_quantized)


def check_update_args(updates: Any, params: Any, who: str) -> None:
  """The checks run before every update: params given, same structure, shapes and dtypes."""
  if params is None:
    raise ValueError(f"{who} needs params for the trust ratio: call update(grads, state, params)")
  check_same_structure(updates, "updates (gradients)", params, "params")
  check_params(params, who)
  check_float_leaves(updates, "updates (gradients)", who)
  for (path, u), (_, p) in zip(
    _leaves_with_paths(updates), _leaves_with_paths(params), strict=True
  ):
    if jnp.shape(u) != jnp.shape(p):
      raise ValueError(
        f"{who}: updates (gradients){path} has shape {jnp.shape(u)} but params{path} has shape "
        f"{jnp.shape(p)}; each gradient must have its parameter's shape."
      )


# ------------------------------------------------------------------------- the state


def _fits(got: Any, want: Any) -> bool:
  info = _options.leaf_info(got)
  return (
    info is not None and info[0] == tuple(want.shape) and _options.same_kind(info[1], want.dtype)
  )


def check_state(state: Any, expected: Any, who: str) -> None:
  """Raise a ValueError if `state` is not a state that `who`'s init gives for these params.

  `expected` is ``jax.eval_shape(init, params)``. The structure (node types, keys),
  each array's shape and each dtype must match (step counts may have any integer
  dtype); trust-ratio layouts are compared by their ratio shapes (flax's nnx.State
  params give layouts whose tree metadata differs between init and update).
  """
  got_def: Any
  got_leaves, got_def = jax.tree.flatten(state)
  want_leaves, want_def = jax.tree.flatten(expected)
  if got_def == want_def and all(map(_fits, got_leaves, want_leaves)):
    return
  message = _explain.state_mismatch(state, expected, who)
  if message is not None:
    raise ValueError(message) from None


# ---------------------------------------------------------------- per-leaf options


def resolve_per_leaf(
  option: PerLeafMask | PerLeafAxes, params: Any, default: bool | int, name: str, kind: str
) -> Any:
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
  option_def: Any = jax.tree.structure(option, is_leaf=lambda x: x is None)
  try:
    subtrees = option_def.flatten_up_to(params)
  except (ValueError, TypeError) as e:
    raise ValueError(_explain.prefix_mismatch(option, name, params)) from e
  values = option_def.flatten_up_to(option)
  return option_def.unflatten(
    [
      jax.tree.map(lambda _, v=v: default if v is None else v, sub)
      for v, sub in zip(values, subtrees, strict=True)
    ]
  )


def resolve_stacked_axes(stacked_axes: PerLeafAxes, params: Any) -> Any:
  """Per-leaf number of leading stacked-layer axes, validated against leaf ranks."""
  axes = resolve_per_leaf(stacked_axes, params, 0, "stacked_axes", "int")

  def check(path, k, leaf) -> int:
    if k > jnp.ndim(leaf):
      raise ValueError(
        f"stacked_axes={k} at {jax.tree_util.keystr(path)} exceeds the leaf's rank "
        f"{jnp.ndim(leaf)} (shape {jnp.shape(leaf)})"
      )
    return int(k)

  return jax.tree_util.tree_map_with_path(check, axes, params)


def resolve_axis_names(axis_name: PerLeafAxisNames, tree: Any) -> list[AxisNames]:
  """Per-leaf mapped-axis names, one per leaf of `tree` (in `jax.tree.leaves` order).

  `axis_name` is one name (str), a tuple of names, None, a pytree prefix of
  `tree` whose leaves are such values, or a callable(tree) returning one.
  """
  if callable(axis_name):
    axis_name = axis_name(tree)
  n_leaves = len(jax.tree.leaves(tree))
  if is_axis_name(axis_name):
    return [axis_name] * n_leaves
  names_def: Any
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


def find_states(opt_state: Any, state_type: type | tuple[type, ...], missing: str) -> list[Any]:
  """Every `state_type` inside any nesting of optax states; ValueError(`missing`) if none."""
  is_match = lambda x: isinstance(x, state_type)
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_match) if is_match(s)]
  if not found:
    raise ValueError(missing)
  return found


def _peak(g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max |g|, whether g holds a NaN), in one reduction: XLA:CPU hands a lone max to a library
  that reads its input from memory, g's |.| written out first. The check is not differentiated
  (it only feeds the step's decision): jax's derivative of a variadic reduce with a boolean
  operand fails (a symbolic zero tangent), so g's tangent is stopped here."""
  g = jax.lax.stop_gradient(g)
  axes = tuple(range(g.ndim))
  init = (jnp.zeros((), g.dtype), jnp.zeros((), jnp.bool_))
  combine = lambda a, b: (jnp.maximum(a[0], b[0]), jnp.logical_or(a[1], b[1]))
  return jax.lax.reduce((jnp.abs(g), jnp.isnan(g)), init, combine, axes)


def _too_large(g: jax.Array, factor: Any, limit: float) -> jax.Array:
  """Whether g times the clip `factor` (None: 1) holds a NaN or an |element| not below `limit`."""
  peak, nan = _peak(g)
  if factor is not None:
    peak = peak * factor
  return jnp.logical_or(nan, jnp.logical_not(peak < limit))


def clip_keeps_below(max_norm: Any, norm_eps: Any, thresholds: list[float]) -> bool:
  """Whether clipping to `max_norm` alone keeps every finite gradient below its threshold.

  With G the clipping norm (finite), the clip factor is 1 where G + `norm_eps` <= `max_norm`,
  else `max_norm` / (G + `norm_eps`); every |g_i| is at most G (a sum of non-negative terms,
  rounded to nearest, is never below its largest term: a few ulp), so |g_i| times the factor is
  at most about `max_norm`. Half the smallest threshold leaves room for those ulp. Known only
  for numbers given when the optimizer was built (an array: not known)."""
  static = all(isinstance(x, (int, float)) for x in (max_norm, norm_eps))
  return static and norm_eps >= 0 and 2 * max_norm <= min(thresholds, default=math.inf)


def gradients_ok(
  grads: list, factor: Any, thresholds: list[float], names: list, clipped_by: Any = None
) -> jax.Array:
  """Whether every gradient times the clip `factor` is finite and below its leaf's second
  moment's `_leaf.overflow_threshold`: the largest |g| of each leaf, one reduction over the
  gradients, agreed over the mapped axes (a NaN counts as too large). Each leaf's flag is a call
  of one jitted function, traced and lowered once per leaf shape, not once per leaf.

  `clipped_by`: the clipping's global norm where `clip_keeps_below` holds: then the test is that
  norm's being finite (psum'd already, a NaN or Inf in any gradient makes it NaN or Inf; finite
  gradients give a finite norm), and the gradients are not read again."""
  if clipped_by is not None:
    return jnp.isfinite(clipped_by)
  flag = jax.jit(_too_large, static_argnums=2)
  flags = [flag(g, factor, limit) for g, limit in zip(grads, thresholds, strict=True)]
  # Counted by one reduction: a chain of per-leaf adds would be copied by XLA into every fusion
  # that reads the decision (each leaf's), a program quadratic in the number of leaves.
  bad = jnp.sum(jnp.stack(flags).astype(jnp.int32)) if flags else jnp.zeros((), jnp.int32)
  return psum_over_names(bad, names) == 0


def psum_over_names(bad: jax.Array, names: list) -> jax.Array:
  """The count `bad` summed over every axis any leaf is sharded on: all devices decide alike."""
  axes: set[str] = set()
  for name in names:
    axes.update((name,) if isinstance(name, str) else (name or ()))
  return _options.psum_if(bad, tuple(sorted(axes)) or None)
