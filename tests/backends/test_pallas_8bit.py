"""The Pallas kernels with 8-bit block-wise quantized moments (mu_dtype=int8, nu_dtype=uint8).

In Pallas interpret mode (the CPU): each kernel against its jnp twin, the step against the
XLA path, a skipped step, and the leaves the kernels decline (`operands.unsupported_reason`).
Blocks of 512 elements (two quantization blocks a chunk, and masked tails of whole blocks),
three leaves a launch. On a GPU the kernel and step tests also run compiled.

Codes and scales are compared with `assert_quantized_close`, not bit for bit: the kernels and
the XLA path compute the new moment b1 m + (1 - b1) g with the same functions, but XLA:CPU
contracts it into a fused multiply-add in the interpreted kernel's loop and not in the XLA
path's fusions, as it does for float32 moments (the narrow-moment kernel tests allow rtol 1e-5).
Seen here: from the second step on, one float32 ulp on up to 44% of m's scales; v's scales and
every code equal. A code may differ by one index where its moment lies next to a midpoint
between two codes. A skipped step is bit for bit.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import quantize_reference as qref
from helpers.asserts import FEW_ROUNDINGS, assert_trees_close
from helpers.implementations import EIGHT_BIT_BLOCKS, lamb_for

import optax_lamb
from optax_lamb.backends.gpu import passes
from optax_lamb.backends.gpu import tables as gpu_tables
from optax_lamb.backends.pallas_triton import (
  BlockSizes,
  PallasTritonBackend,
  operands,
  pass1,
  pass2,
)
from optax_lamb.core import _moment_storage, _quantize
from optax_lamb.core._options import LambOptions, StepScalars
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.step import _plan

SIZES = EIGHT_BIT_BLOCKS
# name: (shape, stacked axes, adapted, decays)
LEAVES = {
  "w": ((16, 512), 0, True, True),  # 2-D: two blocks a row, 16 chunks
  "stack": ((3, 6, 256), 1, True, True),  # stacked: 1,536 a slice, 3 chunks each, the last half
  "emb": ((4096,), 0, False, True),  # 1-D, not adapted: pass 2 alone
  "rows": ((16, 256), 0, True, False),  # one block a row, no decay
  "b": ((7,), 0, True, False),  # small: float32 moments
  "s": ((), 0, False, False),  # 0-d: float32
}


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    yield


def assert_quantized_close(got, want, where=""):
  """Codes and scales of two quantized moments computed from moments a few float32 roundings
  apart: scales within FEW_ROUNDINGS (relative; NaN and 0 exactly), codes equal or one index
  apart, and few apart."""
  assert isinstance(got, QuantizedMoment) and isinstance(want, QuantizedMoment), where
  assert got.codes.dtype == want.codes.dtype and got.codes.shape == want.codes.shape, where
  assert got.scales.dtype == want.scales.dtype == jnp.float32, where
  assert got.scales.shape == want.scales.shape, where
  a, b = np.asarray(got.scales, np.float64), np.asarray(want.scales, np.float64)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=where)
  np.testing.assert_allclose(a, b, rtol=FEW_ROUNDINGS, atol=0, err_msg=where)
  signed = got.codes.dtype == jnp.int8
  index = [qref.code_to_index(np.asarray(x.codes), signed) for x in (got, want)]
  apart = np.abs(index[0].astype(int) - index[1].astype(int))
  assert apart.max(initial=0) <= 1, where
  assert np.mean(apart) <= 0.01, (where, int(np.sum(apart)))


def assert_states_close(got, want):
  """Two adam states: quantized moments by `assert_quantized_close`, the rest to rtol 1e-5."""
  flat = [jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_moment)[0] for x in (got, want)]
  for (path, a), (_, b) in zip(*flat, strict=True):
    if isinstance(a, QuantizedMoment):
      assert_quantized_close(a, b, jax.tree_util.keystr(path))
    else:
      assert_trees_close(a, b)


def _is_moment(x):
  return isinstance(x, QuantizedMoment)


# ----------------------------------------------------------------- each kernel and its twin


def _plans():
  offsets = np.cumsum([0] + [int(np.prod(s[:k])) for s, k, _, _ in LEAVES.values()])
  plans = [
    _plan.LeafPlan(i, shape, decay, adapt, k, None, int(offsets[i]), True)
    for i, (shape, k, adapt, decay) in enumerate(LEAVES.values())
  ]
  return plans, int(offsets[-1])


def _flat_leaf(rng, shape):
  size = int(np.prod(shape))
  draw = lambda: jnp.asarray(rng.standard_normal(size), jnp.float32)
  m = 0.1 * draw()
  v = jnp.asarray(np.abs(rng.standard_normal(size)), jnp.float32)
  if _moment_storage.quantizes(shape):  # flat: the same blocks, the last axis holding whole ones
    m, v = _quantize.quantize(m, True), _quantize.quantize(v, False)
  return {"g": draw(), "m": m, "p": draw(), "v": v}


ON_A_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU")
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=ON_A_GPU)]


@pytest.mark.slow  # 25 s interpreted: CI runs it (the step tests below run the kernels too)
@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("skipped", [False, True], ids=["taken", "skipped"])
@pytest.mark.parametrize("apply", [False, True])
def test_kernels_equal_their_references_with_8bit_moments(apply, skipped, interpret, rng):
  plans, slots = _plans()
  leaves = [_flat_leaf(rng, leaf.shape) for leaf in plans]
  runtime = lambda x: jnp.asarray(x, jnp.float32)
  o = LambOptions()
  h = StepScalars(bc1=runtime(0.1), bc2=runtime(0.01), weight_decay=runtime(0.05),
                  step_size=runtime(-1e-2), take=runtime(0.0 if skipped else 1.0))  # fmt: skip
  scalars, layout = gpu_tables.scalar_operands(h)
  launch = dict(options=o, scalar_layout=layout, block_sizes=SIZES, interpret=interpret)
  for table in gpu_tables.buckets([leaf for leaf in plans if leaf.adapt], SIZES):
    flat = [leaves[c.leaf.index] for c in table]
    written, parts = pass1.moments_and_norms(scalars, flat, table=table, **launch)
    for c, moments, x in zip(table, written, flat, strict=True):
      assert moments == {}  # narrow: pass 2 writes them
      _, want = jax.jit(passes.pass1_reference, static_argnums=(0, 3, 4))(o, h, x, c, SIZES.block)
      assert_trees_close(parts[:, c.first : c.first + c.programs], want)
  ratios = jnp.asarray(rng.uniform(0.5, 2.0, slots), jnp.float32)
  for table in gpu_tables.buckets(plans, SIZES):
    flat = [leaves[c.leaf.index] for c in table]
    results = pass2.updates(scalars, ratios, flat, table=table, apply=apply, **launch)
    for c, x, got in zip(table, flat, results, strict=True):
      want = jax.jit(passes.pass2_reference, static_argnums=(0, 2), static_argnames="apply")(
        o, h, c.leaf, x, ratios, apply=apply
      )
      assert set(got) == set(want) == {"out", "m", "v"}
      assert_trees_close(got["out"], want["out"])
      for name in "mv":
        if skipped:  # the old codes and scales, bit for bit
          for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(x[name]), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        elif isinstance(x[name], QuantizedMoment):
          assert_quantized_close(got[name], want[name], f"{c.leaf.shape} {name}")
        else:
          assert_trees_close(got[name], want[name])


# ----------------------------------------------------------------- the step against the XLA path


def _tree(rng, scale=1.0):
  return {
    k: jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for k, (s, *_) in LEAVES.items()
  }


def _lamb(implementation, **kwargs):
  """lamb with 8-bit moments on the test tree; `implementations.lamb_for`'s (a Pallas one: an
  error if it falls back to the XLA path)."""
  per_leaf = lambda i: {k: v[i] for k, v in LEAVES.items()}
  return lamb_for(implementation)(1e-2, weight_decay=0.01, mask=per_leaf(3),
                                  trust_ratio_mask=per_leaf(2), stacked_axes=per_leaf(1),
                                  mu_dtype=jnp.int8, nu_dtype=jnp.uint8, **kwargs)  # fmt: skip


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
  "fused",
  [
    pytest.param(False, id="update", marks=pytest.mark.slow),
    pytest.param(True, id="update_and_apply", marks=pytest.mark.slow),
  ],
)  # 10-13 s interpreted each: CI runs them (the skip test below runs the kernels)
def test_step_agrees_with_the_xla_path(fused, interpret, rng):
  """Three steps, each from the XLA path's params and state: the same moments (see the module
  docstring), params and trust ratios to the implementations' rtol. In ``tx.update`` the leaves
  of 4,096 elements or more take pass 2's jnp twin (XLA), in ``update_and_apply`` the kernel."""
  params = _tree(rng)
  txs = [_lamb("pallas-8bit" if interpret else "pallas-8bit-compiled"), _lamb("xla")]
  if fused:
    step = lambda tx, g, s, p: optax_lamb.update_and_apply(tx, g, s, p)
  else:
    step = lambda tx, g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  run = jax.jit(lambda g, s, p: [step(tx, g, s, p) for tx in txs])
  state = txs[1].init(params)
  for t in range(3):
    (p_got, s_got), (p_want, s_want) = run(_tree(rng, 10.0**-t), state, params)
    assert isinstance(s_got[1].mu["w"], QuantizedMoment)
    assert_states_close(s_got[1], s_want[1])
    assert_trees_close(p_got, p_want)
    assert_trees_close(optax_lamb.trust_ratios(s_got), optax_lamb.trust_ratios(s_want))
    params, state = p_want, s_want


