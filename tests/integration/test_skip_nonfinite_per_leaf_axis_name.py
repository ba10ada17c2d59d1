"""skip_nonfinite(check_results=True) with a per-leaf axis_name (a pytree prefix of the params, or
a callable returning one) runs under shard_map and pmap, and equals the unsharded step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.two_leaves import assert_close

import optax_lamb

_PER_LEAF_AXES = {"w": "d", "b": None}


# The per-leaf axis_name as a pytree prefix of the params, and as a callable(params).
AXIS_FORMS = {"pytree": _PER_LEAF_AXES, "callable": lambda params: _PER_LEAF_AXES}


def _sharded_inputs(n: int):
  rng = np.random.default_rng(3)
  params = {
    "w": jnp.asarray(rng.normal(size=(2 * n, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
  }
  grads = {
    "w": jnp.asarray(rng.normal(size=(2 * n, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
  }
  return params, grads


def _skip_wrapped(form: str):
  axis_name = AXIS_FORMS[form]
  inner = optax_lamb.lamb(1e-2, axis_name=axis_name)
  return optax_lamb.skip_nonfinite(inner, axis_name=axis_name, check_results=True)


@pytest.mark.parametrize("form", sorted(AXIS_FORMS))
def test_skip_nonfinite_per_leaf_axis_name_check_results_in_shard_map(form):
  """skip_nonfinite with a per-leaf axis_name ({"w": "d", "b": None}, or a callable
  returning it) and check_results=True runs inside shard_map, and equals the unsharded step."""
  from jax.sharding import PartitionSpec as P

  n = 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("d",))
  params, grads = _sharded_inputs(n)
  tx = _skip_wrapped(form)
  spec = {"w": P("d"), "b": P()}

  def body(g, p):
    updates, state = tx.update(g, tx.init(p), p)
    return updates, optax_lamb.skip_counts(state).total

  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, P()), check_vma=False)
  )
  updates, skipped = step(grads, params)
  full = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), check_results=True)
  want, _ = full.update(grads, full.init(params), params)
  assert int(skipped) == 0
  assert_close(updates, want)


@pytest.mark.parametrize("form", sorted(AXIS_FORMS))
def test_skip_nonfinite_per_leaf_axis_name_check_results_in_pmap(form):
  """The same under pmap, "w" sharded over the mapped axis, "b" replicated."""
  n = 4
  params, grads = _sharded_inputs(n)
  tx = _skip_wrapped(form)

  def split(tree):
    return {"w": tree["w"].reshape(n, 2, 3), "b": jnp.broadcast_to(tree["b"], (n, 3))}

  @functools.partial(jax.pmap, axis_name="d", devices=jax.devices()[:n])
  def step(g, p):
    updates, state = tx.update(g, tx.init(p), p)
    return updates, optax_lamb.skip_counts(state).total

  updates, skipped = step(split(grads), split(params))
  full = optax_lamb.skip_nonfinite(optax_lamb.lamb(1e-2), check_results=True)
  want, _ = full.update(grads, full.init(params), params)
  assert np.all(np.asarray(skipped) == 0)
  assert_close({"w": updates["w"].reshape(2 * n, 3), "b": updates["b"][0]}, want)
