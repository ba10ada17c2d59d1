"""Building lamb for one implementation with the tests' configuration: the one place that knows how.

`IMPLEMENTATIONS` names the configurations the tests run:

- ``"xla"``: the fused XLA path as shipped (in the tests' process of eight
  devices: every leaf's norm sums its own);
- ``"xla-one-device"``: the XLA path as shipped to a process of one device (the
  small leaves' sums from zero-padded rows, `XlaBackend.joint_small_sums`);
- ``"xla-large-tree"``: the XLA path as it runs large leaves, on every leaf: u
  recomputed in its second pass, the rescue's scaled sums under ``lax.cond``
  (shipped only past `XlaBackend.materialize_u_max_size`);
- ``"pallas"``: the Pallas kernels in interpret mode with tiny blocks (128
  elements, 3 leaves per launch, pass 2 by XLA from 256 elements), so that chunk
  tails, stacked slices, several launches and both kinds of pass 2 run on the
  small option tree; a fallback to the XLA path is an error;
- ``"pallas-tiny-blocks"``: the same with 16-element blocks and 2 leaves per
  launch, for the property tests' trees of a few elements;
- ``"pallas-compiled"``: the kernels compiled by Triton, with the tiny blocks
  (a GPU only);
- ``"pallas-8bit"``: the kernels in interpret mode with blocks of 512 elements
  (a multiple of the 256 of a quantization block, which 8-bit moments need;
  3 leaves per launch, pass 2 by XLA from 4,096 elements in ``tx.update``), for
  the 8-bit moment tests (`tests/backends/test_pallas_8bit.py`); a fallback to
  the XLA path is an error; ``"pallas-8bit-compiled"``: the same compiled (a GPU only);
- ``"pallas-mosaic-gpu"``: the Mosaic GPU kernels in Pallas interpret mode with
  their smallest blocks (256 elements; pass 2 by XLA from 1,024 elements), so
  chunk tails, stacked slices and both kinds of pass 2 run on the option tree; a
  fallback to the XLA path is an error; ``"pallas-mosaic-gpu-compiled"``: the
  same compiled (a GPU of compute capability 9.0 or newer only);
- ``"reference"``: the planned step on the reference backend (the stages' per-leaf math).

The configurations are backend objects passed as ``implementation=``; for the
Pallas ones, `lamb_for` also wraps ``update`` (and the transformation's ``fused_apply``) so that
a warning that the step fell back to the XLA path is an error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable

import optax

import optax_lamb
from optax_lamb.backends.pallas_mosaic_gpu import MosaicBlockSizes, PallasMosaicGpuBackend
from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend
from optax_lamb.backends.xla import XlaBackend
from optax_lamb.step._update_and_apply import FusableTransformation


@contextlib.contextmanager
def _no_fallback():
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=r"(?i).*xla path")  # the kernels ran, no fallback
    warnings.filterwarnings("ignore", message=".*interpret mode")
    yield


PALLAS_BLOCKS = BlockSizes(
  block=128, max_leaves_per_call=3, num_warps=4, sum_block=16, xla_pass2_min_size=256
)
EIGHT_BIT_BLOCKS = BlockSizes(
  block=512, max_leaves_per_call=3, num_warps=4, sum_block=16, xla_pass2_min_size=4096
)
TINY_BLOCKS = BlockSizes(
  block=16, max_leaves_per_call=2, num_warps=4, sum_block=16, xla_pass2_min_size=48
)
MOSAIC_BLOCKS = MosaicBlockSizes(block=256, xla_pass2_min_size=1024)

# name: (lamb's implementation argument, the context its steps are traced in)
_CONFIGURATIONS = {
  "xla": ("xla", contextlib.nullcontext),
  "xla-one-device": (XlaBackend(joint_small_sums=True), contextlib.nullcontext),
  "xla-large-tree": (XlaBackend(materialize_u_max_size=0), contextlib.nullcontext),
  "pallas": (PallasTritonBackend(block_sizes=PALLAS_BLOCKS, interpret=True), _no_fallback),
  "pallas-tiny-blocks": (
    PallasTritonBackend(block_sizes=TINY_BLOCKS, interpret=True),
    _no_fallback,
  ),
  "pallas-8bit": (PallasTritonBackend(block_sizes=EIGHT_BIT_BLOCKS, interpret=True), _no_fallback),
  "pallas-8bit-compiled": (
    PallasTritonBackend(block_sizes=EIGHT_BIT_BLOCKS, interpret=False),
    _no_fallback,
  ),
  "pallas-compiled": (
    PallasTritonBackend(block_sizes=PALLAS_BLOCKS, interpret=False),
    _no_fallback,
  ),
  "pallas-mosaic-gpu": (
    PallasMosaicGpuBackend(block_sizes=MOSAIC_BLOCKS, interpret=True),
    _no_fallback,
  ),
  "pallas-mosaic-gpu-compiled": (
    PallasMosaicGpuBackend(block_sizes=MOSAIC_BLOCKS, interpret=False),
    _no_fallback,
  ),
  "reference": ("reference", contextlib.nullcontext),
}
IMPLEMENTATIONS = tuple(_CONFIGURATIONS)


def _traced_in(context: Callable, fn: Callable) -> Callable:
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with context():
      return fn(*args, **kwargs)

  return wrapped


def lamb_for(implementation: str) -> Callable[..., optax.GradientTransformationExtraArgs]:
  """``optax_lamb.lamb`` (same arguments) for one of `IMPLEMENTATIONS`.

  Also a factory for ``optax.inject_hyperparams``.
  """
  if implementation not in _CONFIGURATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  name, context = _CONFIGURATIONS[implementation]

  @functools.wraps(optax_lamb.lamb)
  def make(*args, **kwargs) -> optax.GradientTransformationExtraArgs:
    tx = optax_lamb.lamb(*args, implementation=name, **kwargs)
    if context is contextlib.nullcontext:
      return tx
    update = _traced_in(context, tx.update)
    fused = getattr(tx, "fused_apply", None)
    if fused is not None:
      return FusableTransformation(tx.init, update, _traced_in(context, fused))
    return optax.GradientTransformationExtraArgs(tx.init, update)

  signature = inspect.signature(optax_lamb.lamb)  # less `implementation`: this factory sets it
  make.__signature__ = signature.replace(
    parameters=[p for p in signature.parameters.values() if p.name != "implementation"]
  )
  return make
