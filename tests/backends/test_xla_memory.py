"""The XLA path in memory: update_and_apply for other transformations, no param-sized temporary.

A donated step writes params and moments in place and keeps u out of memory
for a big leaf (read from the compiled executable's memory analysis and HLO).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.options import LR
from helpers.trees import make_grads, make_params

import optax_lamb


def run(tx, params, grads_per_step, *, fused_apply=False):
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    if fused_apply:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for grads in grads_per_step:
    params, state = step(params, state, grads)
  return params, state


def test_update_and_apply_falls_back_exactly_for_other_transformations():
  params = make_params()
  tx = optax.adam(1e-2)
  p1, s1 = run(tx, params, [make_grads(params, t) for t in range(3)])
  p2, s2 = run(tx, params, [make_grads(params, t) for t in range(3)], fused_apply=True)
  jax.tree.map(np.testing.assert_array_equal, (p1, s1), (p2, s2))
  # a reference-implementation lamb also takes the fallback
  tx = optax_lamb.lamb(1e-2, implementation="reference")
  state = tx.init(params)
  grads = make_grads(params, 0)
  u, s_a = tx.update(grads, state, params)
  p_b, s_b = optax_lamb.update_and_apply(tx, grads, state, params)
  jax.tree.map(np.testing.assert_array_equal, optax.apply_updates(params, u), p_b)


def _donated_step(tx, fused_apply):
  def step(params, state, grads):
    if fused_apply:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1, 2))


@pytest.mark.parametrize("fused_apply", [False, True])
def test_donated_step_has_no_param_sized_temporary(fused_apply):
  shapes = [(1024, 512), (512, 1024), (768, 768), (1024,), (256,), (4, 512, 256), (300, 200)]
  keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
  params = {
    f"p{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
  }
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  temps = {}
  for name, tx in [
    ("ours", optax_lamb.lamb(LR, weight_decay=0.01)),
    ("optax", optax.lamb(LR, weight_decay=0.01)),
  ]:
    state = tx.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # grads cannot be reused for the outputs
      compiled = (
        _donated_step(tx, fused_apply and name == "ours").lower(params, state, params).compile()
      )
    memory = compiled.memory_analysis()
    temps[name] = memory.temp_size_in_bytes
    if name == "ours":
      # params and state are updated in place: every output aliases a donated input
      assert memory.alias_size_in_bytes >= 3 * param_bytes
  assert temps["ours"] < param_bytes / 4, temps
  assert temps["ours"] <= temps["optax"], temps


def test_fused_hlo_keeps_u_out_of_memory():
  """No param-sized array other than the moments and the new params is written for a big leaf."""
  params = {"w": jnp.ones((512, 1024))}
  tx = optax_lamb.lamb(LR, weight_decay=0.01)
  state = tx.init(params)
  step = _donated_step(tx, True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hlo = step.lower(params, state, params).compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :]
  big_fusions = [
    line
    for line in entry.splitlines()
    if " fusion(" in line and line.split("=")[1].strip().startswith("f32[512,1024]")
  ]
  # m, v and p: one loop fusion each (g is read by the first two)
  assert len(big_fusions) == 3, "\n".join(big_fusions)
