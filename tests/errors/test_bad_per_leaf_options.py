"""Per-leaf options (`mask`, `trust_ratio_mask`, `stacked_axes`) that do not fit the params.

A per-leaf option is None, one value for every leaf, a pytree prefix of the
params (a None entry takes the default) or a callable(params) returning one. A
tree that is not a prefix fails at ``init`` (and at ``update``, for a state made
by another optimizer, `failed_calls.py`) with an error that names the option and shows both
structures and the paths that differ; a bad value returned by a callable names
``option(params)``. ``optax.tree_map_params`` (the README's sharded-init recipe)
works on ``jax.eval_shape(tx.init, params)`` and on a real state with every form
of the options.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from failed_calls import BAD_PER_LEAF, as_form, per_leaf_message
from failed_calls import build_per_leaf as build
from failed_calls import per_leaf_grads as make_grads
from failed_calls import per_leaf_params as make_params

import optax_lamb

BAD = [pytest.param(*BAD_PER_LEAF[case], id=case) for case in BAD_PER_LEAF]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name, form, tree, paths", BAD)
def test_wrong_structure_fails_at_init_naming_the_option(name, form, tree, paths, jit):
  tx = build(name, as_form(form, tree))
  with pytest.raises(ValueError, match=per_leaf_message(name, tree, paths)):
    (jax.jit(tx.init) if jit else tx.init)(make_params())


@pytest.mark.parametrize(
  "name, returned, shown",
  [
    ("mask", "no", "mask(params)='no'"),
    ("mask", {"w": True, "b": {"c": 0}}, "mask(params)['b']['c']=0"),
    ("trust_ratio_mask", "no", "trust_ratio_mask(params)='no'"),
    ("trust_ratio_mask", {"w": 1, "b": True}, "trust_ratio_mask(params)['w']=1"),
    ("stacked_axes", "1", "stacked_axes(params)='1'"),
    ("stacked_axes", {"w": 1.0, "b": 0}, "stacked_axes(params)['w']=1.0"),
  ],
)
def test_bad_value_from_a_callable_names_the_option(name, returned, shown):
  tx = build(name, lambda params: returned)
  with pytest.raises(
    TypeError, match=rf"^{re.escape(name)}\(params\) must be .*got {re.escape(shown)}$"
  ):
    tx.init(make_params())


def test_negative_stacked_axes_from_a_callable():
  tx = build("stacked_axes", lambda params: {"w": -1, "b": 0})
  with pytest.raises(ValueError, match=r"got stacked_axes\(params\)\['w'\]=-1$"):
    tx.init(make_params())


@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize(
  "name, short, full",
  [
    ("mask", {"w": True, "b": False}, {"w": True, "b": {"c": False}}),  # a prefix
    ("mask", {"w": None, "b": {"c": False}}, {"w": True, "b": {"c": False}}),  # None: decay
    ("trust_ratio_mask", {"w": False, "b": None}, {"w": False, "b": {"c": True}}),
    ("stacked_axes", {"w": 1, "b": None}, {"w": 1, "b": {"c": 0}}),
    ("stacked_axes", lambda p: {"w": 1, "b": 0}, {"w": 1, "b": {"c": 0}}),
  ],
  ids=["mask-prefix", "mask-None", "trust_ratio_mask-None", "stacked_axes-None", "callable"],
)
def test_prefixes_and_none_entries_equal_the_full_tree(name, short, full, implementation):
  params = make_params()
  results = []
  for option in (short, full):
    tx = build(name, option, implementation)
    state = tx.init(params)
    for seed in (1, 2):
      updates, state = tx.update(make_grads(seed), state, params)
    results.append(jax.tree.leaves((updates, optax_lamb.trust_ratios(state))))
  for a, b in zip(*results, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SPECS = {"w": "spec-w", "b": {"c": "spec-c"}}
MAPPED_OPTIONS = {
  "trust_ratio_mask-dict": dict(trust_ratio_mask={"w": True, "b": False}),
  "trust_ratio_mask-callable": dict(trust_ratio_mask=lambda p: {"w": True, "b": {"c": False}}),
  "stacked_axes-dict": dict(stacked_axes={"w": 1, "b": 0}),
  "stacked_axes-callable": dict(stacked_axes=lambda p: {"w": 1, "b": None}),
  "mask-dict": dict(mask={"w": True, "b": False}),
  "mask-callable": dict(mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
  "all-wrapped": dict(
    mask={"w": True, "b": False},
    trust_ratio_mask=lambda p: {"w": True, "b": False},
    stacked_axes={"w": 1, "b": None},
    weight_decay=optax.linear_schedule(0.1, 0.0, 10),
    grad_scale=lambda count: 2.0,
    skip_nonfinite=True,
    master_weights=True,
  ),
}


@pytest.mark.parametrize("state_kind", ["eval_shape", "init"])
@pytest.mark.parametrize("options", list(MAPPED_OPTIONS))
def test_tree_map_params_with_per_leaf_options(options, state_kind):
  kwargs = {"weight_decay": 0.1, **MAPPED_OPTIONS[options]}
  tx = optax_lamb.lamb(1e-2, **kwargs)
  params = make_params()
  state = jax.eval_shape(tx.init, params) if state_kind == "eval_shape" else tx.init(params)
  mapped = optax.tree_map_params(
    tx, lambda v, spec: spec, state, SPECS, transform_non_params=lambda _: "other"
  )
  copies = ["mu", "nu"] + (["master"] if kwargs.get("master_weights") else [])
  for field in copies:
    assert optax.tree_utils.tree_get(mapped, field) == SPECS, field
  leaves = jax.tree.leaves(mapped)
  assert leaves.count("spec-w") == leaves.count("spec-c") == len(copies)
  assert set(leaves) == {"spec-w", "spec-c", "other"}
  assert optax.tree_utils.tree_get(mapped, "ratios") == "other"
  assert len(leaves) == len(jax.tree.leaves(state))


def test_readme_sharded_init_recipe_with_dict_options():
  """README: state shardings from tree_map_params on jax.eval_shape(tx.init, params)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (tests/conftest.py gives the CPU 8)")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  param_shardings = {"w": sharded, "b": {"c": replicated}}
  params = jax.device_put(make_params(), param_shardings)
  tx = optax_lamb.lamb(
    1e-2,
    weight_decay=0.1,
    mask={"w": True, "b": False},
    trust_ratio_mask={"w": True, "b": {"c": False}},
    stacked_axes={"w": 1, "b": 0},
  )
  state_shardings = optax.tree_map_params(
    tx,
    lambda v, p, s: s if v.shape == p.shape else replicated,
    jax.eval_shape(tx.init, params),
    params,
    param_shardings,
    transform_non_params=lambda _: replicated,
  )
  state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  for field in ("mu", "nu"):
    moments = optax.tree_utils.tree_get(state, field)
    assert moments["w"].sharding.is_equivalent_to(sharded, 3), field
    assert moments["b"]["c"].sharding.is_equivalent_to(replicated, 1), field
  updates, _ = jax.jit(tx.update)(make_grads(1), state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
