"""Every kind of call that must fail at update, as data, for `test_failed_call_keeps_state.py`.

`FAILED_CALLS` maps an id to a `FailedCall`: how to set it up (from a seeded
NumPy generator), the error and message it must raise, and the ways it is made
(``update``, jitted ``update``, ``update_and_apply``). The cases are listed by
the error modules they belong to: bad trees and gradients
(`test_bad_trees.py`), a state from another optimizer or params
(`test_bad_state.py`), per-leaf options that do not fit (`test_bad_per_leaf_options.py`),
a bad ``grad_scale`` at update (`test_bad_arguments.py`) and a bad ``do_update`` of
``compat.onnxruntime_lamb``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import fast_compile
from helpers.implementations import lamb_for
from helpers.trees import random_like, random_tree

import optax_lamb

HOWS = ("update", "jit", "update_and_apply")


class Setup(NamedTuple):
  tx: Any  # the transformation whose call fails
  state: Any
  params: Any
  grads: Any
  kwargs: dict  # extra arguments of update (grad_scale)
  resume: Callable  # resume(state): a step of the state's own optimizer, jitted


class FailedCall(NamedTuple):
  setup: Callable[[np.random.Generator], Setup]
  error: type
  match: str
  hows: tuple = ("update",)


def invoke(how: str, tx, grads, state, params, **kwargs):
  if how == "update":
    return tx.update(grads, state, params, **kwargs)
  if how == "jit":
    return jax.jit(functools.partial(tx.update, **kwargs))(grads, state, params)
  return optax_lamb.update_and_apply(tx, grads, state, params)


def _resumer(update, grads, params):
  return lambda state: update(grads, state, params)


# ------------------------------------------------------------- bad trees and gradients

TREE_OPTIONS = {"plain": {}, "skip-master-clip": dict(skip_nonfinite=True, master_weights=True,
                                                      max_grad_norm=1.0)}  # fmt: skip
TREE_SHAPES = {"w": (4, 3), "b": (3,)}


@functools.cache
def tree_optimizer(options: str):
  """One lamb per option set, and its jitted update (compiled once for every case)."""
  tx = optax_lamb.lamb(1e-2, weight_decay=0.01, **TREE_OPTIONS[options])
  return tx, fast_compile.jit(tx.update)


def trained(rng, options: str):
  """(tx, jitted update, params, state after one step): a state that has moved."""
  tx, update = tree_optimizer(options)
  params = random_tree(rng, TREE_SHAPES)
  params["b"] = jnp.zeros(3, jnp.float32)
  _, state = update(random_like(rng, params), tx.init(params), params)
  return tx, update, params, state


def _bad_tree(options: str, bad: Callable, error, match):
  """A call with bad gradients or params: `bad(grads, params)` returns them."""

  def setup(rng):
    tx, update, params, state = trained(rng, options)
    grads, bad_params = bad(random_like(rng, params), params)
    return Setup(
      tx, state, bad_params, grads, {}, _resumer(update, random_like(rng, params), params)
    )

  return FailedCall(setup, error, match, ("update", "jit"))


BAD_TREES = {
  "int grads": (
    lambda g, p: ({**g, "w": jnp.ones((4, 3), jnp.int32)}, p),
    TypeError,
    r"updates \(gradients\)\['w'\] has dtype int32; LAMB updates floating-point",
  ),
  "bool grads": (
    lambda g, p: ({**g, "b": jnp.ones(3, bool)}, p),
    TypeError,
    r"updates \(gradients\)\['b'\] has dtype bool",
  ),
  "complex grads": (
    lambda g, p: ({**g, "w": g["w"].astype(jnp.complex64)}, p),
    TypeError,
    r"updates \(gradients\)\['w'\] has complex dtype complex64",
  ),
  "int params": (
    lambda g, p: (g, {**p, "w": jnp.ones((4, 3), jnp.int32)}),
    TypeError,
    r"params\['w'\] has dtype int32",
  ),
  "grad shape": (
    lambda g, p: ({**g, "w": jnp.ones((3, 4))}, p),
    ValueError,
    r"updates \(gradients\)\['w'\] has shape \(3, 4\) but params\['w'\] has shape \(4, 3\)",
  ),
  "broadcastable grad shape": (
    lambda g, p: ({**g, "b": jnp.ones((1, 3))}, p),
    ValueError,
    r"\['b'\] has shape \(1, 3\) but params\['b'\] has shape \(3,\)",
  ),
  "missing grad": (
    lambda g, p: ({"w": g["w"]}, p),
    ValueError,
    r"in params but not in updates \(gradients\): \[\"\['b'\]\"\]",
  ),
  "extra grad": (
    lambda g, p: ({**g, "extra": jnp.ones(2)}, p),
    ValueError,
    r"in updates \(gradients\) but not in params: \[\"\['extra'\]\"\]",
  ),
  "None grad": (
    lambda g, p: ({**g, "b": None}, p),
    ValueError,
    r"None in updates \(gradients\) but not in params: \[\"\['b'\]\"\]",
  ),
  "None param": (
    lambda g, p: (g, {**p, "b": None}),
    ValueError,
    r"None in params but not in updates \(gradients\): \[\"\['b'\]\"\]",
  ),
  "no params": (lambda g, p: (g, None), ValueError, r"lamb needs params for the trust ratio"),
}


def _grad_scale_given_twice(rng):
  _, _, params, _ = trained(rng, "plain")
  tx = optax_lamb.lamb(1e-2, grad_scale=8.0)
  grads = random_like(rng, params)
  return Setup(tx, tx.init(params), params, grads, {"grad_scale": 2.0},
               _resumer(jax.jit(tx.update), grads, params))  # fmt: skip


def _negative_grad_scale_on_another_state(rng):
  """A bad grad_scale at update, handed the state of a lamb built with one."""
  _, _, params, _ = trained(rng, "plain")
  own = optax_lamb.lamb(1e-2, grad_scale=8.0)
  grads = random_like(rng, params)
  return Setup(optax_lamb.lamb(1e-2), own.init(params), params, grads, {"grad_scale": -2.0},
               _resumer(jax.jit(own.update), grads, params))  # fmt: skip


# ------------------------------------------------------------- a bad grad_scale at update

GRAD_SCALE_OPTIONS = {"plain": {}, "skip-master": dict(skip_nonfinite=True, master_weights=True)}


def _bad_grad_scale(options: str, value):
  def setup(rng):
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.ones(3)}
    grads = random_like(rng, params)
    tx = optax_lamb.lamb(1e-2, weight_decay=0.01, **GRAD_SCALE_OPTIONS[options])
    _, state = tx.update(grads, tx.init(params), params)
    resume = lambda state: tx.update(grads, state, params, grad_scale=2.0)
    return Setup(tx, state, params, grads, {"grad_scale": value}, resume)

  error = TypeError if isinstance(value, str) else ValueError
  return FailedCall(setup, error, rf"grad_scale must be .*got grad_scale={re.escape(repr(value))}$")


# ------------------------------------------------ a bad do_update of compat.onnxruntime_lamb

BAD_DO_UPDATES = {"no": TypeError, 1 + 2j: TypeError, (True, False): ValueError}


def _bad_do_update(value, error) -> FailedCall:
  """ORT's do_update input given what is neither a bool nor a 0-d boolean or number array."""

  def setup(rng):
    tx = optax_lamb.compat.onnxruntime_lamb(1e-2, implementation="xla")
    update = jax.jit(tx.update)
    params = random_tree(rng, TREE_SHAPES)
    _, state = update(random_like(rng, params), tx.init(params), params)
    grads = random_like(rng, params)
    return Setup(tx, state, params, grads, {"do_update": value}, _resumer(update, grads, params))

  match = rf"do_update must be a bool or a .*got do_update={re.escape(repr(value))}"
  return FailedCall(setup, error, match, ("update", "jit"))


