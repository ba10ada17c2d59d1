"""The XLA path's norms of 8-bit leaves from a loop over row chunks (`optax_lamb.backends.xla._chunked_sums`).

Held to the same step without the loop (the plain reduction over the whole leaf): the codes and
scales bit for bit (the moments do not depend on the norms), the updates and trust ratios to a
few float32 roundings (the same terms summed in another order). Chunks of 1,500 elements (at
most 1/32 of a leaf) run several iterations on these shapes, and a tail chunk where the rows do
not divide. `auto`'s rule: on one CPU device (joint small sums), not on other backends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb
from optax_lamb.backends.xla import XlaBackend, _chunked_sums

EPS32 = float(np.finfo(np.float32).eps)
SHAPES = {
  "w": (24, 300),  # a row a chunk: 24 iterations
  "tail": (1000, 16),  # 31 rows a chunk: 32 iterations and a tail of 8 rows
  "stack": (3, 8, 256),  # stacked (stacked_axes 1): the three slices' rows together
  "cube": (4, 8, 200),  # rows are the first two axes
  "emb": (5000,),  # 1-D: the plain reduction
  "b": (7,),  # float32 moments
}
STACKED = {k: int(k == "stack") for k in SHAPES}


def tree(rng, scale=1.0):
  return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in SHAPES.items()}


def lamb(backend, **kwargs):
  kwargs = {"mu_dtype": jnp.int8, "nu_dtype": jnp.uint8, **kwargs}
  return optax_lamb.lamb(
    1e-2, weight_decay=0.01, mask={k: k != "b" for k in SHAPES}, stacked_axes=STACKED,
    implementation=backend, **kwargs,
  )  # fmt: skip


def loops(backend, fused=False, platform="cpu", **kwargs) -> int:
  """The while loops in one step of `lamb(backend)`, as lowered for `platform` (nothing
  compiled)."""
  tx = lamb(backend, **kwargs)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  state = jax.eval_shape(tx.init, params)
  if fused:
    step = lambda g, s, p: optax_lamb.update_and_apply(tx, g, s, p)
  else:
    step = tx.update
  lowered = jax.jit(step).trace(params, state, params).lower(lowering_platforms=(platform,))
  return lowered.as_text().count("stablehlo.while")


@pytest.mark.parametrize(  # skip_nonfinite: 16 s, CI runs it (-m slow)
  "skip_nonfinite",
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["plain", "skip_nonfinite"],
)
def test_chunked_sums_give_the_plain_reductions_step(skip_nonfinite, rng):
  chunked = lamb(XlaBackend(chunked_sums=1500), skip_nonfinite=skip_nonfinite)
  plain = lamb(XlaBackend(chunked_sums=0), skip_nonfinite=skip_nonfinite)
  params = tree(rng)
  state = plain.init(params)
  for e in (-3, 0, 1):
    grads = tree(rng, 10.0**e)
    (u, s), (u_ref, s_ref) = (jax.jit(tx.update)(grads, state, params) for tx in (chunked, plain))
    jax.tree.map(np.testing.assert_array_equal, s[1], s_ref[1])  # codes, scales, count
    for k in SHAPES:
      atol = 8 * EPS32 * float(jnp.max(jnp.abs(u_ref[k])))
      np.testing.assert_allclose(u[k], u_ref[k], rtol=8 * EPS32, atol=atol, err_msg=k)
    ratios, ratios_ref = (optax_lamb.trust_ratios(x) for x in (s, s_ref))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=8 * EPS32), ratios, ratios_ref)
    state, params = s_ref, optax.apply_updates(params, u_ref)


@pytest.mark.parametrize(
  ("param_scale", "grad_scale"),
  [(1e20, 1.0), (1e-20, 1e-26)],
  ids=["params' squares overflow", "params' and updates' squares underflow"],
)
def test_the_loops_second_run_rescues_the_sums_as_the_plain_step_does(param_scale, grad_scale, rng):
  """Where a plain sum over- or underflows float32, the loop runs again at the rescue scale
  (`_chunked_sums.plain_then_rescued`) and the step equals the one whose rescue branch sums the
  whole leaf: the same ratios and updates to a few roundings. Without that second run the
  params' norms would be infinite (ratios not finite), and subnormal squares would be lost."""
  chunked, plain = lamb(XlaBackend(chunked_sums=1500)), lamb(XlaBackend(chunked_sums=0))
  params = tree(rng)
  state = plain.init(params)
  for scale in (1.0, param_scale):  # the params scaled in the second step
    params = jax.tree.map(lambda p, scale=scale: p * scale, params)
    grads = tree(rng, grad_scale)
    (u, s), (u_ref, s_ref) = (jax.jit(tx.update)(grads, state, params) for tx in (chunked, plain))
    ratios, ratios_ref = (optax_lamb.trust_ratios(x) for x in (s, s_ref))
    for k in SHAPES:
      assert np.all(np.isfinite(ratios_ref[k])), k
      np.testing.assert_allclose(ratios[k], ratios_ref[k], rtol=8 * EPS32, err_msg=k)
      atol = 8 * EPS32 * float(jnp.max(jnp.abs(u_ref[k])))
      np.testing.assert_allclose(u[k], u_ref[k], rtol=8 * EPS32, atol=atol, err_msg=k)
    state = s_ref


def test_8bit_leaves_of_two_axes_or_more_take_the_loop():
  """Two nested loops per such leaf (either moment 8-bit): its runs (plain, then rescued only
  where suspect) and the chunks; 1-D, empty and float32 leaves, or 0, none."""
  assert _chunked_sums.applies((1000, 16), 0) and _chunked_sums.applies((3, 8, 256), 1)
  assert not _chunked_sums.applies((5000,), 0) and not _chunked_sums.applies((3, 256), 1)
  assert not _chunked_sums.applies((0, 16), 0)
  assert loops(XlaBackend(chunked_sums=1500)) == 2 * 4  # w, tail, stack, cube
  assert loops(XlaBackend(chunked_sums=0)) == 0
  assert loops(XlaBackend(chunked_sums=1500), mu_dtype=jnp.float32) == 2 * 4  # one moment 8-bit


def test_on_one_cpu_device_auto_chunks_the_8bit_leaves():
  """The rule `XlaBackend.chunked_sums=None` applies: with joint small sums (one device, no
  mesh) in the program for a CPU; not for float32 moments, nor in a GPU's (one trace serves
  both: `_ratios.per_platform`)."""
  one_device = XlaBackend(joint_small_sums=True)
  assert loops(one_device) == 2 * 4
  assert loops(one_device, fused=True) == 2 * 4
  assert loops(XlaBackend(joint_small_sums=False)) == 0  # several devices: a mesh may shard
  assert loops(one_device, mu_dtype=jnp.float32, nu_dtype=jnp.float32) == 0
  assert loops(one_device, platform="cuda") == 0
