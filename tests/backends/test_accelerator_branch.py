"""The accelerators' program, run on the CPU: the same step as the CPU's, value for value.

Off the CPU the package replaces its conditionals with arithmetic (`optax_lamb.core._ratios.
per_platform`; tests/backends/test_accelerator_program.py counts them): the norms' rescue sums
at both fixed scales beside the plain ones, the clipping norm's three sums in one pass, skipping
a select of the new or the old state, no ordering conditional for narrow moments. The CPU suite
runs only the CPU's branch, which the other tests hold to the references; here every
configuration steps with each branch (`_ratios.PLATFORM_BRANCH`), on gradients whose squares
overflow float32 (1e20) or underflow it (1e-22), with a NaN (a skipped step) and ordinary ones,
and the accelerators' updates and states must equal the CPU's: integers (counts, 8-bit codes)
bit for bit, floats to a few float32 roundings (the sums at three scales come out of one
reduction, in another order; a new param to a rounding of its leaf's largest element).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb
from optax_lamb import compat
from optax_lamb.core import _ratios

SHAPES = {"w": (160, 128), "stack": (2, 64, 64), "b": (64,), "s": ()}  # w: blocked sums
STACKED = {"w": 0, "stack": 1, "b": 0, "s": 0}
RULE = optax_lamb.SpikeRule(factor=3.0, warmup_steps=1, decay=0.9)
RTOL = 1e-5
EPS32 = float(np.finfo(np.float32).eps)  # new params: a rounding of the leaf's largest element

CONFIGURATIONS = {
  "xla": lambda: optax_lamb.lamb(1e-2, weight_decay=0.01, implementation="xla"),
  "xla clip, stacked": lambda: optax_lamb.lamb(
    1e-2, weight_decay=0.01, max_grad_norm=1.0, stacked_axes=STACKED, implementation="xla"
  ),
  "xla skip, clip, spikes": lambda: optax_lamb.lamb(
    1e-2, skip_nonfinite=True, max_grad_norm=1.0, skip_spikes=RULE, implementation="xla"
  ),
  "xla bf16 moments, skip": lambda: optax_lamb.lamb(
    1e-2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, skip_nonfinite=True, implementation="xla"
  ),
  "xla 8-bit moments": lambda: optax_lamb.lamb(
    1e-2, mu_dtype=jnp.int8, nu_dtype=jnp.uint8, implementation="xla"
  ),
  "reference skip, clip": lambda: optax_lamb.lamb(
    1e-2, weight_decay=0.01, skip_nonfinite=True, max_grad_norm=1.0, implementation="reference"
  ),
  "skip_nonfinite stage, check_results, spikes": lambda: optax_lamb.skip_nonfinite(
    optax.chain(optax_lamb.clip_by_global_norm(1.0), optax_lamb.scale_by_trust_ratio()),
    check_results=True,
    spikes=RULE,
  ),
  "onnxruntime": lambda: compat.onnxruntime_lamb(lr=1e-2, max_norm_clip=1.0, implementation="xla"),
}
GRADIENTS = {"ordinary": 1.0, "squares overflow": 1e20, "squares underflow": 1e-22, "a NaN": 1.0}


def _tree(rng, scale):
  return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in SHAPES.items()}


def _steps(name, fused, branch, monkeypatch, rng_seed):
  """The updates (or new params) and states of three steps (ordinary, then each of GRADIENTS'
  others) traced with `branch` of `per_platform`."""
  monkeypatch.setattr(_ratios, "PLATFORM_BRANCH", branch)
  rng = np.random.default_rng(rng_seed)
  tx = CONFIGURATIONS[name]()
  params = _tree(rng, 1.0)
  state = tx.init(params)
  value = {"value": jnp.float32(2.0)} if "spikes" in name and not fused else {}

  def step(params, state, grads):
    if fused:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    return tx.update(grads, state, params, **value)

  step = jax.jit(step)
  out = []
  for name, scale in GRADIENTS.items():
    grads = _tree(rng, scale)
    if name == "a NaN":
      grads["w"] = grads["w"].at[3, 5].set(jnp.nan)
    result, state = step(params, state, grads)
    out.append((name, result, state))
  return out


CASES = [  # a stage's update (no params to apply to) in its one form
  (name, fused)
  for name in CONFIGURATIONS
  for fused in (False, True)
  if not (fused and "stage" in name)
]


@pytest.mark.parametrize(("name", "fused"), CASES)
def test_the_accelerators_step_equals_the_cpus(name, fused, monkeypatch, device_count_seen):
  cpu = _steps(name, fused, "cpu", monkeypatch, 0)
  accelerator = _steps(name, fused, "accelerator", monkeypatch, 0)
  for (grads, *want), (_, *got) in zip(cpu, accelerator, strict=True):
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
      w, g = np.asarray(w), np.asarray(g)
      if w.dtype.kind in "iub":  # counts, 8-bit codes: exact
        np.testing.assert_array_equal(g, w, err_msg=f"{name}, {grads} gradients")
      else:
        w, g = w.astype(np.float32), g.astype(np.float32)
        atol = 2 * EPS32 * float(np.nanmax(np.abs(w), initial=0, where=np.isfinite(w)))
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=atol, err_msg=f"{name}, {grads}")


def test_the_branch_switch_is_seen():
  """The switch the test above relies on: each branch runs where it is forced."""
  try:
    for branch, want in (("cpu", 1.0), ("accelerator", 2.0)):
      _ratios.PLATFORM_BRANCH = branch
      step = lambda x: jax.lax.platform_dependent(**_ratios.per_platform(lambda: x, lambda: 2 * x))
      got = jax.jit(step)(jnp.float32(1))
      assert float(got) == want
  finally:
    _ratios.PLATFORM_BRANCH = "lowered"
