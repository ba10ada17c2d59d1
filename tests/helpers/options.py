"""The one table of lamb options, for every implementation, and the values hypothesis draws from.

`CASES` maps a name to a `Case`: the keyword arguments of ``lamb``, those of the
float64 NumPy LAMB (`lamb_reference.NumpyLamb`, leaves named by path) for the
option tree of `trees.make_params`, and a gradient scale (3 makes the clipping
bind). `VALUES` lists, per option, the values the property tests combine; the
named cases take theirs from it where they can.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from helpers.implementations import lamb_for
from helpers.lamb_reference import NumpyLamb
from helpers.trees import by_path, make_params, paths
from hypothesis import strategies as st

LR = 1e-2
STEPS = 10


class Case(NamedTuple):
  lamb: dict[str, Any]
  reference: dict[str, Any]
  grad_scale: float = 1.0


def decay_mask_fn(p):
  return jax.tree.map(lambda x: jnp.ndim(x) > 1, p)


def adapt_non_scalars(p):
  return jax.tree.map(lambda x: jnp.ndim(x) > 0, p)


def stack_first_axis(p):
  return jax.tree.map(lambda x: min(jnp.ndim(x), 1), p)


def _full_tree(value_by_name: dict, default):
  """A tree of the option tree's structure: `value_by_name` at those paths, else `default`."""
  names = paths(make_params())
  flat = [value_by_name.get(name, default) for name in names]
  return jax.tree.unflatten(jax.tree.structure(make_params()), flat)


STACKED = {"['stacked']": 1, "['stacked2']": 2}
STACKED_TREE = _full_tree(STACKED, 0)
NO_DECAY = {"['dense']['bias']": False, "['tiny']": False}
DECAY_TREE = _full_tree(NO_DECAY, True)
ADAPT = {"['scalar']": False, "['tiny']": False, "['dense']['bias']": False}
ADAPT_TREE = _full_tree(ADAPT, True)
DECAY_BY_NAME = {name: bool(x) for name, x in by_path(decay_mask_fn(make_params())).items()}
ADAPT_BY_NAME = {name: ADAPT.get(name, True) for name in paths(make_params())}

lr_schedule = optax.linear_schedule(LR, LR / 10, STEPS)
wd_schedule = optax.linear_schedule(0.1, 0.01, STEPS)

# Per option (or pair of options): the values the property tests draw, and the ranges of
# those drawn as any float.
VALUES = {
  "learning_rate": [1e-2, 0.1, optax.linear_schedule(0.1, 0.01, 3)],
  "weight_decay": [0.0, 0.01, 0.1, 0.3, optax.linear_schedule(0.3, 0.0, 3)],
  "mask": [None, decay_mask_fn],
  "trust_ratio_mask": [None, adapt_non_scalars],
  "stacked_axes": [None, stack_first_axis],
  "min_trust_ratio": [None, 0.01, 0.05, 0.5],
  "max_trust_ratio": [None, 2.0, 10.0],
  "max_grad_norm": [None, 0.5, 1.0, 100.0],
  "bias_correction": [True, False],
  ("b1", "b2"): [(0.9, 0.999), (0.8, 0.99)],
  ("eps", "eps_root"): [(1e-6, 0.0), (1e-3, 1e-8), (1e-8, 0.0), (1e-4, 0.0)],
  "mu_dtype": [None, jnp.float32, jnp.bfloat16],
  "nu_dtype": [None, jnp.float32],
  "master_weights": [False, True],
}
RANGES = {"learning_rate": (1e-4, 1e-1), "b1": (0.0, 0.99), "b2": (0.9, 0.9999)}


@st.composite
def lamb_options(draw, names=tuple(VALUES)) -> dict:
  """lamb keyword arguments: each option of `names` at one of its `VALUES`."""
  kwargs = {}
  for name in names:
    value = draw(st.sampled_from(VALUES[name]))
    kwargs.update(zip(name, value, strict=True) if isinstance(name, tuple) else [(name, value)])
  return kwargs


