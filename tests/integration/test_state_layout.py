"""lamb's state: O(1) buffers beyond the moments, per-leaf ratios read back, sharding recipes work."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import seeds
from helpers.asserts import assert_trees_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_lamb

shapes = st.lists(
  st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=40
)
options = st.sampled_from(
  [
    {},
    {"weight_decay": 0.01, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)},
    {"trust_ratio_mask": lambda p: jax.tree.map(lambda x: x.ndim > 0, p), "max_grad_norm": 1.0},
    {"stacked_axes": lambda p: jax.tree.map(lambda x: min(x.ndim, 1), p)},
    {"learning_rate": optax.linear_schedule(1e-3, 0.0, 10), "weight_decay": lambda t: 0.01},
    {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16},
    {"skip_nonfinite": True, "learning_rate": optax.linear_schedule(1e-3, 0.0, 10)},
  ]
)


@settings(max_examples=seeds.examples(30))
@given(shapes=shapes, kwargs=options)
def test_state_buffers_at_most_optax_lamb_plus_four(shapes, kwargs):
  params = {f"p{i}": jnp.zeros(s) for i, s in enumerate(shapes)}
  kwargs = dict(kwargs)
  lr = kwargs.pop("learning_rate", 1e-3)
  ours = jax.eval_shape(optax_lamb.lamb(lr, **kwargs).init, params)
  theirs = jax.eval_shape(optax.lamb(lr).init, params)
  assert len(jax.tree.leaves(ours)) <= len(jax.tree.leaves(theirs)) + 4


@settings(max_examples=seeds.examples(20))
@given(shapes=shapes)
def test_trust_ratios_are_per_leaf_in_stacked_shape(shapes):
  params = {f"p{i}": jnp.ones(s) for i, s in enumerate(shapes)}
  stacked = lambda p: jax.tree.map(lambda x: min(x.ndim, 1), p)
  tx = optax_lamb.lamb(1e-3, stacked_axes=stacked)
  # shapes and dtypes only: traced, not run
  ratios = jax.eval_shape(lambda p: optax_lamb.trust_ratios(tx.update(p, tx.init(p), p)[1]), params)
  assert jax.tree.structure(ratios) == jax.tree.structure(params)
  for name, p in params.items():
    assert ratios[name].shape == p.shape[: min(p.ndim, 1)], name
    assert ratios[name].dtype == jnp.float32


def test_trust_ratios_keep_leading_batch_axes(rng):
  """Under vmap (and pmap) the ratio vector gains leading axes; trust_ratios keeps them."""
  params = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32), "b": jnp.ones(4)}
  tx = optax_lamb.lamb(1e-2, stacked_axes={"w": 1, "b": 0})
  batched = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)

  def one(p):
    _, state = tx.update(p, tx.init(p), p)
    return state

  states = jax.vmap(one)(batched)
  ratios = optax_lamb.trust_ratios(states)
  assert ratios["w"].shape == (2, 3) and ratios["b"].shape == (2,)
  for i in range(2):
    single = optax_lamb.trust_ratios(one(jax.tree.map(lambda x, i=i: x[i], batched)))
    np.testing.assert_allclose(ratios["w"][i], single["w"], rtol=1e-6)


def test_ratio_state_is_one_buffer_replicated_by_tree_map_params():
  """optax.tree_map_params (the README's sharded-init recipe) pairs the layouts and maps the vector."""
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  tx = optax_lamb.lamb(1e-3, stacked_axes={"w": 1, "b": 0})
  state = jax.eval_shape(tx.init, params)
  mapped = optax.tree_map_params(
    tx,
    lambda v, p: "param-shaped",
    state,
    params,
    transform_non_params=lambda v: "other",
  )
  ratio_state = mapped[3]
  assert ratio_state.ratios == "other"
  assert mapped[1].mu == {"w": "param-shaped", "b": "param-shaped"}


def test_init_is_pure_tree_map_params_after_init_on_another_tree():
  """init keeps nothing between calls: after init on another tree, optax.tree_map_params of the
  first tree's state maps it as it maps a fresh one (the same structure, the same values)."""
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  other = {"x": jnp.ones((5, 2))}
  for tx in (optax_lamb.lamb(1e-3), optax_lamb.scale_by_trust_ratio()):
    state = tx.init(params)
    fresh = optax.tree_map_params(tx, lambda v: v + 1, state)
    tx.init(other)
    after = optax.tree_map_params(tx, lambda v: v + 1, state)
    assert jax.tree.structure(after) == jax.tree.structure(state)
    assert_trees_equal(after, fresh)
