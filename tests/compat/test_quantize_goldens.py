"""optax_lamb.core._quantize against bitsandbytes' quantize_blockwise, recorded by
record_quantize_goldens.py (bitsandbytes 0.50.2 on the CPU, block 256).

Where the designs coincide (the same dynamic maps, absmax scales, blocks of 256 along a
1-D leaf or a last axis that is a multiple of 256) the results agree, with two differences:
the tables differ in the last float32 bit or two (bitsandbytes builds them with float32
linspace arithmetic), and bitsandbytes' CPU kernel first rounds x / absmax to a grid of
65,536 points on [-1, 1] and takes the code nearest to the grid point (a lookup table), so
its code differs from the nearest one where a midpoint between codes lies within half a grid
step (1.5e-5) of x / absmax, which includes every value below about 1e-5 of its block's
absmax. `bitsandbytes_cpu_index` transcribes that rule and reproduces every recorded index.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import quantize_reference as ref

from optax_lamb.core import _quantize as q

GOLDENS = Path(__file__).resolve().parent / "goldens"
GRID = 65535  # bitsandbytes' lookup table: 65,536 points on [-1, 1]
META = json.loads((GOLDENS / "bitsandbytes_quantize.json").read_text())
CASES = sorted(META["cases"])
quantize = jax.jit(q.quantize, static_argnums=1)
dequantize = jax.jit(q.dequantize, static_argnums=2)


@pytest.fixture(scope="module")
def goldens() -> dict[str, np.ndarray]:
  with np.load(GOLDENS / "bitsandbytes_quantize.npz") as f:
    return dict(f)


def bitsandbytes_cpu_index(x: np.ndarray, absmax: np.ndarray, code: np.ndarray) -> np.ndarray:
  """bitsandbytes' CPU quantize in float32: x * (1 / absmax) to the nearest grid point, then
  the number of table midpoints below that point."""
  x = x.reshape(-1, 256) if x.size % 256 == 0 else np.pad(x, (0, 256 - x.size % 256))
  y = x.reshape(-1, 256) * (np.float32(1) / absmax.astype(np.float32))[:, None]
  y = np.clip(y, np.float32(-1), np.float32(1))
  point = ((y + np.float32(1)) * np.float32(0.5) * np.float32(GRID) + np.float32(0.5)).astype(
    np.uint16
  )
  grid = np.float32(-1) + (np.float32(2) * point.astype(np.float32)) / np.float32(GRID)
  mids = np.float32(0.5) * (code[:-1] + code[1:])
  return np.searchsorted(mids, grid, side="left").ravel()


def ours(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  leaf = x if x.ndim > 1 else x[None, :]
  codes, scales = quantize(jnp.asarray(leaf), signed)
  index = ref.code_to_index(np.asarray(codes), signed).reshape(x.shape)
  return index, np.asarray(scales).ravel(), leaf


@pytest.mark.parametrize("signed", [True, False])
def test_tables_agree_to_two_ulp(goldens, signed) -> None:
  code = goldens[f"{'signed' if signed else 'unsigned'}/code"]
  mine = q.decode(jnp.asarray(ref.index_to_code(np.arange(256), signed)), 1.0, signed=signed)
  np.testing.assert_allclose(np.asarray(mine), code, rtol=2 * 2.0**-23, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_bitsandbytes_cpu_kernel_is_the_grid_rule(goldens, case) -> None:
  signed = META["cases"][case]["signed"]
  code = goldens[f"{'signed' if signed else 'unsigned'}/code"]
  x, index = goldens[f"{case}/x"], goldens[f"{case}/index"]
  expected = bitsandbytes_cpu_index(x.ravel(), goldens[f"{case}/absmax"], code)
  np.testing.assert_array_equal(index.ravel(), expected[: x.size])


@pytest.mark.parametrize("case", CASES)
def test_codes_and_scales_agree_away_from_the_grid(goldens, case) -> None:
  signed = META["cases"][case]["signed"]
  x, index = goldens[f"{case}/x"], goldens[f"{case}/index"].astype(np.int64)
  mine, scales, leaf = ours(x, signed)
  np.testing.assert_array_equal(scales, goldens[f"{case}/absmax"])
  y = ref.ratios(leaf, scales.reshape(leaf.shape[0], -1)).reshape(x.shape)
  table = ref.code_table(signed)
  mids = (table[:-1] + table[1:]) / 2
  clear = np.min(np.abs(y[..., None] - mids), axis=-1) > 2.0 / GRID  # no midpoint in reach
  assert np.mean(clear) > 0.3
  np.testing.assert_array_equal(mine[clear], index[clear])
  # and the dequantized values, where the codes agree: the tables' last bits
  back = np.asarray(dequantize(*quantize(jnp.asarray(leaf), signed), signed)).reshape(x.shape)
  same = mine == index
  golden = goldens[f"{case}/dequantized"]
  np.testing.assert_allclose(back[same], golden[same], rtol=4 * 2.0**-23, atol=0)
