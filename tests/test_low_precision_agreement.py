"""Issue 12, class 5: low-precision params, every implementation computes its scalars in float32.

With bfloat16 (or float16) params and a Python-float ``weight_decay=0.3``, the
Pallas kernels (interpret mode on the CPU), the XLA path and the reference
chain agree: the float32 trust ratios to the README's rtol 1e-5, and the
updates up to their final rounding to the params' dtype. The first step's
ratios also equal a float64 NumPy computation with the decay exactly 0.3: a
decay rounded to bfloat16 (0.30078125) moves them by more than 1e-5, which the
last test checks, so a path that rounds it fails here.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb
from optax_lamb.backends.pallas import BlockSizes, PallasBackend

SEED = int(os.environ.get("PALLAS_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
LR, WEIGHT_DECAY, EPS, STEPS = 1e-2, 0.3, 1e-6, 3
RTOL = 1e-5  # README: every implementation equals the XLA path to rtol 1e-5
# Tiny blocks: several launches, and both kinds of pass 2 (the kernel below 256 elements,
# the XLA computation above), as in tests/test_pallas.py.
PALLAS = PallasBackend(
  block_sizes=BlockSizes(
    block=128, max_leaves_per_call=3, num_warps=4, sum_block=16, xla_pass2_min_size=256
  ),
  interpret=True,
)
SHAPES = {"w": (16, 40), "k": (5, 20), "b": (37,)}


def make_params(dtype, seed):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(SHAPES))
  # Params of scale 2 make the decay a large part of the direction, so its value shows.
  return {
    name: (2.0 * jax.random.normal(k, shape)).astype(dtype)
    for k, (name, shape) in zip(keys, SHAPES.items(), strict=True)
  }


def make_grads(params, seed):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(params))
  return {
    name: jax.random.normal(k, p.shape).astype(p.dtype)
    for k, (name, p) in zip(keys, params.items(), strict=True)
  }


def first_step_ratios(params, grads, weight_decay):
  """The trust ratios of step 1 in float64: u = m^ / (sqrt(v^) + eps) + wd p, r = |p| / |u|."""
  ratios = {}
  for name, p in params.items():
    p, g = np.asarray(p, np.float64), np.asarray(grads[name], np.float64)
    u = g / (np.abs(g) + EPS) + weight_decay * p  # bias-corrected moments of step 1: g and g^2
    ratios[name] = np.linalg.norm(p) / np.linalg.norm(u)
  return ratios


def assert_ratios_close(got, want, msg):
  for name in SHAPES:
    np.testing.assert_allclose(
      np.asarray(got[name], np.float64), want[name], rtol=RTOL, err_msg=f"{name} {msg}"
    )


def assert_within_one_rounding(got, want, dtype, msg):
  """Equal, or one rounding of `dtype` apart (float32 values within 1e-5 may round apart)."""
  eps = float(jnp.finfo(dtype).eps)
  differ = 0
  for name in SHAPES:
    a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
    np.testing.assert_allclose(a, b, rtol=eps, atol=0, err_msg=f"{name} {msg}")
    differ += int(np.sum(a != b))
  assert differ <= 0.01 * sum(np.prod(s) for s in SHAPES.values()), f"{differ} differ; {msg}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_pallas_xla_and_reference_agree_on_low_precision_params(dtype):
  params = make_params(dtype, SEED)
  grads = [make_grads(params, SEED + 1 + t) for t in range(STEPS)]
  txs = {
    name: optax_lamb.lamb(LR, weight_decay=WEIGHT_DECAY, implementation=impl)
    for name, impl in (("reference", "reference"), ("xla", "xla"), ("pallas", PALLAS))
  }

  def update(tx, p, s, g):
    u, s = tx.update(g, s, p)
    return u, optax.apply_updates(p, u), s

  @jax.jit
  def step(runs, g):
    out = {impl: update(tx, *runs[impl], g) for impl, tx in txs.items()}
    fused = optax_lamb.update_and_apply(txs["pallas"], g, runs["fused"][1], runs["fused"][0])
    return out, fused

  runs = {name: (params, txs["xla"].init(params)) for name in (*txs, "fused")}
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*xla path")  # the kernels ran, no fallback
    warnings.filterwarnings("ignore", message=".*interpret mode")
    for t, g in enumerate(grads):
      out, fused = step(runs, g)
      msg = f"step {t + 1}, {jnp.dtype(dtype).name}, PALLAS_TEST_SEED={SEED}"
      ratios = {impl: optax_lamb.trust_ratios(s) for impl, (_, _, s) in out.items()}
      if t == 0:
        assert_ratios_close(ratios["xla"], first_step_ratios(params, g, WEIGHT_DECAY), msg)
      for impl in ("pallas", "reference"):
        want = {k: np.asarray(v, np.float64) for k, v in ratios["xla"].items()}
        assert_ratios_close(ratios[impl], want, f"{impl} vs xla, {msg}")
        assert_within_one_rounding(out[impl][0], out["xla"][0], dtype, f"{impl} updates, {msg}")
      assert_ratios_close(
        optax_lamb.trust_ratios(fused[1]),
        {k: np.asarray(v, np.float64) for k, v in ratios["xla"].items()},
        f"update_and_apply vs xla, {msg}",
      )
      assert_within_one_rounding(fused[0], out["pallas"][1], dtype, f"fused params, {msg}")
      for impl in out:
        assert jax.tree.map(lambda x: x.dtype, out[impl][0]) == {k: dtype for k in SHAPES}
      runs = {impl: (p, s) for impl, (_, p, s) in out.items()} | {"fused": fused}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_a_decay_rounded_to_bfloat16_would_fail_the_tolerance(dtype):
  """The check above can fail: the bf16-rounded decay moves a first-step ratio by more than 1e-5."""
  rounded_decay = float(jnp.asarray(WEIGHT_DECAY, jnp.bfloat16))
  assert rounded_decay == 0.30078125
  params = make_params(dtype, SEED)
  grads = make_grads(params, SEED + 1)
  exact = first_step_ratios(params, grads, WEIGHT_DECAY)
  rounded = first_step_ratios(params, grads, rounded_decay)
  with pytest.raises(AssertionError):
    assert_ratios_close(rounded, exact, "")
