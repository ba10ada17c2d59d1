"""lamb with a numeric argument injected by optax.inject_hyperparams (an array, traced under jit)
computes what lamb built with the same Python float computes, on every implementation.
"""

from __future__ import annotations

import optax
import pytest
from helpers.implementations import TINY_BLOCKS
from helpers.options import LAMB_NUMBERS
from helpers.two_leaves import assert_close, run_steps

import optax_lamb
from optax_lamb.backends.pallas import PallasBackend

PALLAS = PallasBackend(block_sizes=TINY_BLOCKS, interpret=True)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}


# Pallas in interpret mode is slow: the arguments its kernels read as scalars from the step.
_INJECTED_CASES = [(name, impl) for name in sorted(LAMB_NUMBERS) for impl in ("xla", "reference")]


_INJECTED_CASES += [(name, "pallas") for name in ("learning_rate", "max_grad_norm", "weight_decay")]


@pytest.mark.parametrize("name,implementation", _INJECTED_CASES)
def test_lamb_under_inject_hyperparams(name, implementation):
  """Lamb with one numeric argument injected (an array, traced under jit) computes what
  lamb built with the same Python float computes, on every implementation."""
  kwargs = {"implementation": IMPLEMENTATIONS[implementation]}
  if name != "learning_rate":
    kwargs["learning_rate"] = 1e-2
  kwargs[name] = LAMB_NUMBERS[name]
  injected = optax.inject_hyperparams(optax_lamb.lamb)(**kwargs)
  assert_close(run_steps(injected), run_steps(optax_lamb.lamb(**kwargs)))
