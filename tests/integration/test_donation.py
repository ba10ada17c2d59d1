"""Every state that init returns can be donated: no two leaves share a buffer.

`jax.jit(step, donate_argnums=...)` refuses an argument list that holds one
buffer twice ("Attempt to donate the same buffer twice"), so neither the state
nor the state together with the params may share a buffer, on any option set:
every option case of `helpers.options` (the one table), each with the wrappers
(skip_nonfinite, master_weights, a loss-scale schedule), and the stages and
wrappers used on their own. Init is checked eager (and jitted for the cases that
take every branch of init); a donated step then runs on the params and state
(a donated lamb step equals the undonated one: tests/backends/conformance.py).
"""

import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import fast_compile
from helpers.options import CASES, build
from helpers.trees import make_params

import optax_lamb

WRAPPERS = {
  "plain": {},
  "skip": {"skip_nonfinite": True},
  "master": {"master_weights": True},
  "scale-schedule": {"grad_scale": lambda count: 2.0 ** (count % 3)},
  "all": {"skip_nonfinite": True, "master_weights": True, "grad_scale": lambda count: 4.0},
}


def shared_buffers(tree):
  """The buffers (by address) that appear more than once among the array leaves of `tree`."""
  seen = collections.Counter(
    x.unsafe_buffer_pointer()
    for x in jax.tree.leaves(tree)
    if isinstance(x, jax.Array) and x.size  # zero-size arrays own no memory
  )
  return {ptr: n for ptr, n in seen.items() if n > 1}


def _plus_zero_fn(tree):
  return jax.tree.map(lambda x: x + 0, tree)


_donated_plus_zero = fast_compile.jit(_plus_zero_fn, donate_argnums=0)


def donate(tree):
  """Run a donated jitted step (x + 0 per leaf) on `tree`; its buffers are consumed."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # donated buffers the CPU backend cannot reuse
    return _donated_plus_zero(tree)


@functools.cache
def params():
  return make_params(0)


def assert_donatable(tx, params, jitted=True):
  """The state of eager (and jitted) init shares no buffer, with itself or the params; donated."""
  for state in (tx.init(params), *([jax.jit(tx.init)(params)] if jitted else [])):
    assert shared_buffers((params, state)) == {}, jax.tree.map(
      lambda x: x.unsafe_buffer_pointer(), state
    )
    want = [np.array(x, copy=True) for x in jax.tree.leaves(state)]
    got = donate((jax.tree.map(jnp.copy, params), state))[1]  # x + 0 for each leaf
    for a, b in zip(jax.tree.leaves(got), want, strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("wrappers", list(WRAPPERS))
@pytest.mark.parametrize("case", list(CASES))
def test_init_state_has_no_shared_buffers(case, wrappers):
  kwargs = CASES[case].lamb
  # jitted init (a compile each) for the cases that between them take every init branch
  jitted = case in ("defaults", "combined", "moments_bfloat16")
  assert_donatable(build({**kwargs, **WRAPPERS[wrappers]}, "xla"), params(), jitted)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_lamb.skip_nonfinite(optax.sgd(0.1)),
    lambda: optax_lamb.with_master_weights(optax_lamb.lamb(1e-2)),
    lambda: optax_lamb.unscale_gradients(lambda count: 2.0),
    lambda: optax_lamb.scale_by_adam(mu_dtype=jnp.bfloat16),
    lambda: optax_lamb.scale_by_trust_ratio(stacked_axes=0),
    lambda: optax_lamb.add_decayed_weights(optax.linear_schedule(0.1, 0.0, 5)),
    lambda: optax_lamb.clip_by_global_norm(1.0),
    lambda: optax.MultiSteps(optax_lamb.lamb(1e-2, skip_nonfinite=True), 2),
    lambda: optax.inject_hyperparams(optax_lamb.lamb)(1e-2, skip_nonfinite=True),
  ],
  ids=[
    "skip_nonfinite",
    "with_master_weights",
    "unscale_gradients",
    "scale_by_adam",
    "scale_by_trust_ratio",
    "add_decayed_weights",
    "clip_by_global_norm",
    "MultiSteps",
    "inject_hyperparams",
  ],
)
def test_stages_and_wrappers_init_has_no_shared_buffers(make):
  assert_donatable(make(), params())


def test_the_check_catches_a_shared_buffer():
  """A state with one counter array twice (lamb(skip_nonfinite=True) before the fix) is caught."""
  tx = optax_lamb.lamb(1e-2, skip_nonfinite=True)
  zero = jnp.zeros([], jnp.int32)
  state = optax_lamb.SkipNonFiniteState(
    total=zero, consecutive=zero, inner_state=tx.init(params()).inner_state
  )
  assert list(shared_buffers(state).values()) == [2]
  with pytest.raises(Exception, match="donate the same buffer twice"):
    donate(state)
