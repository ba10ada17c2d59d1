"""One table of lamb options for the tests of every implementation, on one tree that exercises them.

`CASES` maps a name to (lamb keyword arguments, the float64 NumPy reference's
options, gradient scale). The tree has a zero-initialised leaf (ratio exactly 1),
a scalar, an empty leaf, leaves with one and two stacked axes, and sizes that
give chunk tails and several buckets at the Pallas tests' tiny block sizes.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from lamb_reference import NumpyLamb

import optax_lamb

LR = 1e-2
STEPS = 10

SHAPES = {
  "dense": {"kernel": (16, 37), "bias": (37,)},  # bias zero-initialised: ratio exactly 1
  "scalar": (),
  "conv": (3, 4, 5),
  "stacked": (3, 70),  # stacked_axes=1: three slices
  "stacked2": (2, 3, 130),  # stacked_axes=2: six slices
  "vector": (300,),
  "tiny": (1,),
  "empty": (0, 3),
}
STACKED = {
  "dense": {"kernel": 0, "bias": 0},
  **{name: {"stacked": 1, "stacked2": 2}.get(name, 0) for name in SHAPES if name != "dense"},
}


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_params(seed=0, dtype=jnp.float32):
  shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
    SHAPES, is_leaf=_is_shape)[0]]  # fmt: skip
  leaves = [
    jnp.zeros(shape, dtype) if "bias" in path else (0.5 * jax.random.normal(k, shape)).astype(dtype)
    for k, shape, path in zip(keys, shapes, paths, strict=True)
  ]
  return jax.tree.unflatten(treedef, leaves)


def make_grads(params, seed, scale=1.0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1000 + seed), len(leaves))
  return jax.tree.unflatten(
    treedef,
    [
      (scale * jax.random.normal(k, jnp.shape(x))).astype(x.dtype)
      for k, x in zip(keys, leaves, strict=True)
    ],
  )


def paths(tree):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def by_path(tree):
  return dict(zip(paths(tree), jax.tree.leaves(tree), strict=True))


def _mask_by_path(mask_tree):
  return {n: bool(x) for n, x in by_path(mask_tree).items()}


decay_mask_fn = lambda p: jax.tree.map(lambda x: jnp.ndim(x) > 1, p)
adapt_mask = {
  "dense": {"kernel": True, "bias": False},
  **{name: name not in ("scalar", "tiny") for name in SHAPES if name != "dense"},
}
lr_schedule = optax.linear_schedule(LR, LR / 10, STEPS)
wd_schedule = optax.linear_schedule(0.1, 0.01, STEPS)
_stacked_by_path = {k: v for k, v in _mask_by_path(STACKED).items() if v} | {
  "['stacked2']": 2
}  # fmt: skip

# (lamb kwargs, NumPy reference options, grad scale)
CASES = {
  "defaults": ({}, {}, 1.0),
  "weight_decay": ({"weight_decay": 0.05}, {"weight_decay": 0.05}, 1.0),
  "decay_mask": (
    {"weight_decay": 0.05, "mask": decay_mask_fn},
    {"weight_decay": 0.05, "decay_mask": _mask_by_path(decay_mask_fn(make_params()))},
    1.0,
  ),
  "trust_ratio_mask": (
    {"trust_ratio_mask": adapt_mask},
    {"adapt_mask": _mask_by_path(adapt_mask)},
    1.0,
  ),
  "min_trust_ratio": ({"min_trust_ratio": 0.4}, {"min_ratio": 0.4}, 1.0),
  "max_trust_ratio": ({"max_trust_ratio": 0.3}, {"max_ratio": 0.3}, 1.0),
  "no_bias_correction": ({"bias_correction": False}, {"bias_correction": False}, 1.0),
  "eps_root": ({"eps_root": 1e-4, "eps": 1e-3}, {"eps_root": 1e-4, "eps": 1e-3}, 1.0),
  "eps_zero": ({"eps": 0.0}, {"eps": 0.0}, 1.0),  # 0/0 in masked-out kernel lanes
  "max_grad_norm": ({"max_grad_norm": 0.5}, {"max_grad_norm": 0.5}, 3.0),
  "stacked_axes": ({"stacked_axes": STACKED}, {"stacked": _stacked_by_path}, 1.0),
  "schedules": (
    {"learning_rate": lr_schedule, "weight_decay": wd_schedule},
    {"lr_schedule": lr_schedule, "wd_schedule": wd_schedule},
    1.0,
  ),
  "mu_bfloat16": ({"mu_dtype": jnp.bfloat16}, {"store_mu": ml_dtypes.bfloat16}, 1.0),
  "moments_bfloat16": (
    {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16, "weight_decay": 0.01},
    {"store_mu": ml_dtypes.bfloat16, "store_nu": ml_dtypes.bfloat16, "weight_decay": 0.01},
    1.0,
  ),
  "combined": (
    {
      "learning_rate": lr_schedule,
      "weight_decay": wd_schedule,
      "mask": decay_mask_fn,
      "trust_ratio_mask": adapt_mask,
      "min_trust_ratio": 0.05,
      "max_trust_ratio": 0.6,
      "max_grad_norm": 1.0,
      "stacked_axes": STACKED,
      "b1": 0.8,
      "b2": 0.99,
    },
    {
      "lr_schedule": lr_schedule,
      "wd_schedule": wd_schedule,
      "decay_mask": _mask_by_path(decay_mask_fn(make_params())),
      "adapt_mask": _mask_by_path(adapt_mask),
      "min_ratio": 0.05,
      "max_ratio": 0.6,
      "max_grad_norm": 1.0,
      "stacked": _stacked_by_path,
      "b1": 0.8,
      "b2": 0.99,
    },
    2.0,
  ),
}


def build(kwargs, implementation):
  kwargs = dict(kwargs)
  lr = kwargs.pop("learning_rate", LR)
  return optax_lamb.lamb(lr, implementation=implementation, **kwargs)


def numpy_lamb(params, grads_per_step, opts):
  """The float64 reference (tests/lamb_reference.py) on the tree, leaves named by path."""
  names = paths(params)
  ref = NumpyLamb(
    opts.get("lr_schedule", LR),
    b1=opts.get("b1", 0.9),
    b2=opts.get("b2", 0.999),
    eps=opts.get("eps", 1e-6),
    eps_root=opts.get("eps_root", 0.0),
    weight_decay=opts.get("wd_schedule", opts.get("weight_decay", 0.0)),
    decay_mask=opts.get("decay_mask"),
    bias_correction=opts.get("bias_correction", True),
    adapt_mask=opts.get("adapt_mask"),
    min_ratio=opts.get("min_ratio"),
    max_ratio=opts.get("max_ratio"),
    max_grad_norm=opts.get("max_grad_norm"),
    stacked_axes=opts.get("stacked"),
    store_mu=opts.get("store_mu"),
    store_nu=opts.get("store_nu"),
  )
  p = {n: np.asarray(x, np.float64) for n, x in zip(names, jax.tree.leaves(params), strict=True)}
  for grads in grads_per_step:
    g = {n: np.asarray(x, np.float64) for n, x in zip(names, jax.tree.leaves(grads), strict=True)}
    p = ref.step(p, g)
  return p, ref.ratios
