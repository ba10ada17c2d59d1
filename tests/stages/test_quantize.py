"""Block-wise dynamic quantization (optax_lamb.core._quantize) against the float64 reference.

Codes must equal the reference's nearest codes except near a tie: where x / s lies
within 2^-21 (relative) of a midpoint between two codes, float32 rounding of the
midpoint may pick either neighbour (the float64 reference sees the exact midpoint).
Scales are the block absmax, exact in float32, so they must equal the reference's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import quantize_reference as ref
from helpers import seeds
from hypothesis import given, settings
from hypothesis import strategies as st

from optax_lamb.core import _quantize as q

SIGNS = [True, False]
NEAR_TIE = 2.0**-21  # a few float32 ulps, relative
quantize = jax.jit(q.quantize, static_argnames=("signed", "block_size"))
dequantize = jax.jit(q.dequantize, static_argnames=("signed", "block_size"))
encode = jax.jit(q.encode, static_argnames="signed")
decode = jax.jit(q.decode, static_argnames="signed")


def check_against_reference(
  x: np.ndarray, signed: bool, block_size: int = 256
) -> tuple[np.ndarray, np.ndarray]:
  """Quantizes x with the library and the reference; returns (codes, scales) after checking."""
  codes, scales = quantize(jnp.asarray(x), signed=signed, block_size=block_size)
  codes, scales = np.asarray(codes), np.asarray(scales)
  ref_codes, ref_scales = ref.quantize(x, signed, block_size)
  assert codes.dtype == (np.int8 if signed else np.uint8) and codes.shape == x.shape
  assert scales.dtype == np.float32 and scales.shape == q.scales_shape(x.shape, block_size)
  np.testing.assert_array_equal(scales.astype(np.float64), ref_scales)
  y = ref.ratios(x, ref_scales, block_size)
  index, ref_index = ref.code_to_index(codes, signed), ref.code_to_index(ref_codes, signed)
  differ = index != ref_index
  near = ref.distance_to_midpoint(y[differ], signed) <= NEAR_TIE
  assert np.all(near & (np.abs(index[differ] - ref_index[differ]) == 1)), (
    f"{np.sum(differ & ~np.isnan(y))} codes differ, not at ties: y={y[differ][~near][:5]}"
  )
  return codes, scales


def check_error_bound(x: np.ndarray, signed: bool, block_size: int = 256) -> float:
  """|dequantize(quantize(x)) - x| <= half the gap between the codes around x / s (times s)."""
  codes, scales = quantize(jnp.asarray(x), signed=signed, block_size=block_size)
  back = np.asarray(dequantize(codes, scales, signed=signed, block_size=block_size), np.float64)
  s = ref.element_scales(np.asarray(scales, np.float64), x.shape[-1], block_size)
  y = x.astype(np.float64) / np.where(s > 0, s, 1)
  # + the float32 normal range's bottom: products below it are flushed to zero
  bound = ref.half_gap(y, signed) * s * (1 + 1e-6) + NEAR_TIE * s + np.finfo(np.float32).tiny
  err = np.abs(back - x)
  assert np.all(err <= bound), np.max(err / bound)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.max(err / (ref.half_gap(y, signed) * s), initial=0.0, where=s > 0)


def test_code_maps_are_the_dynamic_tree_maps() -> None:
  for signed in SIGNS:
    table = ref.code_table(signed)
    index = np.arange(256)
    codes = jnp.asarray(ref.index_to_code(index, signed))
    values = np.asarray(decode(codes, jnp.float32(1.0), signed=signed), np.float64)
    np.testing.assert_allclose(values, table, rtol=2**-22, atol=0)  # float32 rounding only
    assert values[0 if not signed else 127] == 0.0 and values[255] == 1.0
    assert np.all(np.diff(values) > 0)
    # every code value encodes to its own code (codes are fixed points)
    np.testing.assert_array_equal(
      encode(jnp.asarray(values, jnp.float32), jnp.float32(1.0), signed=signed), codes
    )


def test_signed_codes_are_sign_and_magnitude() -> None:
  codes = jnp.arange(-127, 128, dtype=jnp.int8)
  values = np.asarray(decode(codes, jnp.float32(1.0), signed=True))
  np.testing.assert_array_equal(values[:127], -values[128:][::-1])  # codes -127..-1 and 127..1
  assert decode(jnp.int8(-128), jnp.float32(1.0), signed=True) == 1.0 and -1.0 not in values


@pytest.mark.parametrize("signed", SIGNS)
def test_encode_at_every_midpoint(signed) -> None:
  """Around each midpoint (and a quarter-gap away) the code is the nearest, at several scales."""
  table = ref.code_table(signed)
  mids = (table[:-1] + table[1:]) / 2
  gaps = np.diff(table)
  probes = [mids * (1 + k * 2.0**-20) for k in (-4, -1, 0, 1, 4)]
  probes += [mids - gaps / 4, mids + gaps / 4]
  for scale in (1.0, 1.5, 1.9999999, 3.0e-20, 7.0e25):
    x = np.concatenate(probes) * scale
    x = np.concatenate([x, [scale]]).astype(np.float32)  # the block's max: the scale
    for block in (x.size,):
      check_against_reference(x[None, :], signed, block_size=block)


@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 600, 3072])
def test_odd_last_axes_match_the_reference(signed, n, rng) -> None:
  x = ref.moment_like(rng, (3, n), signed)
  check_against_reference(x, signed)
  check_error_bound(x, signed)


@pytest.mark.parametrize("signed", SIGNS)
def test_worst_error_matches_the_spacing(signed, rng) -> None:
  """Dense uniform blocks reach the bound: the largest error is half the local code gap."""
  x = rng.uniform(-1 if signed else 0, 1, size=(64, 1024)).astype(np.float32)
  assert check_error_bound(x, signed) > 0.95
  codes, scales = quantize(jnp.asarray(x), signed=signed)
  err = np.abs(np.asarray(dequantize(codes, scales, signed=signed)) - x)
  top = np.max(np.diff(ref.code_table(signed))) / 2  # half a bin of the top decade
  assert np.isclose(top, 0.45 / (64 if signed else 128))  # docs/quantized_moments.md
  per_block = (err.reshape(64, 4, 256).max(-1) / np.asarray(scales)).max()
  assert top * 0.9 < per_block <= top * (1 + 1e-5)


@pytest.mark.parametrize("signed", SIGNS)
def test_zeros(signed) -> None:
  x = np.zeros((2, 700), np.float32)
  x[1, 300:310] = 0.5
  codes, scales = check_against_reference(x, signed)
  zero = q.zeros((2, 700), signed)
  np.testing.assert_array_equal(codes[0], zero.codes[0])
  np.testing.assert_array_equal(scales, [[0, 0, 0], [0, 0.5, 0]])
  back = np.asarray(dequantize(codes, scales, signed=signed))
  np.testing.assert_array_equal(back[0], 0)
  zeros = quantize(jnp.zeros((3, 257)), signed=signed)
  for a, b in zip(zeros, q.zeros((3, 257), signed), strict=True):
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype


@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1e20, 1e30, 3.0e38])
def test_tiny_and_huge_magnitudes(signed, magnitude, rng) -> None:
  x = ref.moment_like(rng, (4, 300), signed, magnitude=magnitude / (10.0 if signed else 100.0))
  x[0, 0] = magnitude  # the extreme itself, in range
  check_against_reference(x, signed)
  check_error_bound(x, signed)


@pytest.mark.parametrize("signed", SIGNS)
def test_codes_do_not_depend_on_the_scale_exponent(signed, rng) -> None:
  """Scaling a leaf by 2^k scales its scales by 2^k and leaves its codes (normalisation is exact)."""
  x = ref.moment_like(rng, (4, 512), signed)
  x[np.abs(x) < 1e-6 * np.abs(x).max()] = 0.0  # none leaves the normal range (flushed) at 2^-100
  codes, scales = quantize(jnp.asarray(x), signed=signed)
  for k in (-100, -60, 60, 100):
    other = quantize(jnp.asarray(x * np.float32(2.0**k)), signed=signed)
    np.testing.assert_array_equal(other.codes, codes)
    np.testing.assert_array_equal(other.scales, np.asarray(scales) * np.float32(2.0**k))


@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_element_makes_its_block_nan(signed, bad, rng) -> None:
  x = ref.moment_like(rng, (2, 600), signed)
  x[1, 300] = bad
  codes, scales = check_against_reference(x, signed)
  assert np.isnan(scales[1, 1]) and np.all(np.isfinite(np.delete(scales.ravel(), 4)))
  np.testing.assert_array_equal(codes[1, 256:512], 0)
  back = np.asarray(dequantize(codes, scales, signed=signed))
  assert np.all(np.isnan(back[1, 256:512]))
  assert np.all(np.isfinite(back[0])) and np.all(np.isfinite(np.delete(back[1], np.s_[256:512])))


def test_negative_inputs_to_the_unsigned_map_round_to_zero() -> None:
  x = np.array([[1.0, -0.5, 0.25, -2.0]], np.float32)
  codes, scales = check_against_reference(x, signed=False)
  assert scales[0, 0] == 2.0 and codes[0, 1] == 0 and codes[0, 3] == 0


@pytest.mark.parametrize("signed", SIGNS)
def test_requantizing_dequantized_values(signed, rng) -> None:
  """Lossless where a block's extreme is coded as 1.0; not where a signed block's extreme is
  negative (the map has no -1.0): a skipped step must keep the stored arrays, not requantize."""
  x = ref.moment_like(rng, (8, 512), signed)
  x[:, ::256] = np.abs(x).max() * 2  # every block's extreme is positive
  codes, scales = quantize(jnp.asarray(x), signed=signed)
  again = quantize(dequantize(codes, scales, signed=signed), signed=signed)
  np.testing.assert_array_equal(again.codes, codes)
  np.testing.assert_array_equal(again.scales, scales)
  if signed:
    x[:, ::256] *= -1
    codes, scales = quantize(jnp.asarray(x), signed=signed)
    again = quantize(dequantize(codes, scales, signed=signed), signed=signed)
    assert np.all(np.asarray(again.scales) < np.asarray(scales))


def test_eager_and_jit_agree_bit_for_bit(rng) -> None:
  x = jnp.asarray(ref.moment_like(rng, (3, 300), signed=True))
  for signed in SIGNS:
    xs = x if signed else x * x
    eager = q.quantize(xs, signed)
    jitted = quantize(xs, signed=signed)
    np.testing.assert_array_equal(eager.codes, jitted.codes)
    np.testing.assert_array_equal(eager.scales, jitted.scales)


@pytest.mark.parametrize("signed", SIGNS)
def test_the_kernels_plain_max_gives_the_same_codes_and_scales(signed, rng) -> None:
  """``one_reduction=False`` (the scales by `block_scale`'s plain max, as in the Pallas kernels)
  against the variadic reduction of the XLA path, bit for bit: zeros, a partial last block,
  blocks holding NaN, an infinity, the largest float32."""
  x = ref.moment_like(rng, (4, 700), signed)
  x[0, :256] = 0
  x[1, 3], x[2, 300], x[3, 600] = np.nan, -np.inf if signed else np.inf, np.finfo(np.float32).max
  plain = jax.jit(functools.partial(q.quantize, signed=signed, one_reduction=False))
  for got, want in zip(plain(jnp.asarray(x)), quantize(jnp.asarray(x), signed=signed), strict=True):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_encode_and_decode_are_gather_free_elementwise_arithmetic() -> None:
  """What a Pallas kernel can run on a loaded block: no gathers, sorts or searches."""
  x, s = jnp.ones((4, 256)), jnp.ones((4, 1))
  for signed in SIGNS:
    codes = jnp.zeros(x.shape, jnp.int8 if signed else jnp.uint8)
    for jaxpr in (jax.make_jaxpr(functools.partial(q.encode, signed=signed))(x, s),
                  jax.make_jaxpr(functools.partial(q.decode, signed=signed))(codes, s)):  # fmt: skip
      names = {e.primitive.name for e in jaxpr.jaxpr.eqns}
      assert not names & {"gather", "dynamic_slice", "sort", "scatter", "while", "cond"}, names


SHAPES = [(1,), (7,), (2, 255), (3, 256), (2, 257), (2, 2, 130)]


@st.composite
def leaves(draw: st.DrawFn) -> np.ndarray:
  """A leaf of moment-like or adversarial values: rows of random magnitudes, zeros, repeats."""
  shape = draw(st.sampled_from(SHAPES))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  exponents = rng.uniform(-35, 35, size=(*shape[:-1], 1))
  spread = draw(st.sampled_from([0.0, 2.0, 12.0]))  # decades of spread within a row
  x = rng.normal(size=shape) * 10.0 ** (exponents - rng.uniform(0, spread, size=shape))
  x = np.where(rng.uniform(size=shape) < 0.1, 0.0, x)
  x = np.where(rng.uniform(size=shape) < 0.1, x.flat[0], x)
  special = draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False,
                                    allow_subnormal=False), max_size=4))  # fmt: skip
  x.flat[: len(special)] = special
  return np.clip(x, -3e38, 3e38).astype(np.float32)


@settings(max_examples=seeds.examples(25))
@given(x=leaves(), signed=st.booleans(), block_size=st.sampled_from([2, 128, 256]))
def test_random_leaves_match_the_reference(x, signed, block_size) -> None:
  x = x if signed else np.abs(x)
  check_against_reference(x, signed, block_size)
  check_error_bound(x, signed, block_size)
