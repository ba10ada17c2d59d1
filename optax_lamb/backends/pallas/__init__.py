"""The former name of `optax_lamb.backends.pallas_triton` (``implementation="pallas"`` is an
alias of ``"pallas_triton"``); ``PallasBackend`` is ``PallasTritonBackend``. Kept for imports
written before the rename; deprecated (CHANGELOG.md), removed no sooner than version 0.4."""

import warnings

from optax_lamb.backends.pallas_triton.backend import PallasTritonBackend as PallasBackend
from optax_lamb.backends.pallas_triton.common import BlockSizes

warnings.warn(
  "optax_lamb.backends.pallas is deprecated: import optax_lamb.backends.pallas_triton "
  "(PallasBackend is PallasTritonBackend there).",
  DeprecationWarning,
  stacklevel=2,
)

__all__ = ["BlockSizes", "PallasBackend"]
