"""A leaf's operands as the kernels take them: flat, an array or an 8-bit moment's two arrays.

A moment stored 8-bit block-wise quantized (``mu_dtype=jnp.int8``,
``nu_dtype=jnp.uint8``: `optax_lamb.core._quantize`) is passed as its codes and its
float32 scales; these helpers reshape both alike (the rows of both shapes hold
whole quantization blocks where a kernel set takes them).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from optax_lamb import _interop
from optax_lamb.core import _quantize
from optax_lamb.core._quantize import QuantizedMoment


def shape(x) -> tuple[int, ...]:
  """The shape of an operand: an array's, or a quantized moment's (its codes', checked against
  its scales')."""
  if not isinstance(x, QuantizedMoment):
    return tuple(jnp.shape(x))
  codes = tuple(jnp.shape(x.codes))
  if not codes or tuple(jnp.shape(x.scales)) != _quantize.scales_shape(codes):
    raise ValueError(f"codes {codes} and scales {jnp.shape(x.scales)}: one scale per block")
  return codes


def reshape(x, new_shape: tuple[int, ...]) -> Any:
  """`x` in `new_shape`; a quantized moment's codes in `new_shape`, its scales one per block of its
  last axis (the same blocks, where the rows of both shapes hold whole blocks)."""
  if isinstance(x, QuantizedMoment):
    scales = jnp.reshape(x.scales, _quantize.scales_shape(new_shape))
    return QuantizedMoment(jnp.reshape(x.codes, new_shape), scales)
  return jnp.reshape(x, new_shape)


def flat(x) -> Any:
  """`x` (an array or a quantized moment) 1-D, as the kernels take their operands."""
  return reshape(x, (math.prod(shape(x)),))


def dtype(x) -> jnp.dtype:
  """An operand's dtype; for a quantized moment its scales' (float32; the kernels read its codes)."""
  return jnp.dtype((x.scales if isinstance(x, QuantizedMoment) else x).dtype)


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """ShapeDtypeStruct with `like`'s manual-axis type (for a pallas_call inside shard_map)."""
  return _interop.shape_dtype_like(shape, dtype, like)


def out_like(x) -> Any:
  """`out_struct` of each array of `x` (an array, or a quantized moment's two)."""
  return jax.tree.map(lambda a: out_struct(a.shape, a.dtype, a), x)
