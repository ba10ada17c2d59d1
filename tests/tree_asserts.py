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


def snapshot(tree):
  """Copies of the leaves, to check later that a call left `tree` as it was."""
  return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def assert_unchanged(tree, snap):
  """`tree` still holds the values of `snapshot(tree)`, and no leaf was donated away."""
  leaves = jax.tree.leaves(tree)
  assert len(leaves) == len(snap)
  for x, y in zip(leaves, snap, strict=True):
    assert not (isinstance(x, jax.Array) and x.is_deleted())
    np.testing.assert_array_equal(np.asarray(x), y)
