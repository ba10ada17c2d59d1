"""What ``optax_lamb.compat``'s constructors share: argument checks in each library's terms,
parameter-group masks, Keras' gradient clipping, and the call into `optax_lamb._lamb.build`.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_lamb import _check_args, _leaf, _norms, _tree
from optax_lamb._lamb import build
from optax_lamb._plan import LambConfig


def check_betas(name: str, betas: Any) -> tuple[Any, Any]:
  """A pair of decays in [0, 1), named `name[0]`, `name[1]`."""
  if not (isinstance(betas, Sequence) and len(betas) == 2):
    raise TypeError(f"{name} must be a pair (b1, b2), got {name}={betas!r}")
  for i, beta in enumerate(betas):
    _check_args.check_in_unit_interval(f"{name}[{i}]", beta)
  return betas[0], betas[1]


def check_number(name: str, value: Any) -> float:
  """A Python number (the constructor decides something from it when built)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a number, got {name}={value!r}")
  return float(value)


def check_mask(name: str, mask: Any) -> None:
  _check_args.check_per_leaf(name, mask, "bool")


def path_name(path: tuple) -> str:
  """A key path as a '/'-joined string: dict keys, attribute names and sequence indices."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def regex_mask(patterns: Sequence[str] | None):
  """callable(params): True on the leaves whose '/'-joined path no pattern `re.search`es."""
  compiled = [re.compile(p) for p in patterns or ()]

  def mask(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(r.search(path_name(path)) for r in compiled), params
    )

  return mask


def keras_clipping(clipnorm: Any, clipvalue: Any, axis_name: Any):
  """`build`'s grad_transform for Keras' per-variable clips, or None without one.

  clipvalue: g <- clip(g, -c, c); then clipnorm: g <- g min(1, c / ||g||) per leaf
  (``c / max(||g||, c)``, Keras' and TensorFlow's clip_by_norm), the squared norm of
  a sharded leaf summed over its mapped axes.
  """
  if clipnorm is None and clipvalue is None:
    return None

  def transform(grads, params):
    if clipvalue is not None:
      grads = jax.tree.map(lambda g: jnp.clip(g, -clipvalue, clipvalue).astype(g.dtype), grads)
    if clipnorm is not None:
      leaves, treedef = jax.tree.flatten(grads)
      names = _tree.resolve_axis_names(axis_name, params)
      sq = _norms.psum_by_name([_norms.sq_norm(g) for g in leaves], names)
      factors = [_leaf.clip_factor(s, clipnorm) for s in sq]
      grads = treedef.unflatten([_leaf.clip(g, f) for g, f in zip(leaves, factors, strict=True)])
    return grads

  return transform


def make(
  *,
  learning_rate: Any,
  learning_rate_name: str,
  extras: dict,
  grad_transform: Any = None,
  **config: Any,
):
  """The transformation of one compat constructor: its `LambConfig` fields, then the extras.

  `extras` are the keyword-only arguments every constructor shares (stacked_axes,
  axis_name, implementation, skip_nonfinite, grad_scale, master_weights).
  """
  _check_args.check_non_negative(learning_rate_name, learning_rate, schedule=True)
  _check_args.check_per_leaf("stacked_axes", extras["stacked_axes"], "int")
  _check_args.check_axis_name("axis_name", extras["axis_name"])
  defaults = dict(
    eps_root=0.0,
    mask=None,
    trust_ratio_mask=None,
    min_trust_ratio=None,
    max_trust_ratio=None,
    max_grad_norm=None,
  )
  lamb_config = LambConfig(
    learning_rate=learning_rate,
    stacked_axes=extras["stacked_axes"],
    axis_name=extras["axis_name"],
    **{**defaults, **config},
  )
  return build(
    lamb_config,
    implementation=extras["implementation"],
    skip_nonfinite=extras["skip_nonfinite"],
    grad_scale=extras["grad_scale"],
    master_weights=extras["master_weights"],
    grad_transform=grad_transform,
  )
