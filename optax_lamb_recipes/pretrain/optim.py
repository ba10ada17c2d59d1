"""The optimizer of a run by name: the recipe's ``lamb`` and ``adamw``, or a ``compat`` LAMB.

``lamb`` and ``adamw`` are ``optax_lamb_recipes.train.make_optimizer``'s (BERT's no-decay rule
for biases and LayerNorm, global clipping at 1, the settings of ``train.OptimizerConfig``);
``lamb`` also takes any other keyword of ``optax_lamb.lamb`` (``implementation``, ``mu_dtype``).
A ``compat`` constructor keeps its library's defaults, except that BERT's no-decay rule is its
``weight_decay_mask`` (``exclude_from_weight_decay`` for ``tfa_lamb``) unless one is given.
Every LAMB gets ``stacked_axes=pretrain.model.stacked_axes`` unless one is given: the model's
layers are stacked along axis 0 of each layer leaf, and each layer keeps its own trust ratio.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import optax

import optax_lamb
from optax_lamb_recipes import train
from optax_lamb_recipes.pretrain import model

COMPAT = tuple(optax_lamb.compat.__all__)
NAMES = ("lamb", "adamw", *COMPAT)
_RECIPE_FIELDS = frozenset(f.name for f in dataclasses.fields(train.OptimizerConfig))


def build(
  name: str, schedule: optax.Schedule, args: dict[str, Any]
) -> optax.GradientTransformation:
  """``name``'s transformation with learning rate ``schedule`` and keyword arguments ``args``."""
  args = dict(args)
  if name == "lamb":
    args.setdefault("stacked_axes", model.stacked_axes)  # one trust ratio per stacked layer
  if name in ("lamb", "adamw"):
    opt = train.OptimizerConfig(**{k: args.pop(k) for k in list(args) if k in _RECIPE_FIELDS})
    return train.make_optimizer(name, schedule, opt=opt, **args)
  if name not in COMPAT:
    raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(NAMES)}")
  constructor = getattr(optax_lamb.compat, name)
  accepted = inspect.signature(constructor).parameters
  if "stacked_axes" in accepted:
    args.setdefault("stacked_axes", model.stacked_axes)
  if "weight_decay_mask" in accepted:
    args.setdefault("weight_decay_mask", train.decay_mask)
  elif "exclude_from_weight_decay" in accepted:  # BERT's own TF code: names, searched
    args.setdefault("exclude_from_weight_decay", ["bias", "norm"])
  return constructor(schedule, **args)


def has_trust_ratios(tx: optax.GradientTransformation, params: Any) -> bool:
  """Whether ``optax_lamb.trust_ratios`` finds a trust-ratio stage in ``tx``'s state."""
  import jax

  try:
    jax.eval_shape(lambda p: optax_lamb.trust_ratios(tx.init(p)), params)
  except ValueError:
    return False
  return True
