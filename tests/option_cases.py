"""The names tests/test_pallas.py imports, from the helpers, until that file moves.

test_pallas.py sets its own Pallas launch context, so `build` here hands lamb
the implementation name as it is.
"""

from helpers.options import CASES as _ALL_CASES
from helpers.options import LR, numpy_lamb  # noqa: F401
from helpers.trees import by_path, make_grads, make_params  # noqa: F401

import optax_lamb

# The cases test_pallas.py was written for (each costs a compile of the kernels).
CASES = {
  name: _ALL_CASES[name]
  for name in (
    "defaults", "weight_decay", "decay_mask", "trust_ratio_mask", "min_trust_ratio",
    "max_trust_ratio", "no_bias_correction", "eps_root", "eps_zero", "max_grad_norm",
    "stacked_axes", "schedules", "mu_bfloat16", "moments_bfloat16", "combined",
  )
}  # fmt: skip


def build(kwargs, implementation):
  kwargs = dict(kwargs)
  return optax_lamb.lamb(kwargs.pop("learning_rate", LR), implementation=implementation, **kwargs)
