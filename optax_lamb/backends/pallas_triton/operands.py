"""A leaf's operands in the Triton kernels: a chunk of them loaded and stored, 8-bit moments.

The kernels take each leaf's arrays flat (1-D, `optax_lamb.backends.gpu.arrays`)
and load one chunk of ``block`` elements per program (`common.chunk`). A moment stored 8-bit block-wise
quantized (``mu_dtype=jnp.int8``, ``nu_dtype=jnp.uint8``: `optax_lamb.core._quantize`)
is passed as its two arrays, the codes and the float32 scales, both flat: a
program loads the chunk's codes and the scales of its blocks, which `_leaf`
dequantizes in registers as a 1-D leaf; pass 2 writes the chunk's new codes and
scales back in place, requantized by `_quantize`'s own functions (a chunk's
blocks are a 1-D leaf's), so the codes and scales are the XLA path's.

That needs every quantization block (256 elements along the last axis) whole
in one chunk: the kernels take 8-bit moments of a leaf whose last axis is a
multiple of 256 and not a stacked axis, with ``BlockSizes.block`` a multiple of
256 (the default 4096 is). Then every row holds whole blocks, element e's scale
is scale e // 256 of the flat scales, and a chunk (a multiple of 256 elements
from a slice's start, a slice a multiple of 256) holds whole blocks, its masked
tail too. Other leaves with 8-bit moments (a last axis such as 300 or 30522,
whose last block is partial) are declined (`unsupported_reason`, naming the
shape): the step then runs on the XLA path. Leaves too small to quantize keep
float32 moments and need nothing here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_lamb.backends.pallas_triton import common
from optax_lamb.backends.pallas_triton.common import Chunk
from optax_lamb.core import _quantize
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.step._plan import LeafPlan

BLOCK = _quantize.BLOCK_SIZE


def unsupported_reason(leaf: LeafPlan, block: int) -> str | None:
  """Why the kernels cannot take this leaf's 8-bit quantized moments (None: they can)."""
  if block % BLOCK:
    return (
      f"8-bit quantized moments with BlockSizes(block={block}): the kernels need a multiple of "
      f"{BLOCK}, so that a chunk holds whole quantization blocks"
    )
  if leaf.shape[-1] % BLOCK or leaf.stacked_axes >= len(leaf.shape):
    what = "a stacked last axis" if leaf.shape[-1] % BLOCK == 0 else "a partial last block"
    return (
      f"8-bit quantized moments of a leaf of shape {leaf.shape} ({what}): the kernels take "
      f"those whose last axis is a multiple of {BLOCK} and not stacked"
    )
  return None


def _scales_window(ch: Chunk, block: int) -> tuple[jax.Array, jax.Array, int]:
  """(offset, mask, size) of a chunk's scales in a quantized moment's flat scales: the chunk
  holds whole blocks (`unsupported_reason`), so element e's scale is scale e // BLOCK."""
  mask = ch.within + BLOCK * jnp.arange(block // BLOCK, dtype=jnp.int32) < ch.length
  return jax.lax.div(ch.start, jnp.int32(BLOCK)), mask, block // BLOCK


def load(ref, ch: Chunk, block: int) -> Any:
  """A chunk of one named operand: its values, or a quantized moment's codes and its blocks'
  scales (a `QuantizedMoment` of the chunk, which `_quantize` dequantizes as a 1-D leaf)."""
  if not isinstance(ref, QuantizedMoment):
    return common.load(ref, ch.start, ch.mask, block)
  start, mask, size = _scales_window(ch, block)
  codes = common.load(ref.codes, ch.start, ch.mask, block)
  return QuantizedMoment(codes, common.load(ref.scales, start, mask, size))


def store(ref, ch: Chunk, block: int, value) -> None:
  """`load`'s inverse: a chunk of values, or a quantized moment's codes and its blocks' scales."""
  if not isinstance(ref, QuantizedMoment):
    common.store(ref, ch.start, ch.mask, block, value)
    return
  start, mask, size = _scales_window(ch, block)
  common.store(ref.codes, ch.start, ch.mask, block, value.codes)
  common.store(ref.scales, start, mask, size, value.scales)
