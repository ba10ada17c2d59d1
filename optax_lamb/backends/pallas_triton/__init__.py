"""The Pallas Triton backend: one module per kernel pass, each with its ``pallas_call`` and
the jnp reference it must equal (`pass1`, `slice_sums`, `pass2`), what they share (`common`; a
chunk of a leaf's operands, 8-bit moments as codes and scales: `operands`), and the step over a
tree with its launch configuration (`driver.PallasTritonBackend`).

Importing it imports ``jax.experimental.pallas.triton``; the registry treats an
ImportError as "no Pallas Triton on this jax" and uses the XLA path.
"""

from optax_lamb.backends.pallas_triton.common import BlockSizes
from optax_lamb.backends.pallas_triton.driver import PallasTritonBackend

__all__ = ["BlockSizes", "PallasTritonBackend"]
