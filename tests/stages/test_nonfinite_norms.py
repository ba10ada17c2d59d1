"""A NaN in a param or a gradient is never read as a zero norm (which would give ratio 1, or no
clipping, and move the finite elements): the affected ratios and updates are non-finite, as
with optax.lamb, and the zero-norm rule still holds for leaves that are really zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.implementations import TINY_BLOCKS
from helpers.two_leaves import RTOL, tiny_grads, tiny_params

import optax_lamb
from optax_lamb.backends.pallas import PallasBackend

PALLAS = PallasBackend(block_sizes=TINY_BLOCKS, interpret=True)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}


def _nan_bias_params() -> dict:
  params = tiny_params()
  return {"w": params["w"], "b": params["b"].at[1].set(jnp.nan)}


_UNDECAYED = dict(weight_decay=0.1, mask={"w": True, "b": False})


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_nan_param_of_undecayed_leaf_is_not_a_zero_norm(implementation):
  """A NaN in a param of an undecayed leaf must not read as ||p|| = 0 (ratio 1): the
  leaf's ratio and update are non-finite, as with optax.lamb; the other leaf is untouched."""
  params, grads = _nan_bias_params(), tiny_grads(1)[0]
  ours = optax_lamb.lamb(1e-2, implementation=IMPLEMENTATIONS[implementation], **_UNDECAYED)
  theirs = optax.lamb(1e-2, **_UNDECAYED)
  updates, state = jax.jit(ours.update)(grads, ours.init(params), params)
  want, _ = theirs.update(grads, theirs.init(params), params)
  ratio = optax_lamb.trust_ratios(state)["b"]
  assert not np.isfinite(float(ratio)), f"trust ratio of the NaN leaf: {float(ratio)}"
  np.testing.assert_array_equal(np.isfinite(updates["b"]), np.isfinite(want["b"]))
  assert np.all(np.isfinite(updates["w"]))


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_nan_param_of_decayed_leaf_is_not_a_zero_norm(implementation):
  """The decayed leaf: u holds the NaN too, and neither norm may read 0 (that gave ratio 1,
  and the finite elements moved). The leaf's update is NaN as with optax.lamb; the other stays finite."""
  params, grads = _nan_bias_params(), tiny_grads(1)[0]
  ours = optax_lamb.lamb(1e-2, weight_decay=0.1, implementation=IMPLEMENTATIONS[implementation])
  theirs = optax.lamb(1e-2, weight_decay=0.1)
  updates, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  want, _ = theirs.update(grads, theirs.init(params), params)
  np.testing.assert_array_equal(np.isfinite(updates["b"]), np.isfinite(want["b"]))
  assert np.all(np.isfinite(updates["w"]))


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_nan_param_in_one_stacked_slice_is_not_a_zero_norm(implementation):
  """Stacked: a NaN in one layer of a stacked undecayed leaf makes that layer's ratio
  non-finite (not 1); the other layers keep finite ratios."""
  params = {"w": jnp.ones((3, 4), jnp.float32).at[1, 2].set(jnp.nan)}
  grads = {"w": jnp.full((3, 4), 0.5, jnp.float32)}
  tx = optax_lamb.lamb(1e-2, stacked_axes=1, implementation=implementation)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  ratios = np.asarray(optax_lamb.trust_ratios(state)["w"])
  np.testing.assert_array_equal(np.isfinite(ratios), [True, False, True])


def test_nan_param_in_one_stacked_slice_on_the_kernels():
  """Stacked, on the Pallas kernels (slice sums): only the NaN layer's ratio is NaN."""
  params = {"w": jnp.ones((3, 4), jnp.float32).at[1, 2].set(jnp.nan)}
  grads = {"w": jnp.full((3, 4), 0.5, jnp.float32)}
  tx = optax_lamb.lamb(1e-2, stacked_axes=1, implementation=PALLAS)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  ratios = np.asarray(optax_lamb.trust_ratios(state)["w"])
  np.testing.assert_array_equal(np.isfinite(ratios), [True, False, True])


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_check_results_skips_a_nan_param_step(implementation):
  """skip_nonfinite(check_results=True) skips (and counts) the step that a NaN param of
  an undecayed leaf would spoil: its updates are all zero."""
  params, grads = _nan_bias_params(), tiny_grads(1)[0]
  inner = optax_lamb.lamb(1e-2, implementation=implementation, **_UNDECAYED)
  tx = optax_lamb.skip_nonfinite(inner, check_results=True)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert int(optax_lamb.skip_counts(state).total) == 1
  assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_nan_gradient_is_not_a_zero_clipping_norm(implementation):
  """The global clipping norm: a NaN gradient makes it NaN (read as 0, no leaf would
  be clipped and the finite ones would move by their unclipped gradients), as optax's clip does."""
  params = tiny_params()
  grads = tiny_grads(1)[0]
  grads = {"w": grads["w"] * 100.0, "b": grads["b"].at[0].set(jnp.nan)}
  clip = optax_lamb.clip_by_global_norm(1.0)
  got, _ = clip.update(grads, clip.init(params))
  want, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  for k in grads:
    np.testing.assert_array_equal(np.isfinite(got[k]), np.isfinite(want[k]), err_msg=k)
  tx = optax_lamb.lamb(1e-2, max_grad_norm=1.0, implementation=IMPLEMENTATIONS[implementation])
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert not any(np.any(np.isfinite(u)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
def test_zero_one_element_leaves_keep_the_zero_norm_rule(implementation):
  """The guard of the NaN rule: a zero scalar (or one-element) param, whose scaled sums XLA:CPU
  folds into 0 inf = NaN, still has norm 0 and ratio 1 when another leaf takes the rescue."""
  params = {
    "s": jnp.zeros((), jnp.float32), "one": jnp.zeros((1,), jnp.float32),
    "tiny": jnp.full((4, 3), 1e-30, jnp.float32),
  }  # fmt: skip
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, jnp.float32), params)
  tx = optax_lamb.lamb(1e-2, implementation=IMPLEMENTATIONS[implementation])
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  want, _ = optax.lamb(1e-2).update(grads, optax.lamb(1e-2).init(params), params)
  ratios = optax_lamb.trust_ratios(state)
  for k in ("s", "one"):
    assert float(ratios[k]) == 1.0, k
    np.testing.assert_allclose(updates[k], want[k], rtol=RTOL, err_msg=k)