# ------------------------------------------------------------- a state that does not fit

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)


def lamb(**kwargs):
  return optax_lamb.lamb(kwargs.pop("learning_rate", 1e-2), **kwargs)


def params_of(shapes, dtype=jnp.float32):
  return {
    k: jnp.linspace(0.5, 1.5, int(np.prod(s)), dtype=dtype).reshape(s) for k, s in shapes.items()
  }


W1, W3, W4 = ({"w": (n,)} for n in (1, 3, 4))
P = functools.partial

# id: (the optimizer used, the optimizer that made the state, its params, the params used, message)
FOREIGN_STATES = {
  "shape (1,) for (4,)": (lamb, lamb, W1, W4, r"state\[1\]\.mu\['w'\] has shape \(1,\) where init\(params\) gives shape \(4,\)"),
  "shape (3,) for (4,)": (lamb, lamb, W3, W4, r"state\[1\]\.mu\['w'\] has shape \(3,\) where init\(params\) gives shape \(4,\)"),
  "shape (4, 3) for (3, 4)": (lamb, lamb, {"w": (4, 3)}, {"w": (3, 4)}, r"state\[1\]\.mu\['w'\] has shape \(4, 3\) where init\(params\) gives shape \(3, 4\)"),
  "other leaf names": (lamb, lamb, {"v": (4,)}, W4, r"state\[1\]\.mu is a dict with keys \['v'\] where init\(params\) gives a dict with keys " r"\['w'\] \(missing \[\"\['w'\]\"\]; not expected \[\"\['v'\]\"\]\)"),
  "a param added": (lamb, lamb, W4, {"w": (4,), "b": (2,)}, r"state\[1\]\.mu is a dict with keys \['w'\] where .* keys \['b', 'w'\] \(missing"),
  "state for bfloat16 params": (lamb, lamb, (W4, jnp.bfloat16), W4, r"state\[1\]\.mu\['w'\] has dtype bfloat16 where init\(params\) gives dtype float32.*mu_dtype"),
  "mu_dtype=bfloat16 state": (lamb, P(lamb, mu_dtype=jnp.bfloat16), W4, W4, r"state\[1\]\.mu\['w'\] has dtype bfloat16 where init\(params\) gives dtype float32"),
  "state without stacked_axes": (P(lamb, stacked_axes=1), lamb, {"w": (2, 3)}, {"w": (2, 3)}, r"state\[3\]\.ratios has shape \(1,\) where init\(params\) gives shape \(2,\).*stacked_axes"),
  "optax.lamb state": (lamb, optax.lamb, W4, W4, r"state is a tuple of 4 \(optax\.ScaleByAdamState, optax\.EmptyState, optax\.EmptyState, " r"optax\.EmptyState\) where init\(params\) gives a tuple of 5 \(optax\.EmptyState, " r"optax\.ScaleByAdamState, .*optax\.lamb"),
  "optax.adam state": (lamb, optax.adam, W4, W4, r"state is a tuple of 2 \(optax\.ScaleByAdamState, optax\.EmptyState\) where init\(params\) " r"gives a tuple of 5"),
  "plain state, skip_nonfinite=True": (P(lamb, skip_nonfinite=True), lamb, W4, W4, r"state is a tuple of 5 \(.*\) where init\(params\) gives optax_lamb\.SkipNonFiniteState\. " r".*skip_nonfinite"),
  "skip_nonfinite state, plain lamb": (lamb, P(lamb, skip_nonfinite=True), W4, W4, r"state is optax_lamb\.SkipNonFiniteState where init\(params\) gives a tuple of 5"),
  "plain state, master_weights=True": (P(lamb, master_weights=True), lamb, W4, W4, r"state is a tuple of 5 \(.*\) where init\(params\) gives optax_lamb\.MasterWeightsState"),
  "float learning rate state, schedule": (P(lamb, learning_rate=SCHEDULE), lamb, W4, W4, r"state\[4\] is optax\.EmptyState where init\(params\) gives optax\.ScaleByScheduleState.*" r"learning_rate or weight_decay schedule"),
  "schedule learning rate state, float": (lamb, P(lamb, learning_rate=SCHEDULE), W4, W4, r"state\[4\] is optax\.ScaleByScheduleState where init\(params\) gives optax\.EmptyState"),
  "float weight decay state, schedule": ( P(lamb, weight_decay=SCHEDULE), P(lamb, weight_decay=0.01), W4, W4, r"state\[2\] is optax\.EmptyState where init\(params\) gives optax\.ScaleByScheduleState"),
  "no grad_scale state, grad_scale schedule": (P(lamb, grad_scale=lambda count: 2.0), lamb, W4, W4, r"state is a tuple of 5 \(.*\) where init\(params\) gives a tuple of 2 " r"\(optax_lamb\.UnscaleGradientsState, tuple\)"),
  "weight-decay mask state, no mask": ( P(lamb, weight_decay=0.01), P(lamb, weight_decay=0.01, mask={"w": True}), W4, W4, r"state\[2\] is optax\.MaskedState where init\(params\) gives optax\.EmptyState.*mask"),
  "skip_nonfinite state for other shapes": ( P(lamb, skip_nonfinite=True), P(lamb, skip_nonfinite=True), W1, W4, r"state\.inner_state\[1\]\.mu\['w'\] has shape \(1,\) where init\(params\) gives shape \(4,\)"),
  "master weights for other shapes": ( P(lamb, master_weights=True), P(lamb, master_weights=True), W3, W4, r"state\.master\['w'\] has shape \(3,\) where init\(params\) gives shape \(4,\)"),
}  # fmt: skip


