"""Block-wise dynamic quantization in float64 NumPy, written from the paper, for the tests
(and `moment_like`, the moment-shaped leaves they quantize).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022),
section 2: the dynamic tree data type (a decade exponent and a linear fraction)
and block-wise absmax scaling. The code table is built the way the paper
describes it, as bin midpoints per decade, with no use of the closed forms of
``optax_lamb.core._quantize``; encoding is a search for the nearest table value.

Storage conventions this reference shares with the library (they are its
documented layout, not its algorithm): blocks along the last axis; unsigned
codes are table indices (uint8); signed codes are int8, index k stored as
k - 127, with index 255 (the value +1.0) stored as -128.
"""

from __future__ import annotations

import numpy as np

DECADES = 7


def code_table(signed: bool) -> np.ndarray:
  """The 256 code values in increasing order, float64."""
  values = [0.0, 1.0]
  for i in range(DECADES):
    bins = 2**i if signed else 2 ** (i + 1)  # the unsigned map spends the sign bit on precision
    edges = np.linspace(0.1, 1.0, bins + 1)
    means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
    values += list(means) + (list(-means) if signed else [])
  table = np.sort(np.array(values))
  assert table.shape == (256,) and np.all(np.diff(table) > 0)
  return table


def index_to_code(index: np.ndarray, signed: bool) -> np.ndarray:
  """Table indices (0..255) to stored codes."""
  index = np.asarray(index, np.int64)
  if not signed:
    return index.astype(np.uint8)
  return np.where(index == 255, -128, index - 127).astype(np.int8)


def code_to_index(codes: np.ndarray, signed: bool) -> np.ndarray:
  codes = np.asarray(codes).astype(np.int64)
  return (codes + 127) % 256 if signed else codes


def nearest_index(y: np.ndarray, signed: bool) -> np.ndarray:
  """Index of the table value nearest to each y (float64); a tie goes to the smaller magnitude."""
  table = code_table(signed)
  mids = (table[:-1] + table[1:]) / 2
  lower = np.searchsorted(mids, y, side="left")  # a tie (y on a midpoint) goes down
  upper = np.searchsorted(mids, y, side="right")  # a tie goes up
  # A tie takes the smaller magnitude: the upper neighbour where the lower one is negative.
  return np.where((lower != upper) & (table[lower] < 0), upper, lower)


def _blocks(x: np.ndarray, block_size: int) -> tuple[np.ndarray, int]:
  n = x.shape[-1]
  blocks = -(-n // block_size)
  padded = np.zeros((*x.shape[:-1], blocks * block_size), x.dtype)
  padded[..., :n] = x
  return padded.reshape(*x.shape[:-1], blocks, block_size), n


def quantize(x: np.ndarray, signed: bool, block_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
  """(codes, scales): scales the float64 absmax per block (NaN where the block is not finite)."""
  x = np.asarray(x, np.float64)
  x = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x)  # float32 subnormals are flushed
  xb, n = _blocks(x, block_size)
  finite = np.all(np.isfinite(xb), axis=-1)
  scales = np.where(finite, np.max(np.abs(np.where(np.isfinite(xb), xb, 0)), axis=-1), np.nan)
  safe = np.where(finite & (scales > 0), scales, 1.0)[..., None]
  y = np.where(np.isfinite(xb), xb, 0) / safe
  index = nearest_index(y, signed)
  zero = np.searchsorted(code_table(signed), 0.0)
  index = np.where((finite & (scales > 0))[..., None], index, zero)
  codes = index_to_code(index, signed).reshape(*x.shape[:-1], -1)[..., :n]
  return codes, scales


def dequantize(
  codes: np.ndarray, scales: np.ndarray, signed: bool, block_size: int = 256
) -> np.ndarray:
  values = code_table(signed)[code_to_index(codes, signed)]
  vb, n = _blocks(values, block_size)
  return (vb * np.asarray(scales, np.float64)[..., None]).reshape(*codes.shape[:-1], -1)[..., :n]


def element_scales(scales: np.ndarray, n: int, block_size: int = 256) -> np.ndarray:
  """Each element's block scale: scales repeated along the last axis, cut to n."""
  return np.repeat(np.asarray(scales), block_size, axis=-1)[..., :n]


def ratios(x: np.ndarray, scales: np.ndarray, block_size: int = 256) -> np.ndarray:
  """x / its block's scale, float64, x's shape."""
  s = element_scales(np.asarray(scales, np.float64), x.shape[-1], block_size)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.asarray(x, np.float64) / s


def half_gap(y: np.ndarray, signed: bool) -> np.ndarray:
  """Half the distance between the two table values around each y: the largest rounding error."""
  table = code_table(signed)
  k = np.clip(np.searchsorted(table, y, side="right"), 1, 255)
  return (table[k] - table[k - 1]) / 2


def distance_to_midpoint(y: np.ndarray, signed: bool) -> np.ndarray:
  """|y - m| / |m| for the table midpoint m nearest to y: how close y is to a tie."""
  table = code_table(signed)
  mids = (table[:-1] + table[1:]) / 2
  k = np.clip(np.searchsorted(mids, y), 1, 254)
  near = np.minimum(
    np.abs(y - mids[k - 1]) / np.abs(mids[k - 1]), np.abs(y - mids[k]) / np.abs(mids[k])
  )
  return near


def moment_like(
  rng: np.random.Generator, shape: tuple, signed: bool, magnitude: float = 1.0
) -> np.ndarray:
  """Values of one moment leaf: rows of different magnitudes, some exact zeros."""
  x = rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 1, size=(*shape[:-1], 1))
  x = np.where(rng.uniform(size=shape) < 0.02, 0.0, x)
  x = x if signed else x**2
  return np.asarray(x * magnitude, np.float32)
