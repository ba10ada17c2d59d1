"""The ONNX Runtime LAMB transcription (`references/onnxruntime.py`) checked by its properties.

ORT's kernels need CUDA, so, as for apex and DeepSpeed, the transcription is checked against an
independent reference where the formulas coincide (the paper's float64 LAMB in
`helpers/lamb_reference.py`: all values finite, ratio bounds infinite), and against one-step
hand derivations of the source's per-element non-finite rules.
"""

from __future__ import annotations

import math

import numpy as np
import problem
import pytest
from helpers.lamb_reference import NumpyLamb
from references import onnxruntime
from test_references import SAME_RTOL, worst_difference

LR = 0.01


def _lr(step: int) -> float:
  return LR * problem.lr_factor(step)


def _run_ort(opt, steps=None, loss_scale=None, clip=False) -> dict:
  for t, grads in enumerate(problem.gradients()[:steps]):
    scaled = {n: g * (loss_scale or 1.0) for n, g in grads.items()}
    norm = problem.global_norm(scaled) if clip else None
    opt.step(scaled, eta=_lr(t), loss_scale=loss_scale, grad_norm=norm)
  return opt.params


def _run_numpy(opt, steps=None, loss_scale=None) -> dict:
  params = {n: p.astype(np.float64) for n, p in problem.initial_params().items()}
  for grads in problem.gradients()[:steps]:
    params = opt.step(params, {n: g * (loss_scale or 1.0) for n, g in grads.items()})
  return params


_LAMBDA = {n: (0.1 if n in problem.DECAYED else 0.0) for n in problem.NAMES}

# ORT keywords -> the paper reference's keywords, for settings where both compute one formula.
_COINCIDE = {
  "defaults": ({}, {}, {}),
  "decay": ({"lambda_": _LAMBDA}, {"weight_decay": 0.1}, {}),
  "clip": ({"max_norm_clip": 5.0}, {"max_grad_norm": 5.0}, {"clip": True}),
  "loss_scale": (
    {"max_norm_clip": 5.0},
    {"max_grad_norm": 5.0, "grad_scale": 1024.0},
    {"clip": True, "loss_scale": 1024.0},
  ),
  "ratio_bounds": ({"ratio_min": 0.5, "ratio_max": 2.0}, {"min_ratio": 0.5, "max_ratio": 2.0}, {}),
  "no_bias_correction": ({"do_bias_correction": 0}, {"bias_correction": False}, {}),
  "no_update_count": ({"update_count": None}, {"bias_correction": False}, {}),
  "betas_eps": (
    {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-8},
    {"b1": 0.8, "b2": 0.99, "eps": 1e-8},
    {},
  ),
}


@pytest.mark.parametrize("case", sorted(_COINCIDE))
def test_equals_paper_lamb_where_formulas_coincide(case):
  """Finite values and infinite ratio bounds: ORT's LambOptimizer is the paper's LAMB."""
  ort_kwargs, numpy_kwargs, run_kwargs = _COINCIDE[case]
  ort = onnxruntime.LambOptimizer(problem.initial_params(), **ort_kwargs)
  decay_mask = {n: n in problem.DECAYED for n in problem.NAMES}
  ref = NumpyLamb(_lr, decay_mask=decay_mask, **numpy_kwargs)
  numpy_params = _run_numpy(ref, loss_scale=run_kwargs.get("loss_scale"))
  worst, leaf = worst_difference(_run_ort(ort, **run_kwargs), numpy_params)
  assert worst <= SAME_RTOL, f"{case}: {worst:.1e} on {leaf}"


def test_schema_defaults():
  opt = onnxruntime.LambOptimizer({"w": np.ones(3)})
  values = {k: v["w"] for k, v in opt.attributes.items()}
  assert values == {"alpha": 0.9, "beta": 0.999, "lambda_": 0.0, "epsilon": 1e-6,
                    "max_norm_clip": 1.0}  # fmt: skip
  assert (opt.ratio_min, opt.ratio_max) == (-math.inf, math.inf)
  assert opt.do_bias_correction and opt.update_count == 1


@pytest.mark.parametrize(
  "kwargs,message",
  [({"max_norm_clip": 0.0}, "max_norm_clip"), ({"do_bias_correction": 2}, "do_bias_correction")],
)
def test_kernel_refusals(kwargs, message):
  with pytest.raises(RuntimeError, match=message):
    onnxruntime.LambOptimizer({"w": np.ones(3)}, **kwargs)


