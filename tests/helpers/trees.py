"""The trees the tests run on, and their gradients.

`make_params` builds the option tree of the option table: a zero-initialised
leaf (ratio exactly 1), a scalar, an empty leaf, leaves with one and two stacked
axes, sizes that give chunk tails and several buckets at the Pallas tests' tiny
block sizes, and scales from 0.01 to 10 (the three slices of ``stacked`` too) so
that the ratios spread over orders of magnitude and the clamps bind.
`random_tree` and `random_like` draw any other small tree from a NumPy generator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
SCALES = {"['scalar']": 2.0, "['conv']": 10.0, "['vector']": 0.01, "['dense']['bias']": 0.0}
DEFAULT_SCALE = 0.5
STACKED_SLICE_SCALES = np.array([0.1, 1.0, 10.0])  # of "stacked": one ratio per slice matters


def is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def by_path(tree) -> dict:
  return dict(zip(paths(tree), jax.tree.leaves(tree), strict=True))


def make_params(seed: int = 0, dtype=jnp.float32):
  """The option tree, drawn from `seed`."""
  shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=is_shape)
  names = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(SHAPES, is_leaf=is_shape)[0]]  # fmt: skip
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  leaves = []
  for key, shape, name in zip(keys, shapes, names, strict=True):
    leaf = SCALES.get(name, DEFAULT_SCALE) * jax.random.normal(key, shape)
    if name == "['stacked']":
      leaf = leaf * STACKED_SLICE_SCALES[:, None]
    leaves.append(leaf.astype(dtype))
  return jax.tree.unflatten(treedef, leaves)


def make_grads(params, seed: int, scale: float = 1.0):
  """Standard normal gradients times `scale`, in the params' dtypes, drawn from `seed`."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1000 + seed), len(leaves))
  return jax.tree.unflatten(
    treedef,
    [(scale * jax.random.normal(k, jnp.shape(x))).astype(x.dtype)
     for k, x in zip(keys, leaves, strict=True)],
  )  # fmt: skip


def random_tree(rng: np.random.Generator, shapes, dtype=jnp.float32, scale: float = 1.0):
  """A tree of `shapes` (a pytree of shape tuples): normal values times `scale`, in `dtype`."""
  return jax.tree.map(
    lambda s: jnp.asarray(scale * rng.normal(size=s), dtype), shapes, is_leaf=is_shape
  )


def random_like(rng: np.random.Generator, tree, scale: float = 1.0):
  """Normal values times `scale`, shaped and typed like `tree` (gradients for params)."""
  return jax.tree.map(lambda x: jnp.asarray(scale * rng.normal(size=jnp.shape(x)), x.dtype), tree)


def cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)