def _params(spec):
  return params_of(*spec) if isinstance(spec, tuple) else params_of(spec)


@functools.cache
def foreign_state(case: str):
  """(used tx, state, params used, own params, own jitted update); built once."""
  used, own, own_shapes, shapes, _ = FOREIGN_STATES[case]
  own_tx = own(1e-2) if own in (optax.lamb, optax.adam) else own()
  own_params = _params(own_shapes)
  return used(), own_tx.init(own_params), _params(shapes), own_params, jax.jit(own_tx.update)


def _foreign_state(case: str) -> FailedCall:
  def setup(rng):
    tx, state, params, own_params, own_update = foreign_state(case)
    ones = jax.tree.map(jnp.ones_like, own_params)
    resume = _resumer(own_update, ones, own_params)
    return Setup(tx, state, params, jax.tree.map(jnp.ones_like, params), {}, resume)

  message = r"^lamb: the optimizer state does not fit .*" + FOREIGN_STATES[case][-1]
  return FailedCall(setup, ValueError, message, HOWS)


# ------------------------------------------------------------- per-leaf options that do not fit

PER_LEAF_OPTIONS = {"mask": True, "trust_ratio_mask": True, "stacked_axes": 1}
GOOD_PER_LEAF = {  # a full tree for each option; the bad ones are made from it
  "mask": {"w": True, "b": {"c": False}},
  "trust_ratio_mask": {"w": True, "b": {"c": False}},
  "stacked_axes": {"w": 1, "b": {"c": 0}},
}
PER_LEAF_SHAPES = {"w": (2, 4, 3), "b": {"c": (3,)}}


