"""Every public transformation (`public_transformations.ENTRIES`) through optax's contract.

For each entry: `init` is pure; `jax.jit(update)` equals the eager `update`; each numeric argument
injected by `optax.inject_hyperparams` as an array gives the plain constructor's update;
`optax.MultiSteps` over two micro-steps equals one step on their mean gradient;
`optax.tree_map_params` maps the params-shaped parts of a state after `init` on another tree;
bfloat16 and float32 params keep their dtypes in the updates and the state's dtypes across updates;
and on an Explicit-axis mesh `jax.typeof` of every state leaf (dtype and sharding) is unchanged by
`update` (optax's sharding test). A tiny tree: `w` 8x4 (sharded over the mesh's axis) and `b` 3.
"""

from __future__ import annotations

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.asserts import (
  FEW_ROUNDINGS,
  FLOAT32_EPS,
  IMPLEMENTATION_RTOL,
  assert_all_finite,
  assert_close_to_reference,
  assert_trees_close,
  assert_trees_equal,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from public_transformations import CHECKS, ENTRIES, Entry, Injection, numeric_parameters

SHAPES = {"w": (8, 4), "b": (3,)}
OTHER_SHAPES = {"x": (5,), "y": {"z": (2, 2)}, "t": (1,)}  # another structure, other shapes


def _entries(check: str) -> list:
  return [pytest.param(e, id=e.name) for e in ENTRIES if check not in e.exclusions]


def _draw(rng, shapes, dtypes=None) -> dict:
  """Normal draws shaped like `shapes`, float32 or the dtype `dtypes` gives a top-level name."""
  dtypes = dtypes or {}
  return jax.tree_util.tree_map_with_path(
    lambda path, shape: jnp.asarray(
      rng.standard_normal(shape), dtypes.get(path[0].key, jnp.float32)
    ),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def _params_and_grads(rng, steps: int, dtypes=None) -> tuple[dict, list[dict]]:
  return _draw(rng, SHAPES, dtypes), [_draw(rng, SHAPES, dtypes) for _ in range(steps)]


def _steps(tx, params, grads, update=None):
  """The updates and the state after each of `grads`, the params held fixed."""
  update = update or jax.jit(tx.update)
  state, out = tx.init(params), []
  for g in grads:
    updates, state = update(g, state, params)
    out.append((updates, state))
  return out


def _assert_updates_close(got, want, params, rtol: float) -> None:
  """`assert_trees_close` with one float32 rounding at each param's scale added: with master
  weights an update is the new params less the params, so it carries their rounding."""
  chex.assert_trees_all_equal_structs(got, want, params)
  chex.assert_trees_all_equal_dtypes(got, want)
  for (path, g), w, p in zip(
    jax.tree_util.tree_flatten_with_path(got)[0],
    jax.tree.leaves(want),
    jax.tree.leaves(params),
    strict=True,
  ):
    scale = max(
      np.max(np.abs(np.asarray(w, np.float64))), np.max(np.abs(np.asarray(p, np.float64)))
    )
    assert_close_to_reference(
      g, w, rtol=rtol, atol=FLOAT32_EPS * scale, err_msg=jax.tree_util.keystr(path)
    )


def _package_globals() -> dict:
  """Every module-level name of optax_lamb: the object it holds, and a mutable container's items."""

  def items(v):
    if isinstance(v, dict):
      return tuple((id(k), id(x)) for k, x in v.items())
    if isinstance(v, list | set):
      return tuple(sorted(map(id, v)))
    return None

  return {
    (name, key): (id(value), items(value))
    for name, module in list(sys.modules.items())
    if name == "optax_lamb" or name.startswith("optax_lamb.")
    for key, value in vars(module).items()
  }


def test_the_list_names_every_public_transformation():
  """Each public constructor of optax_lamb and optax_lamb.compat is in the list, or is not a
  transformation's constructor (a state type, an accessor)."""
  import optax_lamb
  from optax_lamb import compat

  listed = {e.constructor or e.build for e in ENTRIES}
  not_transformations = {
    "master_weights",
    "skip_counts",
    "spike_stats",
    "trust_ratios",
    "update_and_apply",
    "compat",
  }
  for name in optax_lamb.__all__:
    value = getattr(optax_lamb, name)
    if name in not_transformations or isinstance(value, type):
      continue
    assert value in listed, name
  for name in compat.__all__:
    assert getattr(compat, name) in listed, name


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name) for e in ENTRIES])
def test_the_entry_names_every_numeric_argument(entry: Entry):
  """The numbers an entry injects are every numeric argument of its public constructor, less
  those it names with why; and each of its exclusions is a check of the suite."""
  wanted = numeric_parameters(entry.constructor or entry.build)
  injected = {name for i in entry.injections() for name in i.numbers}
  assert wanted - set(entry.not_injected) <= injected, entry.name
  assert set(entry.not_injected) <= wanted, entry.name
  assert set(entry.exclusions) <= set(CHECKS), entry.name


