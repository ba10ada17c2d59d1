"""Norms right for every finite float32 input: leaves and gradients whose squares overflow
(near 1e19 and above) or underflow (near 1e-19 and below) in float32, against the float64 NumPy
LAMB, on every implementation; the common path's sums stay plain (`_norms`: scaled sums only
where a plain one over- or underflowed; the Pallas kernels add them in the same pass)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.implementations import lamb_for
from helpers.jaxprs import reductions
from helpers.lamb_reference import NumpyLamb

import optax_lamb
from optax_lamb.core import _ratios

IMPLEMENTATIONS = ("xla", "xla-one-device", "xla-large-tree", "reference", "pallas")
RTOL = 1e-5  # float32 steps against float64 (the README's promise between implementations)
# A leaf's magnitude: under- and overflowing squares, and an ordinary one.
SCALES = [1e-30, 1e-19, 1.0, 1e20, 1e30]


def _problem(rng, scale):
  params = {"odd": scale * rng.normal(size=(6, 40)), "plain": rng.normal(size=(300,))}
  grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
  return params, grads


def _assert_close_per_leaf(got, want):
  for name, value in want.items():
    scale = np.max(np.abs(value))
    np.testing.assert_allclose(
      np.asarray(got[name], np.float64), value, rtol=0, atol=RTOL * scale, err_msg=name
    )


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_params_of_any_magnitude_get_lambs_step(implementation, scale, rng):
  params, grads = _problem(rng, scale)
  kwargs = dict(learning_rate=1e-2, weight_decay=0.01)
  tx = lamb_for(implementation)(**kwargs)
  as_f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)  # noqa: E731
  p32 = as_f32(params)
  updates, state = jax.jit(tx.update)(as_f32(grads), tx.init(p32), p32)
  want = NumpyLamb(**kwargs).step(jax.tree.map(lambda x: np.asarray(x, np.float64), p32), grads)
  got = optax.apply_updates(jax.tree.map(lambda x: x.astype(jnp.float64), p32), updates)
  _assert_close_per_leaf(got, want)
  ratio = optax_lamb.trust_ratios(state)["odd"]
  assert np.isfinite(ratio) and (scale == 1.0 or ratio != 1.0)  # not the zero-norm rule


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_clipping_gradients_near_1e20_gives_the_clipped_step(implementation, rng):
  """||g|| overflows in float32: the clip must still bring g to norm 1 (not to zero)."""
  params, grads = _problem(rng, 1.0)
  as_f32 = lambda tree, s=1.0: jax.tree.map(lambda x: jnp.asarray(s * x, jnp.float32), tree)  # noqa: E731
  tx = lamb_for(implementation)(1e-2, max_grad_norm=1.0)
  state = tx.init(as_f32(params))
  huge, _ = jax.jit(tx.update)(as_f32(grads, 1e20), state, as_f32(params))
  ordinary, _ = jax.jit(tx.update)(as_f32(grads), state, as_f32(params))
  _assert_close_per_leaf(huge, jax.tree.map(lambda x: np.asarray(x, np.float64), ordinary))
  assert float(optax.tree.norm(huge)) > 0


def test_clip_by_global_norm_of_gradients_near_1e20_has_norm_one(rng, device_count_seen):
  grads = {
    "a": jnp.asarray(1e20 * rng.normal(size=(51,)), jnp.float32),  # odd: halves and a last one
    "b": jnp.full((3,), 3e20),
    "c": jnp.asarray(1e20 * rng.normal(size=(7, 300)), jnp.float32),
  }
  tx = optax_lamb.clip_by_global_norm(1.0)
  clipped, _ = tx.update(grads, tx.init(grads))
  norm = np.sqrt(
    sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(clipped))
  )
  np.testing.assert_allclose(norm, 1.0, rtol=1e-6)


def test_the_cpus_clipping_norm_sums_each_gradient_in_one_place(monkeypatch):
  """On the CPU the clipping norm's rescue (the sums at 2^-80 after an overflow, tested above)
  is a second run of the plain sums' loop, not a copy of them in a conditional's branch, which
  XLA:CPU compiles again (benchmarks/NOTES.md, 2026-12-03): one reduction per leaf, in a loop."""
  monkeypatch.setattr(_ratios, "PLATFORM_BRANCH", "cpu")  # both keys of platform_dependent
  n = _ratios.BLOCKED_FROM  # leaves summed by one plain reduction each
  grads = {"a": jnp.ones((n,)), "b": jnp.ones((3, n)), "c": jnp.ones((2, n // 2 + 1))}
  tx = optax_lamb.clip_by_global_norm(1.0)
  jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(grads)).jaxpr
  loops, inside, outside = reductions(jaxpr)
  assert loops >= 1 and inside == loops * len(grads) and outside == 0, (loops, inside, outside)


def test_sharded_leaves_in_shard_map_get_the_unsharded_step(rng):
  """A tiny leaf and gradients near 1e20, each leaf split over 8 devices (axis_name): the
  rescaled norms take their max and sum over the devices."""
  import dp_problem
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  params = {"tiny": f32(1e-19 * rng.normal(size=(64,))), "plain": f32(rng.normal(size=(64,)))}
  grads = {k: f32(1e20 * rng.normal(size=(64,))) for k in params}
  kwargs = dict(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0)
  reference = lamb_for("reference")(**kwargs)
  want, _ = jax.jit(reference.update)(grads, reference.init(params), params)
  tx = lamb_for("reference")(**kwargs, axis_name="d")
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  specs = {k: P("d") for k in params}
  state_specs = dp_problem.state_shardings(tx, tx.init(params), params, specs, P())
  step = jax.jit(
    jax.shard_map(
      tx.update, mesh=mesh, in_specs=(specs, state_specs, specs), out_specs=(specs, state_specs)
    )
  )
  put = lambda t, s: jax.tree.map(lambda v, sp: jax.device_put(v, NamedSharding(mesh, sp)), t, s)  # noqa: E731
  got, _ = step(put(grads, specs), put(tx.init(params), state_specs), put(params, specs))
  _assert_close_per_leaf(got, jax.tree.map(lambda x: np.asarray(x, np.float64), want))
  assert float(np.max(np.abs(np.asarray(got["tiny"])))) > 0
