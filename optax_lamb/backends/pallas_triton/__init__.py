"""The Pallas Triton backend: its kernel set on the shared GPU driver (`optax_lamb.backends.gpu`).

One module per kernel pass, each with its ``pallas_call`` (`pass1`,
`slice_sums`, `pass2`; what each computes and its jnp twin are the driver's,
`optax_lamb.backends.gpu.passes`), what they share (`common`: launch sizes, a
program's chunk, masked loads, the call; 8-bit moments as codes and scales:
`operands`), and the kernel set with its backend (`backend.PallasTritonBackend`).

Importing it imports ``jax.experimental.pallas.triton``; the registry treats an
ImportError as "no Pallas Triton on this jax" and uses another path.
"""

from optax_lamb.backends.pallas_triton.backend import PallasTritonBackend
from optax_lamb.backends.pallas_triton.common import BlockSizes

__all__ = ["BlockSizes", "PallasTritonBackend"]
