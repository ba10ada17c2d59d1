"""The Pallas Triton backend: its kernel set on the shared GPU driver (`optax_lamb.backends.gpu`).

8-bit block-wise quantized moments (``mu_dtype=jnp.int8, nu_dtype=jnp.uint8``)
are narrow moments to the driver: both passes read the codes and the scales of
a chunk's blocks and dequantize them in registers; pass 2 requantizes the new
moments with `optax_lamb.core._quantize`'s functions and writes codes, scales and
the update (or p) in the same pass (`operands`). The kernels take them where
every quantization block lies whole in one chunk: a leaf whose last axis is a
multiple of 256 and not stacked, with ``BlockSizes.block`` a multiple of 256. A
step with another quantized leaf (a partial last block, such as a last axis of
300), or with 8-bit moments on a mesh outside ``shard_map``, is declined
(`unsupported_reason` names the leaf's shape) and runs on the XLA path.
"""

from __future__ import annotations

import dataclasses

import jax

from optax_lamb.backends.gpu import tables
from optax_lamb.backends.gpu.driver import GpuBackend
from optax_lamb.backends.pallas_triton import operands, pass1, pass2, slice_sums
from optax_lamb.backends.pallas_triton.common import BlockSizes
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.step._plan import LeafArrays, LeafPlan, StepPlan


@dataclasses.dataclass(frozen=True)
class TritonKernels:
  """The Triton kernel set (`optax_lamb.backends.gpu.driver.KernelSet`) at one launch config."""

  sizes: BlockSizes
  interpret: bool

  def leaf_reason(self, leaf: LeafPlan, x: LeafArrays) -> str | None:
    if isinstance(x.m, QuantizedMoment) or isinstance(x.v, QuantizedMoment):
      return operands.unsupported_reason(leaf, self.sizes.block)
    return None

  def moments_and_norms(
    self, scalars, leaves: list[dict], **static
  ) -> tuple[list[dict], jax.Array]:
    return pass1.moments_and_norms(scalars, leaves, **static, **self._launch())

  def slice_sums(self, starts: list[int], counts: list[int], partials: jax.Array) -> tuple:
    operands = tables.slot_operands(starts, counts)
    return slice_sums.slice_sums(*operands, partials, **self._launch())

  def updates(self, scalars, ratios, leaves: list[dict], **static) -> list[dict]:
    return pass2.updates(scalars, ratios, leaves, **static, **self._launch())

  def _launch(self) -> dict:
    return {"block_sizes": self.sizes, "interpret": self.interpret}


@dataclasses.dataclass(frozen=True)
class PallasTritonBackend(GpuBackend):
  """The Pallas Triton kernels, with their launch configuration.

  Attributes:
    block_sizes: the launch sizes (`BlockSizes`).
    interpret: run the kernels in Pallas interpret mode; None: exactly when
      the default backend is not a GPU.

  Example:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend
    >>> backend = PallasTritonBackend(block_sizes=BlockSizes(block=1024))
    >>> tx = optax_lamb.lamb(1e-3, implementation=backend)
    >>> params = {"w": jnp.ones((3, 3))}
    >>> state = tx.init(params)
    >>> with warnings.catch_warnings():  # without a GPU: interpret mode, with a warning
    ...   warnings.simplefilter("ignore")
    ...   updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> print([round(x, 4) for x in optax.apply_updates(params, updates)["w"][0].tolist()])
    [0.999, 0.999, 0.999]
  """

  name = "pallas_triton"
  block_sizes: BlockSizes = BlockSizes()
  interpret: bool | None = None

  def kernels(self, plan: StepPlan, *, interpret: bool) -> TritonKernels:
    """The same block sizes for every plan (`benchmarks/pallas_tuning.py` searches them)."""
    return TritonKernels(self.block_sizes, interpret)
