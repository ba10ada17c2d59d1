"""A call that fails at update raises a clear error, and the state handed in still works.

One test for every failing call of `failed_calls.FAILED_CALLS` (bad trees and
gradients, a state that does not fit, per-leaf options that do not fit, a bad
grad_scale), made each way it can be (eager, jitted, update_and_apply): it
raises the expected error, leaves every leaf of the state as it was (none
donated away), and the state then gives its own optimizer's step, bit for bit
the step of an untouched copy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from failed_calls import FAILED_CALLS, invoke
from helpers.asserts import assert_trees_equal, assert_unchanged, snapshot

CALLS = [pytest.param(case, how, id=f"{case}-{how}")
         for case, call in FAILED_CALLS.items() for how in call.hows]  # fmt: skip


@pytest.mark.parametrize("case, how", CALLS)
def test_failed_call_raises_and_keeps_the_state(case, how, rng):
  call = FAILED_CALLS[case]
  setup = call.setup(rng)
  snap = snapshot(setup.state)
  with pytest.raises(call.error, match=call.match):
    invoke(how, setup.tx, setup.grads, setup.state, setup.params, **setup.kwargs)
  assert_unchanged(setup.state, snap)
  fresh = jax.tree.map(lambda x: jnp.array(np.asarray(x)), setup.state)
  assert_trees_equal(setup.resume(setup.state), setup.resume(fresh))
