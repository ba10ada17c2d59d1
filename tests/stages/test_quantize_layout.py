"""The layout of a quantized moment leaf (optax_lamb.core._quantize): blocks per stacked slice and
per shard, which leaves are quantized, the checks of dequantize, and checkpointing.

The values themselves are checked against the float64 reference in test_quantize.py.
"""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import quantize_reference as ref
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_lamb.core import _quantize as q
from optax_lamb.core._moment_storage import quantizes

SIGNS = [True, False]
quantize = jax.jit(q.quantize, static_argnames=("signed", "block_size"))


@pytest.mark.parametrize("signed", SIGNS)
def test_stacked_layers_get_blocks_per_slice(signed, rng) -> None:
  x = ref.moment_like(rng, (2, 3, 4, 600), signed)
  codes, scales = quantize(jnp.asarray(x), signed=signed)
  assert scales.shape == (2, 3, 4, 3)
  for i in np.ndindex(2, 3):
    one = quantize(jnp.asarray(x[i]), signed=signed)
    np.testing.assert_array_equal(one.codes, codes[i])
    np.testing.assert_array_equal(one.scales, scales[i])


@pytest.mark.parametrize(
  ("shape", "spec"), [((8, 1024), P(None, "x")), ((8, 600), P("x", None)), ((4, 2, 512), P("x"))]
)
def test_shards_with_whole_blocks_quantize_like_the_whole_leaf(shape, spec, rng) -> None:
  """Each device quantizes its own shard (shard_map); with whole blocks (the last axis split in
  multiples of 256) the result is the whole leaf's, and the scales shard like the codes."""
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  x = jax.device_put(ref.moment_like(rng, shape, signed=True), NamedSharding(mesh, spec))
  local = jax.shard_map(
    lambda a: tuple(q.quantize(a, True)), mesh=mesh, in_specs=spec, out_specs=(spec, spec)
  )
  codes, scales = jax.jit(local)(x)
  whole = quantize(x, signed=True)
  np.testing.assert_array_equal(codes, whole.codes)
  np.testing.assert_array_equal(scales, whole.scales)


def test_which_leaves_are_quantized() -> None:
  assert not quantizes(())
  assert not quantizes((4095,)) and quantizes((4096,))
  assert not quantizes((8192, 1))  # 5 bytes an element: more than float32
  assert quantizes((4096, 2)) and quantizes((64, 64)) and quantizes((12, 768, 3072))
  assert q.scales_shape((12, 768, 3072)) == (12, 768, 12)
  assert q.scales_shape((5, 257), block_size=128) == (5, 3)
  with pytest.raises(ValueError, match="0-d"):
    q.quantize(jnp.float32(1.0), True)


def test_dequantize_checks_dtype_and_layout() -> None:
  codes, scales = quantize(jnp.ones((2, 300)), signed=True)
  with pytest.raises(ValueError, match="do not match"):
    q.dequantize(codes, scales, False)
  with pytest.raises(ValueError, match="do not match"):
    q.dequantize(codes, scales, True, block_size=128)


def test_quantized_moment_is_a_plain_pytree_and_serializes(tmp_path) -> None:
  moment = q.quantize(jnp.linspace(-1.0, 2.0, 600).reshape(2, 300), True)
  assert len(jax.tree.leaves(moment)) == 2
  state = {"mu": {"w": moment}, "nu": {"w": q.quantize(jnp.ones((2, 300)), False)}}
  target = jax.tree.map(jnp.zeros_like, state)
  restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(state))
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  assert isinstance(restored["mu"]["w"], q.QuantizedMoment)
  ocp = pytest.importorskip("orbax.checkpoint")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    back = checkpointer.restore(tmp_path / "state", target)
  jax.tree.map(np.testing.assert_array_equal, back, state)
  assert back["nu"]["w"].codes.dtype == np.uint8 and back["mu"]["w"].codes.dtype == np.int8
