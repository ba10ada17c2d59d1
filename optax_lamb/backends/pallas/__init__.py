"""The Pallas (Triton) backend: `chunks` (launch configuration), `kernels` (the kernels and their
jnp references), `launch` (the ``pallas_call`` s) and `driver` (one step, and what it supports).

Importing it imports ``jax.experimental.pallas.triton``; the dispatcher treats an
ImportError as "no Pallas on this jax" and uses the XLA path.
"""

from optax_lamb.backends.pallas.chunks import BlockSizes, options
from optax_lamb.backends.pallas.driver import step, unsupported_reason

__all__ = ["BlockSizes", "options", "step", "unsupported_reason"]
