"""The Mosaic GPU kernels: each equal to its jnp twin, lowered for cuda, and what they decline.

The whole step on the kernels runs in the conformance suite
(`test_conformance.py`: `TestPallasMosaicGpuInterpret` on the CPU,
`TestPallasMosaicGpuCompiled` on a Hopper GPU). Here each kernel runs in Pallas
interpret mode against `optax_lamb.backends.gpu.passes`' twins on leaves whose
slices are not whole rows of 256 (padded) nor whole blocks (a chunk's tail past
the row's end), stacked and not; interpret mode pads a window past the end
with NaN, so an element the kernels forget to mask shows up. The step is
lowered for cuda without a GPU (jax lowers Mosaic GPU kernels on any host).
"""

import functools
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.asserts import assert_trees_close
from helpers.implementations import MOSAIC_BLOCKS

import optax_lamb
from optax_lamb.backends.gpu import passes, tables
from optax_lamb.backends.pallas_mosaic_gpu import MosaicBlockSizes, PallasMosaicGpuBackend
from optax_lamb.core._options import LambOptions, StepScalars
from optax_lamb.step import _plan

# (shape, stacked axes, adapted, narrow moments)
LEAVES = [
  ((3, 300), 1, True, False),  # stacked rows of 300: padded to 512, the second chunk past 300
  ((2, 3, 100), 1, True, True),  # stacked, narrow moments: pass 2 writes them
  ((700,), 0, True, False),  # three chunks, the last past the end
  ((5,), 0, False, False),  # not adapted: pass 2 alone
  ((), 0, True, False),  # one element
]


def leaf_plans():
  plans, offset = [], 0
  for i, (shape, stacked, adapt, narrow) in enumerate(LEAVES):
    plans.append(_plan.LeafPlan(i, shape, True, adapt, stacked, None, offset, narrow))
    offset += int(np.prod(shape[:stacked]))
  return plans, offset


@pytest.mark.slow  # interpreted kernels: for their developers (CI runs them)
@pytest.mark.parametrize("apply", [False, True])
def test_kernels_equal_their_twins(apply, rng):
  plans, slots = leaf_plans()
  draw = lambda n, dtype=jnp.float32: jnp.asarray(rng.standard_normal(n), dtype)
  leaves = [
    {
      "p": draw(leaf.size),
      "g": draw(leaf.size),
      "m": 0.1 * draw(leaf.size, jnp.bfloat16 if leaf.narrow_moments else jnp.float32),
      "v": jnp.abs(draw(leaf.size, jnp.bfloat16 if leaf.narrow_moments else jnp.float32)),
    }
    for leaf in plans
  ]
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  h = StepScalars(bc1=f32(0.1), bc2=f32(0.01), weight_decay=f32(0.05), step_size=f32(-1e-2))
  options = LambOptions()
  scalars, layout = tables.scalar_operands(h)
  kernels = PallasMosaicGpuBackend(block_sizes=MOSAIC_BLOCKS).kernels(None, interpret=True)
  static = dict(options=options, scalar_layout=layout)
  launches = tables.buckets([leaf for leaf in plans if leaf.adapt], kernels.sizes)
  for table in launches:
    (c,) = table
    x = leaves[c.leaf.index]
    (written,), parts = kernels.moments_and_norms(scalars, [x], table=table, **static)
    want_moments, want_parts = passes.pass1_reference(options, h, x, c, MOSAIC_BLOCKS.block)
    assert bool(written) == (not c.leaf.narrow_moments)
    if written:
      assert_trees_close((written["m"], written["v"]), want_moments)
    assert parts.shape == want_parts.shape
    assert_trees_close(parts, want_parts)
  ratios = jnp.asarray(rng.uniform(0.5, 2.0, slots), jnp.float32)
  for table in tables.buckets(plans, kernels.sizes):
    (c,) = table
    x = {k: leaves[c.leaf.index][k] for k in passes.input_names(c.leaf)}
    (got,) = kernels.updates(scalars, ratios, [x], table=table, apply=apply, **static)
    want = passes.pass2_reference(options, h, c.leaf, x, ratios, apply=apply)
    assert set(got) == set(want)
    assert_trees_close(got, want)


def _launches(text: str) -> int:
  """The Mosaic GPU kernels a lowered step launches: its custom calls, each counted once per call of
  the private function that holds it (jax lowers the leaves of one kind to one shared function)."""
  bodies: dict[str, list[str]] = {}
  for line in text.splitlines():
    defined = re.search(r"func\.func (?:public |private )?@([\w$.]+)", line)
    if defined:
      bodies[defined.group(1)] = []
    elif bodies:
      bodies[list(bodies)[-1]].append(line)

  @functools.cache
  def count(name: str) -> int:
    lines = bodies[name]
    calls = [c for line in lines for c in re.findall(r"\bcall @([\w$.]+)\(", line) if c in bodies]
    return sum(line.count("custom_call @mosaic_gpu_v2") for line in lines) + sum(map(count, calls))

  return count("main")


