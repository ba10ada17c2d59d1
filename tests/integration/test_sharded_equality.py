"""Which equality with one device a step under ``jax.jit`` on 8 devices keeps (docs/data_parallel.md).

Every sum a step takes (a leaf's ||p|| and ||u||, the global clipping norm) is a float32 sum.
Where each device computes it whole, the sharded step is the one-device step bit for bit:
replicated leaves, and without ``max_grad_norm`` a stacked leaf sharded on its layer axis (each
layer's norms on one device). A sum split across devices adds the same terms in another order:
the norms of a leaf sharded inside its slices, and the global clipping norm as soon as any leaf
is sharded, even on its layer axis. The clip factor then differs in its last bits, and with it
every leaf's update and moments: equal to rtol 1e-5, not bit for bit.

Each case runs lamb with master weights, ``skip_nonfinite`` and ``stacked_axes`` (clipping as
named) on an Auto mesh, two steps from ``init``, against the same two steps on one device.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers.asserts import IMPLEMENTATION_RTOL, assert_trees_equal
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb

SHAPES = {"bias": (32,), "embed": (64, 16), "head": (16, 8), "layers": (8, 16, 16)}
STACKED_AXES = {"bias": 0, "embed": 0, "head": 0, "layers": 1}
LAYOUTS = {
  "replicated": {k: P() for k in SHAPES},
  "layer-axis": {"bias": P(), "embed": P(), "head": P(), "layers": P("data")},
  "inside-slices": {"bias": P(), "embed": P("data"), "head": P(), "layers": P(None, "data")},
}


def make_tx(clip: bool):
  return optax_lamb.lamb(
    1e-2,
    weight_decay=0.01,
    max_grad_norm=0.5 if clip else None,
    stacked_axes=STACKED_AXES,
    master_weights=True,
    skip_nonfinite=True,
  )


def arrays(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def two_steps(tx, put):
  params = put(arrays(0))
  step = jax.jit(tx.update)
  _, state = step(put(arrays(1)), tx.init(params), params)
  return jax.device_get(step(put(arrays(2)), state, params))


def one_device_and_sharded(layout: str, clip: bool):
  tx = make_tx(clip)
  want = two_steps(tx, lambda tree: jax.device_put(tree, jax.devices()[0]))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  shardings = {k: NamedSharding(mesh, spec) for k, spec in LAYOUTS[layout].items()}
  with jax.set_mesh(mesh):
    got = two_steps(tx, lambda tree: {k: jax.device_put(v, shardings[k]) for k, v in tree.items()})
  return got, want


@pytest.mark.parametrize(
  "layout,clip", [("replicated", True), ("replicated", False), ("layer-axis", False)]
)
def test_sums_whole_on_each_device_give_the_one_device_step_bit_for_bit(layout, clip):
  got, want = one_device_and_sharded(layout, clip)
  assert_trees_equal(got, want)


@pytest.mark.parametrize(
  "layout,clip", [("layer-axis", True), ("inside-slices", True), ("inside-slices", False)]
)
def test_sums_split_across_devices_give_it_to_rounding(layout, clip):
  """The new params (the updates are new master minus params: a last-bit difference of the
  master is one of the update's magnitude) and the state, to rtol 1e-5."""
  (updates, state), (want_updates, want_state) = one_device_and_sharded(layout, clip)
  new_params = optax.apply_updates(arrays(0), updates)
  want_params = optax.apply_updates(arrays(0), want_updates)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=IMPLEMENTATION_RTOL, atol=1e-7),
    (new_params, state),
    (want_params, want_state),
  )