def test_min_above_max_gives_ratio_min():
  """max(ratio_min, min(ratio_max, r)): with ratio_min > ratio_max every ratio is ratio_min."""
  w, g = np.array([3.0, 4.0]), np.array([1.0, -2.0])
  opt = onnxruntime.LambOptimizer({"w": w}, ratio_min=2.0, ratio_max=0.5)
  opt.step({"w": g}, eta=0.1)
  d = g / (np.abs(g) + 1e-6)  # step 1: m1 / bc1 = g, sqrt(m2 / bc2) = |g|
  np.testing.assert_allclose(opt.params["w"], w - 0.1 * 2.0 * d, rtol=SAME_RTOL)


def test_do_update_false_changes_nothing_and_keeps_the_count():
  params, grads = problem.initial_params(), problem.gradients()
  skipped = onnxruntime.LambOptimizer(params)
  skipped.step(grads[0], eta=LR, do_update=False)
  assert skipped.update_count == 1
  assert all(not np.any(u) for u in skipped.updates.values())
  for name, p in params.items():
    np.testing.assert_array_equal(skipped.params[name], p)
  fresh = onnxruntime.LambOptimizer(params)
  skipped.step(grads[1], eta=LR)
  fresh.step(grads[1], eta=LR)
  assert worst_difference(skipped.params, fresh.params)[0] == 0.0


def test_nonfinite_gradient_element_zeroes_its_direction_and_keeps_its_moments():
  """_LambComputeDirectionRule: d = 0, m1 and m2 unchanged where d is not finite."""
  w = np.array([0.5, -1.0, 2.0, 0.25])
  g0, g1 = np.array([0.1, 0.2, -0.3, 0.4]), np.array([0.3, np.inf, -0.1, np.nan])
  opt = onnxruntime.LambOptimizer({"w": w})
  opt.step({"w": g0}, eta=LR)
  m1, m2, w1 = opt.m1["w"].copy(), opt.m2["w"].copy(), opt.params["w"].copy()
  opt.step({"w": g1}, eta=LR)
  bad = ~np.isfinite(g1)
  np.testing.assert_array_equal(opt.m1["w"][bad], m1[bad])
  np.testing.assert_array_equal(opt.m2["w"][bad], m2[bad])
  np.testing.assert_array_equal(opt.updates["w"][bad], 0.0)
  # The finite elements: the step-2 direction by hand, the ratio over them alone.
  good = ~bad
  new_m1 = 0.9 * m1[good] + 0.1 * g1[good]
  new_m2 = 0.999 * m2[good] + 0.001 * g1[good] ** 2
  d = (new_m1 / (1 - 0.9**2)) / (np.sqrt(new_m2 / (1 - 0.999**2)) + 1e-6)
  ratio = LR * np.linalg.norm(w1) / np.linalg.norm(d)
  np.testing.assert_allclose(opt.params["w"][good], w1[good] - ratio * d, rtol=SAME_RTOL)
  np.testing.assert_allclose(opt.m1["w"][good], new_m1, rtol=SAME_RTOL)


def test_nonfinite_new_weight_element_is_discarded():
  """_LambUpdateRule: an element whose w - s d overflows keeps w, and its update is 0."""
  w = np.array([-1.7e308, 1.0, 2.0])
  g = np.array([1.0, 1.0, 1.0])
  opt = onnxruntime.LambOptimizer({"w": w}, ratio_min=1e308, ratio_max=1e308)
  opt.step({"w": g}, eta=1.0)
  d = g / (np.abs(g) + 1e-6)
  assert opt.params["w"][0] == w[0] and opt.updates["w"][0] == 0.0
  np.testing.assert_allclose(opt.params["w"][1:], w[1:] - 1e308 * d[1:], rtol=SAME_RTOL)
  assert np.all(np.isfinite(opt.params["w"]))


def test_nan_weight_freezes_its_tensor_only():
  """A NaN weight: its d is NaN (zeroed), W = sum(w^2) is NaN, so is the ratio, so every new
  weight of that tensor is NaN and discarded; the other tensors step as without it."""
  params = problem.initial_params()
  poisoned = dict(params, **{"encoder/bias": params["encoder/bias"].copy()})
  poisoned["encoder/bias"][3] = np.nan
  grads = problem.gradients()[0]
  opt, clean = onnxruntime.LambOptimizer(poisoned), onnxruntime.LambOptimizer(params)
  opt.step(grads, eta=LR)
  clean.step(grads, eta=LR)
  np.testing.assert_array_equal(opt.params["encoder/bias"], poisoned["encoder/bias"])
  assert not np.any(opt.updates["encoder/bias"])
  for name in problem.NAMES:
    if name != "encoder/bias":
      np.testing.assert_array_equal(opt.params[name], clean.params[name])
