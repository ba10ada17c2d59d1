"""One LAMB step with 8-bit block-wise quantized moments, in float64 NumPy, for the tests.

Dettmers et al. (ICLR 2022), section 2, applied to LAMB (You et al. 2019, Algorithm 2):
dequantize the stored moments, take the step in full precision, quantize the new
moments. The quantization is `helpers.quantize_reference` (the code tables built from
the paper, a nearest-value search); the step is written out here, with no code shared
with the library. A leaf is stored quantized where it has 4,096 elements or more, a
last axis longer than 1 and at least one axis (the library's `quantizes`, restated);
else float32.

The state of one leaf is ``("q", codes, scales)`` or ``("f", float32 array)`` per moment.
"""

from __future__ import annotations

import numpy as np
from helpers import quantize_reference as qref

MIN_SIZE, BLOCK = 4096, 256


def quantized(shape: tuple) -> bool:
  if not shape or int(np.prod(shape)) < MIN_SIZE:
    return False
  blocks = -(-shape[-1] // BLOCK)
  return int(np.prod(shape)) + 4 * int(np.prod(shape[:-1])) * blocks < 4 * int(np.prod(shape))


def load(stored: tuple, signed: bool) -> np.ndarray:
  """A stored moment in float64: the codes' table values times their block scales."""
  if stored[0] == "q":
    return qref.dequantize(stored[1], stored[2], signed)
  return np.asarray(stored[1], np.float64)


def store(x: np.ndarray, shape: tuple, signed: bool) -> tuple:
  """A float64 moment as stored: quantized where the leaf is large enough (with the float64
  values it was quantized from, last), else float32."""
  if quantized(shape):
    codes, scales = qref.quantize(x, signed)
    return ("q", codes, scales, np.asarray(x, np.float64))
  return ("f", np.asarray(x, np.float32))


def lamb_step(p, g, mu, nu, t, *, lr, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0,
              decay=True, adapt=True, stacked_axes=0) -> tuple:  # fmt: skip
  """(update, new mu, new nu, ratios) of one leaf at step t (1-based), all float64.

  The moments are computed from the dequantized stored ones and used unrounded in u; only
  what is stored is quantized. The ratio is per stacked slice: ||p|| / ||u||, 1 where
  either norm is 0.
  """
  p, g = np.asarray(p, np.float64), np.asarray(g, np.float64)
  m = b1 * load(mu, True) + (1 - b1) * g
  v = b2 * load(nu, False) + (1 - b2) * g * g
  u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
  if decay:
    u = u + weight_decay * p
  k = stacked_axes
  axes = tuple(range(k, p.ndim))
  ratio = np.ones(p.shape[:k])
  if adapt:
    pn, un = np.sqrt(np.sum(p * p, axis=axes)), np.sqrt(np.sum(u * u, axis=axes))
    zero = (pn == 0) | (un == 0)
    ratio = np.where(zero, 1.0, pn / np.where(zero, 1.0, un))
  r = np.reshape(ratio, ratio.shape + (1,) * (p.ndim - k))
  return -lr * r * u, store(m, p.shape, True), store(v, p.shape, False), ratio


def moment_terms(mu: tuple, g: np.ndarray, b: float, square: bool) -> np.ndarray:
  """b |stored| + (1 - b) |g| (or g^2): the size of the terms whose float32 sum is the new
  moment, what its float32 rounding error scales with."""
  g = np.asarray(g, np.float64)
  return b * np.abs(load(mu, not square)) + (1 - b) * (g * g if square else np.abs(g))