def _adam(state):
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  return next(x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x))


def test_a_skipped_step_leaves_codes_and_scales_bit_identical(rng):
  params = _tree(rng)
  tx = _lamb("pallas-8bit", skip_nonfinite=True)
  update = jax.jit(tx.update)
  state = update(_tree(rng), tx.init(params), params)[1]  # non-zero codes and scales
  for bad in (np.nan, 1e30):  # 1e30: its square overflows float32
    grads = _tree(rng)
    grads["w"] = grads["w"].at[3, 7].set(bad)
    updates, new = update(grads, state, params)
    before, after = (_adam(x) for x in (state, new))
    for field in ("mu", "nu"):
      for k in ("w", "stack", "emb", "rows"):
        old, kept = getattr(before, field)[k], getattr(after, field)[k]
        assert np.any(np.asarray(old.codes)) and np.any(np.asarray(old.scales))
        for a, b in zip(kept, old, strict=True):
          assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (field, k)
    assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert int(after.count) == int(before.count)


# ----------------------------------------------------------------- what the kernels decline


@pytest.mark.parametrize(
  "shape, stacked, block, match",
  [
    ((24, 300), 0, 512, r"leaf of shape \(24, 300\) \(a partial last block\)"),
    ((5000,), 0, 512, r"leaf of shape \(5000,\) \(a partial last block\)"),
    ((4096,), 1, 512, r"leaf of shape \(4096,\) \(a stacked last axis\)"),
    ((16, 512), 0, 128, r"BlockSizes\(block=128\)"),
  ],
)
def test_unsupported_8bit_leaves_are_declined_with_their_shape(shape, stacked, block, match):
  params = {
    "w": jax.ShapeDtypeStruct(shape, jnp.float32),
    "b": jax.ShapeDtypeStruct((7,), jnp.float32),
  }
  backend = PallasTritonBackend(block_sizes=BlockSizes(block=block, sum_block=16), interpret=True)
  tx = optax_lamb.lamb(1e-2, stacked_axes={"w": stacked, "b": 0}, mu_dtype=jnp.int8,
                       nu_dtype=jnp.uint8, implementation=backend)  # fmt: skip
  state = jax.eval_shape(tx.init, params)
  with pytest.warns(UserWarning, match=match + r".*xla path"):
    jax.eval_shape(tx.update, params, state, params)


def test_unsupported_reason_of_the_layout():
  leaf = lambda shape, k=0: _plan.LeafPlan(0, shape, True, True, k, None, 0, True)
  assert operands.unsupported_reason(leaf((16, 512)), 4096) is None
  assert operands.unsupported_reason(leaf((3, 8, 256), 2), 256) is None
  assert "(3, 8, 300)" in operands.unsupported_reason(leaf((3, 8, 300), 1), 4096)
  assert "stacked" in operands.unsupported_reason(leaf((3, 256), 2), 4096)
  assert "block=128" in operands.unsupported_reason(leaf((16, 512)), 128)
