"""8-bit quantized moments (mu_dtype=int8, nu_dtype=uint8) against a float64 NumPy transcription.

`helpers.lamb8bit_reference` dequantizes the stored moments, takes the LAMB (or Adam) step in
float64 and quantizes the new moments with `helpers.quantize_reference` (the code tables of
the paper, a nearest-value search; checked against bitsandbytes' goldens in
tests/compat/test_quantize_goldens.py). Each step starts both from the library's state, so
the comparison is one step deep however many steps run, and checks:

* scales: the float32 block absmax of the new moment, equal to the float64 one up to the
  float32 rounding of the moment's two terms (8 ulp of b |m| + (1 - b) |g|, per element);
* codes: equal, except next to a midpoint between two codes, where that same rounding may
  pick the neighbour (the codes then differ by one index);
* leaves too small to quantize: float32, equal to the float64 moments up to that rounding;
* updates: equal up to float32 rounding of u (relative 2e-5 of the leaf's largest element:
  u divides by sqrt(v), and the trust ratio is a ratio of two float32 norms).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import lamb8bit_reference as ref
from helpers import quantize_reference as qref

import optax_lamb
from optax_lamb.backends.xla import XlaBackend
from optax_lamb.core._quantize import QuantizedMoment

EPS32 = float(np.finfo(np.float32).eps)
SHAPES = {
  "w": (24, 300),  # two blocks a row, the second partial
  "stack": (3, 8, 256),  # stacked layers (stacked_axes 1): whole blocks in each slice
  "emb": (5000,),  # 1-D, the last block partial
  "rows": (64, 64),  # 4,096 elements: one block a row
  "b": (7,),  # small: float32
  "s": (),  # 0-d: float32
  "e": (0, 4),  # empty: float32
  "col": (5000, 1),  # a last axis of 1: float32 (codes and scales would not be smaller)
}
QUANTIZED = {"w", "stack", "emb", "rows"}
DECAY = {"b": False, "rows": False}
ADAPT = {"emb": False}
STACKED = {"stack": 1}


def tree(rng, scale=1.0, zero_rows=False):
  out = {}
  for k, shape in SHAPES.items():
    x = rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 1, size=shape[:-1] + (1,) if shape else ())
    if zero_rows and len(shape) == 2 and shape[0] > 4:
      x[:2] = 0  # blocks of zeros: scale 0
    out[k] = jnp.asarray(x * scale, jnp.float32)
  return out


def as_ref(stored):
  if isinstance(stored, QuantizedMoment):
    return ("q", np.asarray(stored.codes), np.asarray(stored.scales, np.float64))
  return ("f", np.asarray(stored, np.float64))


def check_moment(got, want, terms, signed, name):
  assert isinstance(got, QuantizedMoment) == (want[0] == "q") == (name in QUANTIZED), name
  if want[0] == "f":
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), want[1], rtol=0,
                               atol=0 if not terms.size else 8 * EPS32 * terms.max() + 1e-30)  # fmt: skip
    return
  codes, scales = np.asarray(got.codes), np.asarray(got.scales, np.float64)
  assert codes.dtype == (np.int8 if signed else np.uint8) and codes.shape == SHAPES[name]
  # Per block: the float32 rounding of the moment's terms bounds how far its absmax moves.
  slack = 8 * EPS32 * ref.qref._blocks(terms, ref.BLOCK)[0].max(axis=-1)
  assert np.all(np.abs(scales - want[2]) <= slack), name
  index, ref_index = qref.code_to_index(codes, signed), qref.code_to_index(want[1], signed)
  differ = index != ref_index
  if differ.any():
    # Next to a midpoint: the exact moment lies within the float32 rounding of its terms
    # (plus 2^-21 of the midpoint, the encoder's own) of the midpoint between the two codes.
    table = qref.code_table(signed)
    s = qref.element_scales(want[2], SHAPES[name][-1])[differ]
    mid = (table[index[differ]] + table[ref_index[differ]]) / 2 * s
    slack = 8 * EPS32 * terms[differ] + 2.0**-21 * np.abs(mid)
    assert np.all(np.abs(index[differ] - ref_index[differ]) == 1), name
    assert np.all(np.abs(want[3][differ] - mid) <= slack), name


def run_lamb(implementation, steps=5, seed=0, **kwargs):
  rng = np.random.default_rng(seed)
  params = tree(rng, zero_rows=True)
  mask = {k: DECAY.get(k, True) for k in SHAPES}
  adapt = {k: ADAPT.get(k, True) for k in SHAPES}
  stacked = {k: STACKED.get(k, 0) for k in SHAPES}
  lr, wd = 1e-2, 0.01
  tx = optax_lamb.lamb(lr, weight_decay=wd, mask=mask, trust_ratio_mask=adapt, stacked_axes=stacked,
                       mu_dtype=jnp.int8, nu_dtype=jnp.uint8, implementation=implementation,
                       **kwargs)  # fmt: skip
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(1, steps + 1):
    grads = tree(rng, scale=10.0 ** rng.uniform(-3, 1), zero_rows=t % 2 == 0)
    updates, new_state = update(grads, state, params)
    adam = state[1]
    for k in SHAPES:
      mu, nu = as_ref(adam.mu[k]), as_ref(adam.nu[k])
      want_u, want_mu, want_nu, want_r = ref.lamb_step(
        params[k], grads[k], mu, nu, t, lr=lr, weight_decay=wd, decay=mask[k], adapt=adapt[k],
        stacked_axes=stacked[k],
      )  # fmt: skip
      g = np.asarray(grads[k], np.float64)
      check_moment(new_state[1].mu[k], want_mu, ref.moment_terms(mu, g, 0.9, False), True, k)
      check_moment(new_state[1].nu[k], want_nu, ref.moment_terms(nu, g, 0.999, True), False, k)
      got = np.asarray(updates[k], np.float64)
      atol = 2e-5 * np.max(np.abs(want_u), initial=0.0)
      np.testing.assert_allclose(got, want_u, rtol=2e-5, atol=atol, err_msg=f"{k} at step {t}")
      ratios = np.asarray(optax_lamb.trust_ratios(new_state)[k], np.float64)
      np.testing.assert_allclose(ratios, want_r, rtol=2e-5, err_msg=k)
    state, params = new_state, optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize(  # xla-chunked: the norms from row chunks (`XlaBackend.chunked_sums`)
  "implementation",
  ["reference", "xla", XlaBackend(chunked_sums=1500)],
  ids=["reference", "xla", "xla-chunked"],
)
def test_lamb_8bit_moments_match_the_float64_transcription(implementation):
  run_lamb(implementation)


def adam_state(state):
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  return next(x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x))


def lamb_kwargs():
  return dict(
    weight_decay=0.01, mask={k: DECAY.get(k, True) for k in SHAPES},
    trust_ratio_mask={k: ADAPT.get(k, True) for k in SHAPES},
    stacked_axes={k: STACKED.get(k, 0) for k in SHAPES}, mu_dtype=jnp.int8, nu_dtype=jnp.uint8,
  )  # fmt: skip


@pytest.mark.parametrize(  # skip_nonfinite: 7 s, CI runs it (-m slow)
  "skip_nonfinite",
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["plain", "skip_nonfinite"],
)
def test_xla_stores_the_reference_codes_and_scales_bit_for_bit(skip_nonfinite):
  """From the same state, both paths store the same codes and scales (the same float32 moments,
  quantized by the same function). The updates and ratios agree to a few float32 roundings,
  not bit for bit: XLA fuses the dequantization into the norm's reduction of a stacked leaf
  and sums it in another order (seen: one ulp on a ratio), as the implementations' contract
  allows (tests/helpers/asserts.py, FEW_ROUNDINGS)."""
  rng = np.random.default_rng(1)
  params = tree(rng, zero_rows=True)
  txs = {
    i: optax_lamb.lamb(1e-2, implementation=i, skip_nonfinite=skip_nonfinite, **lamb_kwargs())
    for i in ("reference", "xla")
  }
  state = txs["xla"].init(params)
  for t in range(4):
    grads = tree(rng, scale=10.0 ** rng.uniform(-3, 1), zero_rows=t % 2 == 1)
    (u_ref, s_ref), (u, s) = (jax.jit(tx.update)(grads, state, params) for tx in txs.values())
    jax.tree.map(np.testing.assert_array_equal, adam_state(s_ref), adam_state(s))
    for a, b in zip(jax.tree.leaves(u_ref), jax.tree.leaves(u), strict=True):
      atol = EPS32 * np.max(np.abs(np.asarray(a)), initial=0.0)
      np.testing.assert_allclose(a, b, rtol=8 * EPS32, atol=atol)
    np.testing.assert_allclose(*(optax_lamb.trust_ratios(x)["stack"] for x in (s_ref, s)),
                               rtol=8 * EPS32)  # fmt: skip
    state, params = s, optax.apply_updates(params, u)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_a_skipped_step_leaves_codes_and_scales_bit_identical(implementation):
  rng = np.random.default_rng(3)
  params = tree(rng)
  tx = optax_lamb.lamb(1e-2, implementation=implementation, skip_nonfinite=True, **lamb_kwargs())
  update = jax.jit(tx.update)
  state = update(tree(rng), tx.init(params), params)[1]  # non-zero codes and scales
  for bad in (np.nan, np.inf, 1e30):  # 1e30: its square overflows float32 (the scales)
    grads = tree(rng)
    grads["w"] = grads["w"].at[3, 7].set(bad)
    updates, new = update(grads, state, params)
    before, after = adam_state(state), adam_state(new)
    for k in QUANTIZED:
      for old, kept in ((before.mu[k], after.mu[k]), (before.nu[k], after.nu[k])):
        assert np.any(np.asarray(old.codes)) and np.any(np.asarray(old.scales))
        np.testing.assert_array_equal(np.asarray(kept.codes), np.asarray(old.codes))
        assert np.asarray(kept.scales).tobytes() == np.asarray(old.scales).tobytes()
    assert int(after.count) == int(before.count)
    assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert int(optax_lamb.skip_counts(new).consecutive) == 1  # each from the same state


def test_scale_by_adam_8bit_moments_match_the_float64_transcription():
  rng = np.random.default_rng(2)
  params = tree(rng)
  tx = optax_lamb.scale_by_adam(b1=0.9, b2=0.99, eps=1e-6, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  state = tx.init(params)
  for t in range(1, 4):
    grads = tree(rng, scale=10.0 ** rng.uniform(-2, 1))
    u, new = jax.jit(tx.update)(grads, state)
    for k in SHAPES:
      mu, nu = as_ref(state.mu[k]), as_ref(state.nu[k])
      g = np.asarray(grads[k], np.float64)
      m = 0.9 * ref.load(mu, True) + 0.1 * g
      v = 0.99 * ref.load(nu, False) + 0.01 * g * g
      want = (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-6)
      np.testing.assert_allclose(np.asarray(u[k], np.float64), want, rtol=2e-5,
                                 atol=2e-5 * np.max(np.abs(want), initial=0.0), err_msg=k)  # fmt: skip
      want_mu, want_nu = ref.store(m, SHAPES[k], True), ref.store(v, SHAPES[k], False)
      check_moment(new.mu[k], want_mu, ref.moment_terms(mu, g, 0.9, False), True, k)
      check_moment(new.nu[k], want_nu, ref.moment_terms(nu, g, 0.99, True), False, k)
    state = new


def test_the_layout_depends_on_the_shape_only():
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state = optax_lamb.lamb(1e-3, mu_dtype=jnp.int8, nu_dtype=jnp.uint8).init(params)
  for k, shape in SHAPES.items():
    mu, nu = state[1].mu[k], state[1].nu[k]
    if k not in QUANTIZED:
      assert mu.shape == nu.shape == shape and mu.dtype == nu.dtype == jnp.float32, k
      continue
    blocks = -(-shape[-1] // 256)
    assert (mu.codes.dtype, nu.codes.dtype) == (jnp.int8, jnp.uint8)
    assert mu.codes.shape == nu.codes.shape == shape
    assert mu.scales.shape == nu.scales.shape == shape[:-1] + (blocks,)
    assert mu.scales.dtype == jnp.float32
    assert not np.any(np.asarray(mu.codes)) and not np.any(np.asarray(mu.scales))


@pytest.mark.slow  # 29 s: CI runs it
def test_the_update_differentiates_with_respect_to_the_params():
  """Through the update (the integer codes carry no derivative): reference and XLA agree, with
  the norms from row chunks too (a loop, differentiated by jax)."""
  rng = np.random.default_rng(4)
  params, grads = tree(rng), tree(rng)
  out = []
  for implementation in ("reference", "xla", XlaBackend(chunked_sums=1500)):
    tx = optax_lamb.lamb(1e-2, implementation=implementation, **lamb_kwargs())
    state = tx.update(grads, tx.init(params), params)[1]
    loss = lambda p, tx=tx, state=state: sum(
      jnp.sum(u**2) for u in jax.tree.leaves(tx.update(grads, state, p)[0])
    )
    out.append(jax.jit(jax.grad(loss))(params))
  for other in out[1:]:  # the XLA path, with and without chunked norms
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(other), strict=True):
      assert np.all(np.isfinite(a))
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.max(np.abs(a), initial=1.0))
