"""The conformance suite's checks can fail: its option cases bind, its tolerances separate.

A clamp or a clipping threshold that never binds would let a wrong rule pass;
a decay rounded to bfloat16 must fail the low-precision check; a retrace must
fail `chex.assert_max_traces`.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance import LOW_PRECISION_DECAY, first_step_ratios, low_precision_run
from helpers import asserts
from helpers.options import CASES, STACKED, reference
from helpers.trees import by_path, make_grads, make_params


def _first_two_steps_ratios(seed):
  ref = reference({"stacked_axes": STACKED})
  params = make_params(seed)
  flat = lambda tree: {n: np.asarray(x, np.float64) for n, x in by_path(tree).items()}
  for t in range(2):
    ref.step(flat(params), flat(make_grads(params, seed + 1 + t)))
  return ref.ratios


def test_the_clamps_and_the_clipping_bind(seed):
  ratios = _first_two_steps_ratios(seed)
  values = np.concatenate([np.ravel(r) for r in ratios.values()])
  for case, low, high in (("min_trust_ratio", "min_ratio", None), ("max_trust_ratio", None,
                          "max_ratio"), ("clamp", "min_ratio", "max_ratio")):  # fmt: skip
    options = CASES[case].reference
    if low:
      assert (values < options[low]).any(), case
    if high:
      assert (values > options[high]).any(), case
  stacked = ratios["['stacked']"]
  assert stacked.max() / stacked.min() > 10  # one ratio per slice really differs
  params = make_params(seed)
  grads = make_grads(params, seed + 1, CASES["max_grad_norm"].grad_scale)
  assert optax.tree.norm(grads) > CASES["max_grad_norm"].reference["max_grad_norm"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_decay_rounded_to_bfloat16_fails_the_low_precision_check(dtype, seed):
  """The bf16-rounded decay moves a first-step ratio by more than the README's rtol."""
  rounded = float(jnp.asarray(LOW_PRECISION_DECAY, jnp.bfloat16))
  assert rounded == 0.30078125
  run = low_precision_run("xla", dtype, "param-dtype", seed)
  exact = first_step_ratios(run.params, run.grads[0], LOW_PRECISION_DECAY)
  wrong = first_step_ratios(run.params, run.grads[0], rounded)
  with pytest.raises(AssertionError):
    for name, r in wrong.items():
      asserts.assert_close_to_reference(r, exact[name], rtol=asserts.IMPLEMENTATION_RTOL, atol=0)


def test_a_retrace_fails_assert_max_traces():
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def add_one(x):
    return x + 1

  add_one(jnp.ones(3))
  add_one(jnp.ones(3))  # cached: no trace
  with pytest.raises(AssertionError, match="traced > 1 times"):
    add_one(jnp.ones(7))
