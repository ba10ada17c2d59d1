"""optax_lamb.lamb against the float64 NumPy reference, for every option and combinations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lamb_reference import NumpyLamb

import optax_lamb

STEPS = 10
RTOL = 2e-5

# Leaves chosen to exercise every rule: a scalar, a zero-initialised leaf (ratio 1 at
# first), a 3-D leaf, a stacked [layers, ...] leaf, and a bias; the scales differ so
# the ratios spread over orders of magnitude and the clamps bind.
SHAPES = {"scalar": (), "zero": (7,), "w3d": (3, 4, 5), "stacked": (4, 6, 5), "bias": (5,)}
SCALES = {"scalar": 2.0, "zero": 0.0, "w3d": 10.0, "stacked": 1.0, "bias": 0.01}
NO_DECAY = {"zero": False, "bias": False}
ONLY_SOME_ADAPT = {"bias": False, "scalar": False}
STACKED = {"stacked": 1}


def make_params(rng):
  params = {}
  for k, shape in SHAPES.items():
    params[k] = (SCALES[k] * rng.standard_normal(shape)).astype(np.float32)
  # Per-layer scales of the stacked leaf differ, so one ratio per layer matters.
  params["stacked"] *= np.array([0.1, 1.0, 10.0, 100.0], np.float32)[:, None, None]
  return params


def make_grads(rng):
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def full_tree(partial, default):
  return {k: partial.get(k, default) for k in SHAPES}


poly = optax.polynomial_schedule(init_value=0.02, end_value=0.002, power=1.0, transition_steps=8)
wd_schedule = optax.linear_schedule(0.1, 0.0, 10)

# name: (optax_lamb.lamb kwargs, NumpyLamb kwargs)
CASES = {
  "defaults": ({}, {}),
  "weight_decay": (dict(weight_decay=0.1), dict(weight_decay=0.1)),
  "weight_decay_mask": (
    dict(weight_decay=0.1, mask=full_tree(NO_DECAY, True)),
    dict(weight_decay=0.1, decay_mask=NO_DECAY),
  ),
  "weight_decay_mask_callable": (
    dict(weight_decay=0.1, mask=lambda p: {k: k not in NO_DECAY for k in p}),
    dict(weight_decay=0.1, decay_mask=NO_DECAY),
  ),
  "no_bias_correction": (dict(bias_correction=False), dict(bias_correction=False)),
  "eps_root": (dict(eps=1e-3, eps_root=1e-4), dict(eps=1e-3, eps_root=1e-4)),
  "trust_ratio_mask": (
    dict(trust_ratio_mask=full_tree(ONLY_SOME_ADAPT, True)),
    dict(adapt_mask=ONLY_SOME_ADAPT),
  ),
  "clamp": (
    dict(min_trust_ratio=0.5, max_trust_ratio=5.0),
    dict(min_ratio=0.5, max_ratio=5.0),
  ),
  "clamp_min_only": (dict(min_trust_ratio=0.5), dict(min_ratio=0.5)),
  "clamp_max_only": (dict(max_trust_ratio=5.0), dict(max_ratio=5.0)),
  "max_grad_norm_binding": (dict(max_grad_norm=1.0), dict(max_grad_norm=1.0)),
  "max_grad_norm_loose": (dict(max_grad_norm=1e3), dict(max_grad_norm=1e3)),
  "stacked_axes_pytree": (
    dict(stacked_axes=full_tree(STACKED, 0)),
    dict(stacked_axes=STACKED),
  ),
  "stacked_axes_callable": (
    dict(stacked_axes=lambda p: {k: 1 if k == "stacked" else None for k in p}),
    dict(stacked_axes=STACKED),
  ),
  "schedules": (
    dict(learning_rate=poly, weight_decay=wd_schedule),
    dict(learning_rate=poly, weight_decay=wd_schedule),
  ),
  "moment_dtypes_f32": (dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32), {}),
  "everything": (
    dict(
      learning_rate=poly,
      weight_decay=0.05,
      mask=full_tree(NO_DECAY, True),
      bias_correction=False,
      trust_ratio_mask=full_tree(ONLY_SOME_ADAPT, True),
      min_trust_ratio=0.2,
      max_trust_ratio=8.0,
      max_grad_norm=2.0,
      stacked_axes=full_tree(STACKED, 0),
    ),
    dict(
      learning_rate=poly,
      weight_decay=0.05,
      decay_mask=NO_DECAY,
      bias_correction=False,
      adapt_mask=ONLY_SOME_ADAPT,
      min_ratio=0.2,
      max_ratio=8.0,
      max_grad_norm=2.0,
      stacked_axes=STACKED,
    ),
  ),
  "decay_clamp_stacked_clip": (
    dict(
      weight_decay=0.01, min_trust_ratio=0.1, max_grad_norm=1.0, stacked_axes=full_tree(STACKED, 0)
    ),
    dict(weight_decay=0.01, min_ratio=0.1, max_grad_norm=1.0, stacked_axes=STACKED),
  ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case, fresh_rng):
  ours_kwargs, ref_kwargs = CASES[case]
  ours_kwargs = {"learning_rate": 0.01, **ours_kwargs}
  ref_kwargs = {"learning_rate": 0.01, **ref_kwargs}
  tx = optax_lamb.lamb(**ours_kwargs)
  ref = NumpyLamb(**ref_kwargs)

  jax_params = jax.tree.map(jnp.asarray, make_params(fresh_rng))
  state = tx.init(jax_params)
  step = jax.jit(tx.update)
  for t in range(STEPS):
    grads = make_grads(fresh_rng)
    if case.startswith("max_grad_norm_binding"):
      grads = {k: 10 * g for k, g in grads.items()}
    # The reference steps from our current params (in float64), so float32
    # rounding is compared one step at a time instead of compounding.
    # Moments too, so the moment rounding of earlier steps does not compound either.
    if t > 0:
      ref.m = {k: np.asarray(x, np.float64) for k, x in state[1].mu.items()}
      ref.v = {k: np.asarray(x, np.float64) for k, x in state[1].nu.items()}
    ref_params = ref.step(jax.tree.map(np.asarray, jax_params), grads)
    updates, state = step(jax.tree.map(jnp.asarray, grads), state, jax_params)
    jax_params = optax.apply_updates(jax_params, updates)
    for k in SHAPES:
      scale = max(1.0, float(np.max(np.abs(ref_params[k]))))
      np.testing.assert_allclose(
        np.asarray(jax_params[k]),
        ref_params[k],
        rtol=RTOL,
        atol=RTOL * scale,
        err_msg=f"case={case} leaf={k} step={t + 1}",
      )
    ratios = optax_lamb.trust_ratios(state)
    for k in SHAPES:
      assert ratios[k].dtype == jnp.float32
      np.testing.assert_allclose(
        np.asarray(ratios[k]),
        ref.ratios[k],
        rtol=RTOL * ref.ratio_condition[k],
        err_msg=f"ratio {case} {k} {t + 1}",
      )


def test_cases_actually_exercise_the_options(fresh_rng):
  """The clamp and clipping cases would pass vacuously if nothing bound: check they bind."""
  ref = NumpyLamb(0.01, stacked_axes=STACKED)
  params = make_params(fresh_rng)
  ref.step(params, make_grads(fresh_rng))
  ref.step(params, make_grads(fresh_rng))
  all_ratios = np.concatenate([np.ravel(r) for r in ref.ratios.values()])
  assert all_ratios.min() < 0.5 and all_ratios.max() > 5.0
  stacked = ref.ratios["stacked"]
  assert stacked.max() / stacked.min() > 10  # one ratio per layer really differs