def per_leaf_params():
  return random_tree(np.random.default_rng(0), PER_LEAF_SHAPES)


def per_leaf_grads(seed: int):
  return random_like(np.random.default_rng(seed), per_leaf_params())


def build_per_leaf(name: str, option, implementation: str = "xla"):
  return lamb_for(implementation)(1e-2, weight_decay=0.1, **{name: option})


def bad_per_leaf_trees(v):
  """(id, option tree that is not a prefix of the params, the paths the error must list)."""
  return [
    ("missing", {"w": v}, "in params but not in {name}: [\"['b']['c']\"]"),
    ("extra", {"w": v, "b": v, "x": v}, "in {name} but not in params: [\"['x']\"]"),
    ("deeper", {"w": {"k": v}, "b": v}, "in {name} but not in params: [\"['w']['k']\"]"),
    (
      "list",
      [v, v],
      "in {name} but not in params: ['[0]', '[1]']; "
      "in params but not in {name}: [\"['b']['c']\", \"['w']\"]",
    ),
  ]


def per_leaf_message(name: str, tree, paths: str) -> str:
  return "^" + re.escape(
    f"{name} must be a pytree prefix of the params (or a callable(params) returning one): "
    f"params structure {jax.tree.structure(per_leaf_params())}, {name} structure "
    f"{jax.tree.structure(tree)}; " + paths.format(name=name)
  )


def as_form(form: str, tree):
  return (lambda params: tree) if form == "callable" else tree


BAD_PER_LEAF = {
  f"{name}-{form}-{tree_id}": (name, form, tree, paths)
  for name, v in PER_LEAF_OPTIONS.items()
  for tree_id, tree, paths in bad_per_leaf_trees(v)
  for form in ("tree", "callable")
}


def _bad_per_leaf(case: str, implementation: str) -> FailedCall:
  """A state from an optimizer with a good option, updated by one with a bad option."""
  name, form, tree, paths = BAD_PER_LEAF[case]

  def setup(rng):
    params = per_leaf_params()
    good = build_per_leaf(name, GOOD_PER_LEAF[name], implementation)
    _, state = good.update(per_leaf_grads(1), good.init(params), params)
    bad = build_per_leaf(name, as_form(form, tree), implementation)
    resume = _resumer(good.update, per_leaf_grads(2), params)
    return Setup(bad, state, params, per_leaf_grads(2), {}, resume)

  return FailedCall(setup, ValueError, per_leaf_message(name, tree, paths))


FAILED_CALLS = {
  **{f"tree {case} ({options})": _bad_tree(options, *BAD_TREES[case])
     for case in BAD_TREES for options in TREE_OPTIONS},
  "grad_scale given twice": FailedCall(_grad_scale_given_twice, ValueError,
                                       r"grad_scale was given both when building .* grad_scale=2.0"),
  "negative grad_scale at update": FailedCall(
    _negative_grad_scale_on_another_state, ValueError,
    r"grad_scale must be a finite number > 0, got grad_scale=-2.0"),
  **{f"grad_scale={value!r} at update ({options})": _bad_grad_scale(options, value)
     for value in (float("nan"), float("inf"), 0.0, "2") for options in GRAD_SCALE_OPTIONS},
  **{f"do_update={value!r}": _bad_do_update(value, error)
     for value, error in BAD_DO_UPDATES.items()},
  **{f"state: {case}": _foreign_state(case) for case in FOREIGN_STATES},
  **{f"per-leaf {case} ({impl})": _bad_per_leaf(case, impl)
     for case in BAD_PER_LEAF for impl in ("xla", "reference")},
}  # fmt: skip
