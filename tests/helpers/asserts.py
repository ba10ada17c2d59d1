"""Assertions on pytrees, and tolerances derived from the dtypes' rounding.

Tolerances:

- Two implementations of the float32 step agree to ``IMPLEMENTATION_RTOL``, the
  README's promise (rtol 1e-5, about 84 float32 units in the last place: the
  step's two norms sum hundreds of squares in different orders).
- Against the float64 NumPy LAMB the same rtol is scaled by the reference's
  condition number (`NumpyLamb.ratio_condition`) and turned into an atol scaled
  to the leaf's values, so an element near zero is judged on its leaf's scale.
- A value stored in a narrower dtype (bfloat16/float16 params or moments) is the
  rounding of float32 values that agree as above, so two of them may differ by
  one unit in the last place of that dtype at that value (`ulp`, subnormals
  included).

Every tolerance check records its margin (the worst |error| / tolerance) so that
``tests/tools/seed_sweep.py`` can report how close a sweep of seeds came.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATION_RTOL = 1e-5  # README: every implementation equals the XLA path to rtol 1e-5
FLOAT32_EPS = float(jnp.finfo(jnp.float32).eps)
# An FMA the compiler may or may not contract, and a reordered add: a few float32 roundings.
FEW_ROUNDINGS = 8 * FLOAT32_EPS

MARGINS: dict[str, float] = {}  # test id -> worst |error| / tolerance seen (seed sweeps)
current_test = ""  # set by tests/conftest.py


def record_margin(error, tolerance, kind: str = "") -> None:
  """Keep the worst |error| / tolerance of the running test (per kind of check)."""
  error, tolerance = np.asarray(error, np.float64), np.asarray(tolerance, np.float64)
  if error.size:
    margin = float(np.max(error / np.maximum(tolerance, np.finfo(np.float64).tiny)))
    key = current_test + kind
    MARGINS[key] = max(MARGINS.get(key, 0.0), margin)


def as_float64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def ulp(x, dtype) -> np.ndarray:
  """The spacing of `dtype` at |x| (float64 values), subnormals included."""
  info = jnp.finfo(dtype)
  exponent = np.floor(np.log2(np.maximum(np.abs(x), float(info.tiny))))
  return 2.0 ** (exponent - info.nmant)


def assert_trees_equal(a, b) -> None:
  """Same structure, same shapes and dtypes, bit-identical leaves."""
  chex.assert_trees_all_equal(a, b, strict=True)


def assert_trees_close(a, b, *, rtol: float = IMPLEMENTATION_RTOL, atol=None) -> None:
  """Same structure and leaf dtypes; |a - b| <= atol + rtol |b| (in float64), or a == b.

  `atol` defaults to one float32 rounding at the leaf's largest finite value: an element
  that cancels to near zero keeps the rounding of its leaf-sized terms.
  """
  chex.assert_trees_all_equal_structs(a, b)
  chex.assert_trees_all_equal_dtypes(a, b)
  chex.assert_trees_all_equal_shapes(a, b)
  paths = jax.tree_util.tree_flatten_with_path(a)[0]
  for (path, x), y in zip(paths, jax.tree.leaves(b), strict=True):
    y = np.asarray(y, np.float64)
    largest = np.max(np.abs(y), initial=0.0, where=np.isfinite(y))
    floor = FLOAT32_EPS * float(largest) if atol is None else atol
    assert_close_to_reference(x, y, rtol=rtol, atol=floor, err_msg=jax.tree_util.keystr(path))


def assert_close_to_reference(got, want, *, rtol: float, atol, err_msg: str = "") -> None:
  """|got - want| <= atol + rtol |want| elementwise (atol a number or an array), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  _assert_within(got, want, atol + rtol * np.abs(want), f"{err_msg} (rtol {rtol:.3g})")


def _assert_within(got, want, tolerance, what: str, kind: str = "") -> None:
  with np.errstate(invalid="ignore"):  # inf - inf: an infinity is 0 from itself
    error = np.where(got == want, 0.0, np.abs(got - want))
  record_margin(error, tolerance, kind)
  bad = ~(error <= tolerance)  # NaN fails too; an infinity passes only itself
  if np.any(bad):
    worst = np.unravel_index(np.argmax(np.where(bad, error - tolerance, -np.inf)), error.shape)
    raise AssertionError(
      f"{what}: {int(np.sum(bad))} of {error.size} elements out of tolerance; worst at "
      f"{worst}: {got[worst]!r} vs {want[worst]!r}, |error| {error[worst]:.3g} > "
      f"{np.broadcast_to(tolerance, error.shape)[worst]:.3g}"
    )


def assert_within_ulps(got, want, dtype, ulps: float = 1, err_msg: str = "", before=0.0) -> None:
  """Elementwise |got - want| <= `ulps` units in the last place of `dtype` at the larger value.

  `before`: how far apart the two values may have been before they were rounded to
  `dtype` (elementwise); two values d apart round at most u (1 + floor(d / u)) apart.
  """
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  spacing = ulp(np.maximum(np.abs(got), np.abs(want)), dtype)
  tolerance = spacing * (ulps + np.floor(np.asarray(before, np.float64) / spacing))
  # (a value that rounded the other way is exactly one ulp off: margin 1 by design)
  _assert_within(got, want, tolerance, f"{err_msg} ({ulps} {jnp.dtype(dtype).name} ulp)", " [ulps]")


def assert_trees_within_ulps(got, want, ulps: float = 1) -> None:
  """`assert_within_ulps` leaf by leaf, in each leaf's own dtype (float32: the README's rtol)."""
  chex.assert_trees_all_equal_structs(got, want)
  chex.assert_trees_all_equal_dtypes(got, want)
  paths = jax.tree_util.tree_flatten_with_path(got)[0]
  for (path, a), b in zip(paths, jax.tree.leaves(want), strict=True):
    where = jax.tree_util.keystr(path)
    if not jnp.issubdtype(a.dtype, jnp.floating):
      np.testing.assert_array_equal(a, b, err_msg=where)
    elif jnp.finfo(a.dtype).bits >= 32:  # plus one rounding at the leaf's scale, for cancellations
      atol = FLOAT32_EPS * float(np.max(np.abs(np.asarray(b, np.float64)), initial=0.0))
      assert_close_to_reference(a, b, rtol=IMPLEMENTATION_RTOL, atol=atol, err_msg=where)
    else:
      assert_within_ulps(a, b, a.dtype, ulps, err_msg=where)


def assert_all_finite(tree) -> None:
  chex.assert_tree_all_finite(as_float64(tree))


def snapshot(tree) -> list[np.ndarray]:
  """Copies of the leaves, to check later that a call left `tree` as it was."""
  return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def assert_unchanged(tree, snap) -> None:
  """`tree` still holds the values of `snapshot(tree)`, and no leaf was donated away."""
  leaves = jax.tree.leaves(tree)
  assert len(leaves) == len(snap)
  for x, y in zip(leaves, snap, strict=True):
    assert not (isinstance(x, jax.Array) and x.is_deleted())
    np.testing.assert_array_equal(np.asarray(x), y)
