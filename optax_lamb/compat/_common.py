"""What the compat constructors share: argument checks, masks from names, the build's arguments,
library rules.

Each library's constructor (its own module) checks its arguments with that
library's names and refusals, maps them onto `optax_lamb.core._config.LambConfig`
(see ``docs/which_lamb.md`` for the mapping) with `build_args`, which checks it as
`optax_lamb.lamb`'s is checked (`optax_lamb.faults._check_args.lamb_config`), and builds the
transformation with `optax_lamb.step._transform.build`, as `optax_lamb.lamb` does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, TypeVar

import jax
import jax.numpy as jnp
import optax

from optax_lamb.core import _leaf, _options, _ratios
from optax_lamb.core._config import PerLeafMask
from optax_lamb.faults import _check_args, _checks

F = TypeVar("F", bound=Callable[..., Any])


def check_betas(name: str, betas: Any) -> tuple[Any, Any]:
  """A pair of decays in [0, 1), named `name[0]`, `name[1]`."""
  if not (isinstance(betas, Sequence) and len(betas) == 2):
    raise TypeError(f"{name} must be a pair (b1, b2), got {name}={betas!r}")
  for i, beta in enumerate(betas):
    _check_args.check_in_unit_interval(f"{name}[{i}]", beta)
  return betas[0], betas[1]


def check_mask(name: str, mask: PerLeafMask) -> None:
  _check_args.check_per_leaf(name, mask, "bool")


def named_mask(name: str, mask: PerLeafMask) -> PerLeafMask:
  """`mask` (None, a pytree prefix or a callable) as a callable(params) resolved under `name`.

  The core checks a mask against the params as ``mask``; resolved here first, a bad
  structure or a callable's bad result is reported with the constructor's own name.
  """
  if mask is None:
    return None
  return lambda params: _checks.resolve_per_leaf(mask, params, True, name, "bool")


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


def regex_mask(patterns: Sequence[str] | None) -> PerLeafMask:
  """callable(params): True on the leaves whose '/'-joined path no pattern `re.search`es."""
  compiled = [re.compile(p) for p in patterns or ()]

  def mask(params) -> Any:
    return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(r.search(path_name(path)) for r in compiled), params
    )

  return mask


def keras_clipping(
  clipnorm: Any, clipvalue: Any, lamb_options: dict
) -> Callable[[Any, Any], Any] | None:
  """`build`'s grad_transform for Keras' per-variable clips, or None without one.

  clipvalue: g <- clip(g, -c, c); then clipnorm: g <- g min(1, c / ||g||) per variable
  (``c / max(||g||, c)``, Keras' and TensorFlow's clip_by_norm): per leaf, or per stacked
  slice with ``stacked_axes`` (a slice is one layer's variable), the squared norm of a
  sharded leaf summed over its mapped axes. Before the planned step, not in it: its clip is
  global (``global_clipnorm``), these are per variable.
  """
  if clipnorm is None and clipvalue is None:
    return None
  axis_name, stacked_axes = lamb_options["axis_name"], lamb_options["stacked_axes"]

  def transform(grads, params) -> Any:
    if clipvalue is not None:
      grads = jax.tree.map(lambda g: jnp.clip(g, -clipvalue, clipvalue).astype(g.dtype), grads)
    if clipnorm is not None:
      treedef: Any
      leaves, treedef = jax.tree.flatten(grads)
      names = _checks.resolve_axis_names(axis_name, params)
      axes = treedef.flatten_up_to(_checks.resolve_stacked_axes(stacked_axes, params))
      one = _ratios.one_device()  # small leaves: `_ratios.small_sums`
      sq = [
        _ratios.sq_norm(g, k, n is None and one)
        for g, k, n in zip(leaves, axes, names, strict=True)
      ]
      factors = [
        _leaf.clip_factor(_ratios.safe_sqrt(s), clipnorm) for s in _options.psum_by_name(sq, names)
      ]
      grads = treedef.unflatten(
        [_leaf.clip(g, _leaf.broadcast_ratio(f, g)) for g, f in zip(leaves, factors, strict=True)]
      )
    return grads

  return transform


def build_args(
  *,
  learning_rate: optax.ScalarOrSchedule,
  learning_rate_name: str,
  lamb_options: dict,
  grad_transform: Callable[[Any, Any], Any] | None = None,
  **config: object,
) -> dict[str, Any]:
  """The arguments of `optax_lamb.step._transform.build` for one compat constructor: its
  `LambConfig`, built from `config` (fields by lamb's names) and checked, then lamb's options
  (`lamb_options`); the constructor builds."""
  lamb_config = _check_args.lamb_config(
    learning_rate_name=learning_rate_name,
    library_clip=True,
    learning_rate=learning_rate,
    stacked_axes=lamb_options["stacked_axes"],
    axis_name=lamb_options["axis_name"],
    **config,
  )
  return dict(
    config=lamb_config,
    implementation=lamb_options["implementation"],
    skip_nonfinite=lamb_options["skip_nonfinite"],
    grad_scale=lamb_options["grad_scale"],
    master_weights=lamb_options["master_weights"],
    grad_transform=grad_transform,
  )


# lamb's keyword-only arguments that every constructor takes too, with lamb's defaults (named
# in the signatures, so that optax.inject_hyperparams' static_args can name them).
LAMB_OPTIONS = (
  "stacked_axes",
  "axis_name",
  "implementation",
  "skip_nonfinite",
  "grad_scale",
  "master_weights",
)


# The docstrings' shared parts, written once: a constructor's docstring holds a marker line that
# `documented` replaces by the text (indented as in a function's docstring, Args at 4 spaces).
_SHARED_DOC = {
  "{torch_groups}": """\
    weight_decay_mask: torch's parameter groups, as a pytree prefix of bools
      (``None`` entries count as True) or a callable(params) returning one, like
      :func:`optax_lamb.lamb`'s ``mask``: True where the leaf's group has this
      ``weight_decay``, False where its group has weight decay 0. None: every leaf.""",
  "{lamb_options_and_returns}": """\
    stacked_axes: as in :func:`optax_lamb.lamb`: one trust ratio per stacked layer.
    axis_name: as in :func:`optax_lamb.lamb`: the mapped axes the leaves are sharded over.
    implementation: as in :func:`optax_lamb.lamb`: ``"auto"``, ``"xla"``, ``"pallas"``, ...
    skip_nonfinite: as in :func:`optax_lamb.lamb`: skip a step with non-finite gradients.
    grad_scale: as in :func:`optax_lamb.lamb`: the loss scale the gradients are divided by.
    master_weights: as in :func:`optax_lamb.lamb`: float32 masters of low-precision params.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.""",
}


def documented(fn: F) -> F:
  """`fn` with each marker line of its docstring (a key of `_SHARED_DOC`) replaced by its text."""
  lines = (fn.__doc__ or "").split("\n")
  fn.__doc__ = "\n".join(_SHARED_DOC.get(line.strip(), line) for line in lines)
  return fn


def lamb_options(arguments: dict) -> dict:
  """lamb's options among a constructor's `arguments` (its ``locals()``), for `make`."""
  return {name: arguments[name] for name in LAMB_OPTIONS}


def check_torch_style(arguments: dict, flags: tuple[str, ...]) -> dict:
  """What apex, DeepSpeed, timm and torch_optimizer share: lr, betas, eps, weight decay, mask.

  `arguments` are the constructor's (its ``locals()``), `flags` the names of its bool
  arguments. Checks them; returns `make`'s keywords for the shared ones.
  """
  lr, betas, eps, weight_decay, mask = (
    arguments[k] for k in ("lr", "betas", "eps", "weight_decay", "weight_decay_mask")
  )
  b1, b2 = check_betas("betas", betas)
  _check_args.check_positive("eps", eps)  # 0 would give 0 / 0 where g = 0
  _check_args.check_non_negative("weight_decay", weight_decay)
  for name in flags:
    _check_args.check_bool(name, arguments[name])
  check_mask("weight_decay_mask", mask)
  return dict(
    learning_rate=lr,
    learning_rate_name="lr",
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=weight_decay,
    mask=named_mask("weight_decay_mask", mask),
  )


NO_LEAF = False  # a trust_ratio_mask prefix that matches every leaf: no leaf adapts


def adaptation(always: bool, weight_decay: float | None, weight_decay_mask: PerLeafMask) -> dict:
  """apex and timm: a leaf adapts iff its group's weight decay is not 0, or always; `make`'s
  keywords. `weight_decay` is its value, or None for an array: decided at each step then."""
  if always:
    return dict(trust_ratio_mask=None)
  if weight_decay is None:
    return dict(trust_ratio_mask=weight_decay_mask, adapt_if_decaying=True)
  return dict(trust_ratio_mask=weight_decay_mask if weight_decay != 0 else NO_LEAF)


def torch_clip(max_grad_norm: Any, library: str) -> Any:
  """apex's and timm's max_grad_norm: g / max(G / c, 1); 0 zeroes every gradient; inf: none
  (an array's value acts alike at each step: `_leaf.clip_factor`)."""
  value = _check_args.number("max_grad_norm", max_grad_norm)
  if value is None:
    return max_grad_norm
  if not value >= 0.0:
    raise ValueError(
      f"max_grad_norm must be a number >= 0 (0 zeroes every gradient, as {library} does; a "
      f"negative threshold, which would flip the gradients' signs, is refused), got "
      f"max_grad_norm={max_grad_norm!r}"
    )
  return None if value == math.inf else value


def is_number(x: object) -> TypeGuard[int | float]:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def positive_or_off(value: Any, known: float | None) -> Any:
  """A threshold that clips only when > 0: None (off) for a number <= 0 (`known`, its value);
  for an array, inf where it is <= 0, decided at each step (a NaN stays NaN, never off)."""
  if known is None and value is not None:  # an array: inf clips nothing
    return jnp.where(value <= 0, jnp.inf, value)
  return value if known is not None and known > 0 else None


def keras_clip_options(clipnorm, clipvalue, global_clipnorm) -> dict:
  """Keras 3: at most one clip option (ValueError); one that is not > 0 clips nothing."""
  given = {"clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm}
  known: dict[str, float | None] = {}
  for name, value in given.items():
    if value is not None:
      known[name] = x = _check_args.number(name, value, "a number (> 0 clips, <= 0 does not)")
      if x is not None and math.isnan(x):
        raise ValueError(f"{name} must be a number (> 0 clips, <= 0 does not), got {name}=nan")
  if sum(v is not None for v in given.values()) > 1:
    raise ValueError(
      "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
      f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
    )
  return {name: positive_or_off(value, known.get(name)) for name, value in given.items()}


def ratio_clamps(max_coeff: Any, high: float | None, min_coeff: Any, low: float | None) -> tuple:
  """DeepSpeed's and ONNX Runtime's max(min(r, max_coeff), min_coeff) as lamb's clamps of r >= 0:
  (max(min_coeff, 0), max(max_coeff, min_coeff)) (min_coeff > max_coeff: r = min_coeff). With
  both values known (`high`, `low`) a clamp that clamps nothing is None; arrays act at each step."""
  if high is None or low is None:
    return jnp.maximum(min_coeff, 0.0), jnp.maximum(max_coeff, min_coeff)
  high = max(high, low)
  return (low if low > 0 else None), (None if high == math.inf else high)
