"""8-bit quantized moments across devices and checkpoints (the 8 CPU devices of conftest).

* Under ``jax.jit`` over sharded params (blocks whole in every shard: leading axes split,
  or a last axis split into multiples of 256; or straddling shards, where XLA's partitioner
  moves what a block needs), the codes and scales equal the
  single-device step's bit for bit (the moments do not depend on the reductions), the
  updates and trust ratios to rtol 1e-5 (the norms are summed per shard); ``init`` gives
  the codes the params' shardings and the scales the same split where their blocks divide.
* An orbax checkpoint of the state restores bit-identically, onto the same or another
  sharding (the layout depends on the params' shapes only), and training resumes bit-identically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers.asserts import assert_trees_equal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb
from optax_lamb.core._quantize import QuantizedMoment

SHAPES = {"w": (16, 512), "wide": (4, 4096), "stack": (8, 4, 256), "emb": (4096,), "b": (32,)}
STACKED = {"w": 0, "wide": 0, "stack": 1, "emb": 0, "b": 0}
SPECS = {  # blocks whole in every shard: "wide" splits its last axis into 512 columns a device
  "w": P("data", None), "wide": P(None, "data"), "stack": P("data"), "emb": P("data"), "b": P(),
}  # fmt: skip
STRADDLING = {  # blocks across shards: 64 and 32 columns a device (XLA moves what a block needs)
  "w": P(None, "data"), "wide": P(None, "data"), "stack": P(None, None, "data"), "emb": P("data"),
  "b": P(),
}  # fmt: skip
OTHER_SPECS = {"w": P(None, "data"), "wide": P(), "stack": P(), "emb": P(), "b": P()}


def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def arrays(rng, scale=1.0):
  return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in SHAPES.items()}


def put(tree, specs, m):
  return {k: jax.device_put(x, NamedSharding(m, specs[k])) for k, x in tree.items()}


def lamb(implementation="xla", **kwargs):
  kwargs = {"max_grad_norm": 1.0, **kwargs}
  return optax_lamb.lamb(
    1e-2, weight_decay=0.01, mask={k: k != "b" for k in SHAPES}, stacked_axes=STACKED,
    mu_dtype=jnp.int8, nu_dtype=jnp.uint8, implementation=implementation, **kwargs,
  )  # fmt: skip


@pytest.mark.slow  # 12-16 s a case (8 devices' compiles), CI runs it
@pytest.mark.parametrize("layout", ["whole-blocks", "straddling"])
@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_sharded_update_stores_the_single_device_codes(implementation, layout, rng):
  # No clipping: its scale is a global sum, summed per shard under sharding, so the clipped
  # gradient (and every moment) may differ from one device's in the last bit (seen on an AMD
  # EPYC at 69e62e3: 21 of the 32 float32 elements of "b"'s first moment, 1 ulp).
  m, tx = mesh(), lamb(implementation, max_grad_norm=None)
  specs = SPECS if layout == "whole-blocks" else STRADDLING
  params = arrays(rng)
  seq = [arrays(rng, 10.0**e) for e in (-2, 0, 1)]
  step = jax.jit(tx.update)
  state, local_state = tx.init(put(params, specs, m)), tx.init(params)
  for k, shape in SHAPES.items():
    mu = state[1].mu[k]
    if isinstance(mu, QuantizedMoment):
      assert mu.codes.sharding.is_equivalent_to(NamedSharding(m, specs[k]), len(shape)), k
      assert len(mu.scales.sharding.device_set) == 8, k
  for g in seq:
    updates, state = step(put(g, specs, m), state, put(params, specs, m))
    local, local_state = step(g, local_state, params)
    jax.tree.map(np.testing.assert_array_equal, state[1], local_state[1])  # codes, scales, count
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), updates, local
    )
    np.testing.assert_allclose(state[3].ratios, local_state[3].ratios, rtol=1e-5)
    for k in SHAPES:
      assert updates[k].sharding.is_equivalent_to(NamedSharding(m, specs[k]), updates[k].ndim), k
      mu = state[1].mu[k]
      codes = mu.codes if isinstance(mu, QuantizedMoment) else mu
      assert codes.sharding.is_equivalent_to(NamedSharding(m, specs[k]), codes.ndim), k
    params = jax.tree.map(lambda p, u: p + u, params, local)


def restore(path, tree, template):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
    template,
  )
  return checkpointer.restore(path, target)


@pytest.mark.parametrize(  # skip_nonfinite: 8 s, CI runs it (-m slow)
  "skip_nonfinite",
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["plain", "skip_nonfinite"],
)
def test_orbax_round_trip_and_bit_identical_resume(skip_nonfinite, tmp_path, rng):
  tx = lamb(skip_nonfinite=skip_nonfinite)
  step = jax.jit(tx.update)
  params = arrays(rng)
  seq = [arrays(rng, 10.0 ** rng.uniform(-2, 1)) for _ in range(6)]
  seq[2]["w"] = seq[2]["w"].at[0, 0].set(jnp.nan if skip_nonfinite else 1.0)

  def train(p, s, gs):
    for g in gs:
      u, s = step(g, s, p)
      p = optax.apply_updates(p, u)
    return p, s

  p_full, s_full = train(params, tx.init(params), seq)
  p_mid, s_mid = train(params, tx.init(params), seq[:3])
  s_back, p_back = restore(tmp_path / "ckpt", (s_mid, p_mid), (tx.init(params), params))
  assert_trees_equal((s_back, p_back), (s_mid, p_mid))
  p_resumed, s_resumed = train(p_back, s_back, seq[3:])
  assert_trees_equal(p_resumed, p_full)
  assert_trees_equal(s_resumed, s_full)


def test_a_checkpoint_restores_onto_another_sharding(tmp_path, rng):
  m, tx = mesh(), lamb()
  params = put(arrays(rng), SPECS, m)
  _, state = jax.jit(tx.update)(put(arrays(rng), SPECS, m), tx.init(params), params)
  other = tx.init(put(arrays(rng), OTHER_SPECS, m))  # the layout of the shapes, another split
  restored = restore(tmp_path / "ckpt", state, other)
  assert_trees_equal(restored, state)
  for k in ("w", "wide"):  # "w" in 64-column pieces: the data restores, blocks straddle shards
    assert restored[1].mu[k].codes.sharding.is_equivalent_to(NamedSharding(m, OTHER_SPECS[k]), 2)