CASES = {
  "defaults": Case({}, {}),
  "weight_decay": Case({"weight_decay": 0.05}, {"weight_decay": 0.05}),
  "decay_mask": Case(
    {"weight_decay": 0.05, "mask": decay_mask_fn},
    {"weight_decay": 0.05, "decay_mask": DECAY_BY_NAME},
  ),
  "decay_mask_tree": Case(
    {"weight_decay": 0.05, "mask": DECAY_TREE}, {"weight_decay": 0.05, "decay_mask": NO_DECAY}
  ),
  "trust_ratio_mask": Case({"trust_ratio_mask": ADAPT_TREE}, {"adapt_mask": ADAPT_BY_NAME}),
  "min_trust_ratio": Case({"min_trust_ratio": 0.4}, {"min_ratio": 0.4}),
  "max_trust_ratio": Case({"max_trust_ratio": 0.3}, {"max_ratio": 0.3}),
  "clamp": Case(
    {"min_trust_ratio": 0.5, "max_trust_ratio": 5.0}, {"min_ratio": 0.5, "max_ratio": 5.0}
  ),
  "no_bias_correction": Case({"bias_correction": False}, {"bias_correction": False}),
  "eps_root": Case({"eps_root": 1e-4, "eps": 1e-3}, {"eps_root": 1e-4, "eps": 1e-3}),
  # eps = 0 needs eps_root > 0 (both 0 are refused); masked-out kernel lanes then divide 0 by a tiny number
  "eps_zero": Case({"eps": 0.0, "eps_root": 1e-16}, {"eps": 0.0, "eps_root": 1e-16}),
  "max_grad_norm": Case({"max_grad_norm": 0.5}, {"max_grad_norm": 0.5}, 3.0),
  "max_grad_norm_loose": Case({"max_grad_norm": 1e3}, {"max_grad_norm": 1e3}),
  "stacked_axes": Case({"stacked_axes": STACKED_TREE}, {"stacked_axes": STACKED}),
  "stacked_axes_callable": Case(
    {"stacked_axes": lambda p: {**{k: None for k in p}, "stacked": 1, "stacked2": 2}},
    {"stacked_axes": STACKED},
  ),
  "schedules": Case(
    {"learning_rate": lr_schedule, "weight_decay": wd_schedule},
    {"learning_rate": lr_schedule, "weight_decay": wd_schedule},
  ),
  "moments_float32": Case({"mu_dtype": jnp.float32, "nu_dtype": jnp.float32}, {}),
  "mu_bfloat16": Case({"mu_dtype": jnp.bfloat16}, {"store_mu": ml_dtypes.bfloat16}),
  "moments_bfloat16": Case(
    {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16, "weight_decay": 0.01},
    {"store_mu": ml_dtypes.bfloat16, "store_nu": ml_dtypes.bfloat16, "weight_decay": 0.01},
  ),
  "decay_clamp_stacked_clip": Case(
    {
      "weight_decay": 0.01,
      "min_trust_ratio": 0.1,
      "max_grad_norm": 1.0,
      "stacked_axes": STACKED_TREE,
    },
    {"weight_decay": 0.01, "min_ratio": 0.1, "max_grad_norm": 1.0, "stacked_axes": STACKED},
    2.0,
  ),  # fmt: skip
  "no_bias_correction_combined": Case(
    {
      "learning_rate": lr_schedule,
      "weight_decay": 0.05,
      "mask": DECAY_TREE,
      "bias_correction": False,
      "trust_ratio_mask": ADAPT_TREE,
      "min_trust_ratio": 0.2,
      "max_trust_ratio": 8.0,
      "max_grad_norm": 2.0,
      "stacked_axes": STACKED_TREE,
    },
    {
      "learning_rate": lr_schedule,
      "weight_decay": 0.05,
      "decay_mask": NO_DECAY,
      "bias_correction": False,
      "adapt_mask": ADAPT_BY_NAME,
      "min_ratio": 0.2,
      "max_ratio": 8.0,
      "max_grad_norm": 2.0,
      "stacked_axes": STACKED,
    },
    2.0,
  ),  # fmt: skip
  "combined": Case(
    {
      "learning_rate": lr_schedule,
      "weight_decay": wd_schedule,
      "mask": decay_mask_fn,
      "trust_ratio_mask": ADAPT_TREE,
      "min_trust_ratio": 0.05,
      "max_trust_ratio": 0.6,
      "max_grad_norm": 1.0,
      "stacked_axes": STACKED_TREE,
      "b1": 0.8,
      "b2": 0.99,
    },
    {
      "learning_rate": lr_schedule,
      "weight_decay": wd_schedule,
      "decay_mask": DECAY_BY_NAME,
      "adapt_mask": ADAPT_BY_NAME,
      "min_ratio": 0.05,
      "max_ratio": 0.6,
      "max_grad_norm": 1.0,
      "stacked_axes": STACKED,
      "b1": 0.8,
      "b2": 0.99,
    },
    2.0,
  ),  # fmt: skip
}


def build(kwargs: dict, implementation: str = "xla") -> optax.GradientTransformationExtraArgs:
  """lamb for one of `implementations.IMPLEMENTATIONS` with a case's keyword arguments."""
  return lamb_for(implementation)(**{"learning_rate": LR, **kwargs})


def reference(options: dict) -> NumpyLamb:
  """The float64 NumPy LAMB with a case's reference options (learning rate `LR` unless set)."""
  return NumpyLamb(**{"learning_rate": LR, **options})


def numpy_lamb(params, grads_per_step, options: dict):
  """The float64 reference run on the tree from `params`: (final params by path, last ratios)."""
  names = paths(params)
  ref = reference(options)
  p = {n: np.asarray(x, np.float64) for n, x in zip(names, jax.tree.leaves(params), strict=True)}
  for grads in grads_per_step:
    g = {n: np.asarray(x, np.float64) for n, x in zip(names, jax.tree.leaves(grads), strict=True)}
    p = ref.step(p, g)
  return p, ref.ratios


# lamb's numeric arguments, each with a value other than its default (and one that acts on the
# test trees): what optax.inject_hyperparams injects in tests/stages and tests/contract.
LAMB_NUMBERS = {
  "learning_rate": 2e-2,
  "b1": 0.8,
  "b2": 0.99,
  "eps": 1e-4,
  "eps_root": 1e-8,
  "weight_decay": 0.1,
  "min_trust_ratio": 0.5,
  "max_trust_ratio": 0.7,
  "max_grad_norm": 0.5,
  "grad_scale": 4.0,
}