def check_pure_init(entry: Entry, rng) -> None:
  """init twice on the same params gives equal states, init on another tree in between changes
  nothing, init writes no module-level state of optax_lamb, and jit(init) gives the same state."""
  tx = entry.transformation()
  params, other = _draw(rng, SHAPES), _draw(rng, OTHER_SHAPES)
  tx.init(other)  # first use: backends loaded by name, memoized tables (caches, not state)
  before = _package_globals()
  first = tx.init(params)
  tx.init(other)
  again = tx.init(params)
  assert _package_globals() == before
  assert_trees_equal(again, first)
  assert_trees_equal(jax.jit(tx.init)(params), first)


def check_jit(entry: Entry, rng) -> None:
  """jax.jit(update) equals the eager update, over two steps, to a few float32 roundings."""
  tx = entry.transformation()
  params, grads = _params_and_grads(rng, 2)
  eager = _steps(tx, params, grads, update=tx.update)
  jitted = _steps(tx, params, grads)
  for (want_updates, want_state), (updates, state) in zip(eager, jitted, strict=True):
    _assert_updates_close(updates, want_updates, params, rtol=FEW_ROUNDINGS)
    assert_trees_close(state, want_state, rtol=FEW_ROUNDINGS)


def check_inject_hyperparams(entry: Entry, rng, injection: Injection | None = None) -> None:
  """The injection's numbers injected at once, each given as a jnp array: the same updates and
  inner state as the constructor given the same Python numbers."""
  injection = injection or entry.injections()[0]
  params, grads = _params_and_grads(rng, 2)
  arrays = {k: jnp.asarray(v) for k, v in injection.numbers.items()}
  inject = optax.inject_hyperparams(entry.build, static_args=entry.static_args)
  injected = inject(**arrays, **injection.flags)
  assert set(injection.numbers) <= set(injected.init(params).hyperparams)
  plain = entry.build(**{**injection.numbers, **injection.plain}, **injection.flags)
  got, want = _steps(injected, params, grads), _steps(plain, params, grads)
  for (want_updates, want_state), (updates, state) in zip(want, got, strict=True):
    # arrays against Python numbers: 1 - b2^t and the like evaluated two ways (README rtol)
    _assert_updates_close(updates, want_updates, params, rtol=IMPLEMENTATION_RTOL)
    if injection.same_state:
      assert_trees_close(state.inner_state, want_state, rtol=IMPLEMENTATION_RTOL)


def check_multi_steps(entry: Entry, rng, around: bool = False) -> None:
  """optax.MultiSteps(every 2) (around the transformation, or as the entry composes it): no
  step after the first micro-step, then one step on the two gradients' mean."""
  tx = entry.transformation()
  if entry.multi_steps is None or around:
    multi = optax.MultiSteps(tx, every_k_schedule=2)
  else:
    multi = entry.multi_steps(**entry.numbers)
  params, grads = _params_and_grads(rng, 2)
  (first, _), (updates, state) = _steps(multi, params, grads)
  [(want_updates, want_state)] = _steps(
    tx, params, [jax.tree.map(lambda a, b: (a + b) / 2, *grads)]
  )
  assert all(not np.any(u) for u in jax.tree.leaves(first))
  _assert_updates_close(updates, want_updates, params, rtol=IMPLEMENTATION_RTOL)
  assert_trees_close(state.inner_opt_state, want_state, rtol=IMPLEMENTATION_RTOL)


def check_tree_map_params(entry: Entry, rng) -> None:
  """optax.tree_map_params maps the state of `params` after `init` on another tree (a layout of
  the last init kept anywhere would not match): exactly the entry's params-shaped copies, each
  leaf where the params' leaf is, the rest left as it is."""
  tx = entry.transformation()
  params, other = _draw(rng, SHAPES), _draw(rng, OTHER_SHAPES)
  state = tx.init(params)
  tx.init(other)
  marked = optax.tree_map_params(
    tx, lambda p: "params", state, transform_non_params=lambda _: "other"
  )
  assert jax.tree.structure(marked) == jax.tree.structure(state)
  leaves, marks = jax.tree.leaves(state), jax.tree.leaves(marked)
  mapped_shapes = [x.shape for x, m in zip(leaves, marks, strict=True) if m == "params"]
  assert mapped_shapes == [p.shape for p in jax.tree.leaves(params)] * entry.params_copies
  doubled = optax.tree_map_params(tx, lambda p: 2 * p, state)
  for x, y, m in zip(leaves, jax.tree.leaves(doubled), marks, strict=True):
    np.testing.assert_array_equal(y, 2 * np.asarray(x) if m == "params" else x)