def _lowered_for_cuda(fused: bool, **kwargs) -> str:
  params = {
    "w": jax.ShapeDtypeStruct((4, 300), jnp.bfloat16),
    "b": jax.ShapeDtypeStruct((7,), jnp.float32),
    "s": jax.ShapeDtypeStruct((2, 3, 5), jnp.float32),
  }
  backend = PallasMosaicGpuBackend(block_sizes=MOSAIC_BLOCKS, interpret=False)
  tx = optax_lamb.lamb(1e-2, implementation=backend, **kwargs)
  state = jax.eval_shape(tx.init, params)
  grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
  if fused:
    step = lambda g, s, p: tx.fused_apply(g, s, p)
  else:
    step = tx.update
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=r"(?i).*xla path")  # the kernels, no fallback
    return jax.jit(step).trace(grads, state, params).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_the_step_lowers_for_cuda(fused):
  """Every kernel is a Mosaic GPU custom call: pass 1 per adapted leaf, pass 2 per leaf below
  the XLA pass 2's size in tx.update."""
  kwargs = dict(
    weight_decay=0.01,
    max_grad_norm=1.0,
    mu_dtype=jnp.bfloat16,
    stacked_axes={"w": 0, "b": 0, "s": 1},
    min_trust_ratio=0.1,
  )
  text = _lowered_for_cuda(fused, **kwargs)
  names = re.findall(r"custom_call @(\w+)", text)
  assert set(names) == {"mosaic_gpu_v2"}, set(names)
  # three adapted leaves: pass 1 each; pass 2 each, but in tx.update w's 1,200 elements take
  # XLA's pass 2 (MOSAIC_BLOCKS.xla_pass2_min_size)
  assert len(names) == 3 + (3 if fused else 2), names
  kernels = set(re.findall(r"lamb_mosaic_(\w+?)_mosaic_gpu", text))
  assert kernels == {"moments_and_norms", "apply" if fused else "updates"}, kernels


def test_more_ratio_slots_than_a_tma_copy_moves_lower_for_cuda():
  """A TMA copy moves at most 256 elements along a dimension: a tree of 300 leaves and a leaf of
  300 stacked slices (each slice's ratio read from its leaf's rows of 128) still lower."""
  params = {f"w{i:03d}": jax.ShapeDtypeStruct((8,), jnp.float32) for i in range(300)}
  params["stack"] = jax.ShapeDtypeStruct((300, 8), jnp.float32)
  backend = PallasMosaicGpuBackend(block_sizes=MOSAIC_BLOCKS, interpret=False)
  stacked = {name: int(name == "stack") for name in params}
  tx = optax_lamb.lamb(1e-2, implementation=backend, stacked_axes=stacked)
  state = jax.eval_shape(tx.init, params)
  step = lambda g, s, p: tx.fused_apply(g, s, p)  # every pass 2 in a kernel
  text = jax.jit(step).trace(params, state, params).lower(lowering_platforms=("cuda",)).as_text()
  assert _launches(text) == 2 * 301
  # the 300 leaves of one kind share their two kernels, lowered once (a leaf's place in the tree,
  # its index and ratio slots, is not the kernels' business)
  assert len(re.findall(r"custom_call @mosaic_gpu_v2", text)) == 2 * 2


def test_8bit_moments_are_declined_and_run_on_xla(rng):
  params = {"w": jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)}
  grads = {"w": jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)}
  kwargs = dict(mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  backend = PallasMosaicGpuBackend(block_sizes=MOSAIC_BLOCKS, interpret=True)
  tx, xla = (optax_lamb.lamb(1e-2, implementation=i, **kwargs) for i in (backend, "xla"))
  with pytest.warns(UserWarning, match=r"8-bit quantized moments .*Mosaic GPU.* the xla path\."):
    got, _ = tx.update(grads, tx.init(params), params)
  want, _ = xla.update(grads, xla.init(params), params)
  np.testing.assert_array_equal(got["w"], want["w"])


@pytest.mark.parametrize("capability, taken", [("8.0", False), ("9.0", True), ("10.0", True)])
def test_auto_takes_it_on_hopper_and_newer(monkeypatch, capability, taken):
  device = types.SimpleNamespace(compute_capability=capability, device_kind="a GPU")
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [device])
  reason = PallasMosaicGpuBackend().device_reason()
  assert (reason is None) == taken, reason
  if not taken:
    assert "compute capability 8.0" in reason and "9.0" in reason


@pytest.mark.parametrize(
  "field, value",
  [("block", 128), ("block", 1000), ("max_concurrent_steps", 0), ("xla_pass2_min_size", -1)],
)
def test_bad_block_sizes_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"{field}={value}"):
    MosaicBlockSizes(**{field: value})
