"""Assertions on pytrees shared by the tests."""

import jax
import numpy as np


def assert_trees_equal(a, b):
  """Same structure, same dtypes, bit-identical leaves."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