def check_dtypes(entry: Entry, rng) -> None:
  """bfloat16 and float32 params in one tree: each update in the entry's dtype for its param's
  (the param's own, but for a documented exception), the state's structure and dtypes the same
  after each update as after init."""
  params, grads = _params_and_grads(rng, 2, dtypes={"w": jnp.bfloat16})
  tx = entry.transformation()

  def dtypes(tree):
    return jax.tree.structure(tree), [jnp.dtype(x.dtype) for x in jax.tree.leaves(tree)]

  at_init = dtypes(tx.init(params))
  want = jax.tree.map(lambda p: jnp.dtype(entry.update_dtype(p.dtype)), params)
  for updates, state in _steps(tx, params, grads):
    assert dtypes(updates) == (jax.tree.structure(want), jax.tree.leaves(want))
    assert dtypes(state) == at_init
    assert_all_finite(updates)


def check_sharding(entry: Entry, rng) -> None:
  """optax's sharding contract: on an Explicit-axis mesh, jax.typeof of every state leaf (shape,
  dtype, sharding) after update, eager and jitted, is its type after init (and after jit(init))."""
  mesh = jax.make_mesh((2,), ("d",))
  assert mesh.axis_types == (AxisType.Explicit,)
  specs = {"w": P("d"), "b": P()}
  params, grads = _params_and_grads(rng, 1)
  with jax.set_mesh(mesh):
    placed = [
      {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in tree.items()}
      for tree in (params, grads[0])
    ]
    params, grad = placed
    tx = entry.transformation()
    state = tx.init(params)
    at_init = jax.tree.map(jax.typeof, state)
    assert jax.tree.map(jax.typeof, jax.jit(tx.init)(params)) == at_init
    for update in (tx.update, jax.jit(tx.update)):
      _, new_state = update(grad, state, params)
      assert jax.tree.map(jax.typeof, new_state) == at_init


CHECK_FUNCTIONS = {
  "pure_init": check_pure_init,
  "jit": check_jit,
  "inject_hyperparams": check_inject_hyperparams,
  "multi_steps": check_multi_steps,
  "tree_map_params": check_tree_map_params,
  "dtypes": check_dtypes,
  "sharding": check_sharding,
}


def test_every_check_has_its_function():
  assert tuple(CHECK_FUNCTIONS) == CHECKS


@pytest.mark.parametrize("entry", _entries("pure_init"))
def test_init_is_a_pure_function_of_the_params(entry: Entry, rng):
  check_pure_init(entry, rng)


@pytest.mark.parametrize("entry", _entries("jit"))
def test_jit_update_equals_eager_update(entry: Entry, rng):
  check_jit(entry, rng)


_INJECTIONS = [
  pytest.param(
    e, i, id=e.name if not n else f"{e.name}-{'-'.join(e.more_injections[n - 1].numbers)}"
  )
  for e in ENTRIES
  if "inject_hyperparams" not in e.exclusions
  for n, i in enumerate(e.injections())
]


@pytest.mark.parametrize("entry,injection", _INJECTIONS)
def test_inject_hyperparams_on_every_numeric_argument(entry: Entry, injection: Injection, rng):
  check_inject_hyperparams(entry, rng, injection)


@pytest.mark.parametrize(
  "entry",
  [
    pytest.param(e, id=e.name)
    for e in ENTRIES
    if "multi_steps" not in e.exclusions or e.multi_steps
  ],
)
def test_multi_steps_of_two_equal_one_step_on_the_mean_gradient(entry: Entry, rng):
  check_multi_steps(entry, rng)


@pytest.mark.parametrize("entry", _entries("tree_map_params"))
def test_tree_map_params_after_init_on_another_tree(entry: Entry, rng):
  check_tree_map_params(entry, rng)


@pytest.mark.parametrize("entry", _entries("dtypes"))
def test_dtypes_of_updates_and_state(entry: Entry, rng):
  check_dtypes(entry, rng)


@pytest.mark.parametrize("entry", _entries("sharding"))
def test_state_types_unchanged_by_update_on_an_explicit_mesh(entry: Entry, rng):
  check_sharding(entry, rng)


_EXCLUDED = [
  pytest.param(e, check, id=f"{e.name}-{check}") for e in ENTRIES for check in e.exclusions
]


@pytest.mark.parametrize("entry,check", _EXCLUDED)
def test_an_excluded_check_fails_with_the_listed_error(entry: Entry, check: str, rng):
  """Each exclusion of the list still holds, with its error: once it no longer does, the
  exclusion goes and the check runs."""
  exclusion = entry.exclusions[check]
  extra = {"around": True} if check == "multi_steps" else {}
  with pytest.raises(exclusion.error, match=exclusion.match):
    CHECK_FUNCTIONS[check](entry, rng, **extra)
