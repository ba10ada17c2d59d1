"""ONNX Runtime training's ``LambOptimizer`` op (com.microsoft domain) as float64 NumPy.

ORT's LAMB is a graph op with CUDA kernels only. Transcribed from microsoft/onnxruntime, each
file at the commit named beside it (the stored snapshots of that repository):
  orttraining/orttraining/core/graph/training_op_defs.cc   @ 9d017b5a8a58a031f99289303c7e3a30d9d19162
      RegisterLambOpSchema: the attributes and their defaults
  orttraining/orttraining/training_ops/cuda/optimizer/lamb.h  @ 95f485acb8fc9b42c3d36be26965dd19c13e1974
      lines 15-31 (the kernel's attributes: defaults, max_norm_clip != 0, do_bias_correction 0/1)
  orttraining/orttraining/training_ops/cuda/optimizer/lamb.cc @ 06414ba6e4c5bc856bc08fe2f0fe0582e25a0bad
      LambOptimizer::ComputeInternal (inputs 0-4: do_update, loss_scale, gradient norm, eta,
      update_count; do_update false copies every input to its output, the count included; the
      count + 1 at the end), launch_lamb_compute_direction (the bias corrections of the count)
  orttraining/orttraining/training_ops/cuda/optimizer/lamb_impl.cu @ 42725063d997e2dc08b735c70feabc2ccd79c160
      lines 14-66 (_LambComputeDirectionRule: moments, direction, the per-element finite check),
      line 89 (the gradient divisor), lines 183-223 (_LambUpdateRule: ratio, clamps, the new
      weight's finite check); LambMultiTensorReductionImpl (sums of squares of w and d)
  orttraining/orttraining/training_ops/cuda/optimizer/common.cuh @ 7c4aa9451d2434f9cf53bc2f4a5199c632dc15ef
      lines 15-29 (_ComputeGradScale: loss scale and clip)
  orttraining/orttraining/training_ops/cpu/optimizer/common.h @ d4fbbed3cf4b393ca08b8c77f708dccf919dc8cf
      lines 11-20 (compute_bias_correction_coefficient: 1 - b^count, 1 when count <= 0)
  onnxruntime/core/providers/cuda/cu_inc/common.cuh: _Min(a, b) = a < b ? a : b and
      _Max(a, b) = a > b ? a : b, so a NaN ratio passes both clamps

Per call, for each weight w (attributes may differ per weight), with the count n (the optional
update_count input; ORT's trainer feeds 1 at the first step):

  do_update given and false:  nothing changes (weights, moments, count); the updates are 0
  k   = loss_scale (1 if absent);  if a gradient norm N is given and N > k max_norm_clip:
        k = N / max_norm_clip       N is the norm of the *scaled* gradients (ORT's graph feeds
                                    the global norm of all of them), so this is g min(1, c / G)
  g  <- g / k
  m1' = alpha m1 + (1 - alpha) g,   m2' = beta m2 + (1 - beta) g^2
  bc1 = 1 - alpha^n, bc2 = 1 - beta^n  with do_bias_correction and n > 0; else 1 and 1
  d   = lambda w + (m1' / bc1) / (sqrt(m2' / bc2) + epsilon)         decay inside the ratio
  per element: d finite -> (d, m1', m2');  else -> (0, m1, m2)      the old moments are kept
  W   = sum(w^2),  D = sum(d^2)   (d with the zeroed elements)
  s   = eta max(ratio_min, min(ratio_max, sqrt(W / D))) if W != 0 and D != 0, else eta
  per element: w - s d finite -> (w - s d, update -s d);  else -> (w, update 0)
  n  <- n + 1

Defaults (schema): alpha 0.9, beta 0.999, lambda 0, epsilon 1e-6, max_norm_clip 1.0,
ratio_min -inf, ratio_max inf, do_bias_correction 1 (ORT's Python LambConfig front end
passes do_bias_correction=False unless told otherwise). Refused by the kernel (ORT_ENFORCE,
RuntimeError here): max_norm_clip == 0, do_bias_correction outside {0, 1}. Not refused:
negative or min > max ratio bounds (min > max gives ratio_min), a negative max_norm_clip
(it flips the gradients' signs once N > k c), alpha or beta outside [0, 1). The kernels compute
in float32 (bias corrections from a float64 pow, then cast).

Where it differs from ``optax_lamb.lamb``'s update (what ``compat.onnxruntime_lamb`` maps):
- non-finite values, per element: a non-finite direction element is zeroed and its moments
  keep their old values; a non-finite new weight element is discarded (w kept, update 0).
  lamb has no per-element rule; ``skip_nonfinite`` skips whole steps. A NaN weight makes W NaN,
  so the ratio is NaN and every new weight of that tensor is discarded: the tensor is frozen.
- ``do_update`` (an input per call): false skips the call entirely, the count included; lamb
  has no such input (``skip_nonfinite`` counts the skipped steps in its own state).
- the clip needs the caller's gradient norm (none given: no clip, whatever max_norm_clip);
  ``max_norm_clip`` defaults to 1.0 where lamb's ``max_grad_norm`` defaults to None; 0 is
  refused, a negative value accepted. No epsilon on the norm (unlike DeepSpeed's 1e-6).
- the bias correction uses the ``update_count`` input; without it (n = 0) there is none.
- ratio bounds: any floats (lamb: finite, >= 0, min <= max); applied only when both sums are
  non-zero, as lamb's. Every weight adapts (no trust-ratio mask); lambda is per weight (the
  decay mask: lambda 0 on excluded weights).
- the loss scale is an input per call (``lamb(grad_scale=...)`` or ``update(grad_scale=s)``),
  and eta (the learning rate) an input tensor per call (a schedule, or inject_hyperparams).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


class LambOptimizer:
  """ORT's LambOptimizer op with its attributes; ``lambda`` is spelled ``lambda_`` in Python.

  ``alpha``, ``beta``, ``lambda_``, ``epsilon`` and ``max_norm_clip`` are a float for every
  weight or a dict path -> float (ORT: one list entry per weight). ``update_count`` is the
  count input's first value, None for an absent input (then no bias correction).
  """

  def __init__(self, params: dict, alpha=0.9, beta=0.999, lambda_=0.0, epsilon=1e-6,
               max_norm_clip=1.0, ratio_min=-math.inf, ratio_max=math.inf,
               do_bias_correction=1, update_count=1):  # fmt: skip
    attributes = dict(alpha=alpha, beta=beta, lambda_=lambda_, epsilon=epsilon)
    attributes["max_norm_clip"] = max_norm_clip
    self.params = {name: np.array(p, np.float64) for name, p in params.items()}
    self.attributes = {k: _per_weight(v, self.params) for k, v in attributes.items()}
    if any(c == 0 for c in self.attributes["max_norm_clip"].values()):
      raise RuntimeError("max_norm_clip must NOT be 0.")
    if do_bias_correction not in (0, 1):
      raise RuntimeError("do_bias_correction must be either 0 or 1.")
    self.ratio_min, self.ratio_max = float(ratio_min), float(ratio_max)
    self.do_bias_correction = bool(do_bias_correction)
    self.update_count = update_count
    self.m1 = {name: np.zeros_like(p) for name, p in self.params.items()}
    self.m2 = {name: np.zeros_like(p) for name, p in self.params.items()}
    self.updates: dict[str, np.ndarray] = {}  # the op's g_new outputs of the last call

  def step(self, grads: dict, eta: float, loss_scale=None, grad_norm=None, do_update=None):
    """One call of the op: eta is the learning rate input; the others are optional inputs."""
    if do_update is not None and not do_update:
      self.updates = {name: np.zeros_like(p) for name, p in self.params.items()}
      return
    n = 0 if self.update_count is None else self.update_count
    for name, w in self.params.items():
      a = {k: v[name] for k, v in self.attributes.items()}
      divisor = self._grad_divisor(loss_scale, grad_norm, a["max_norm_clip"])
      g = np.asarray(grads[name], np.float64) / divisor
      d = self._direction(name, w, g, a, n)
      self.updates[name] = self._apply(name, w, d, eta)
    if self.update_count is not None:
      self.update_count += 1

  @staticmethod
  def _grad_divisor(loss_scale, grad_norm, max_norm: float) -> float:
    """_ComputeGradScale: the loss scale, or the scaled norm / max_norm when it is clipped."""
    scale = 1.0 if loss_scale is None else float(loss_scale)
    if grad_norm is not None and float(grad_norm) > scale * max_norm:
      return float(grad_norm) / max_norm
    return scale

  def _direction(self, name: str, w, g, a: dict, n: int) -> np.ndarray:
    """Stage 1: new moments and d, each element kept only where d is finite."""
    alpha, beta = a["alpha"], a["beta"]
    with np.errstate(all="ignore"):
      m1 = alpha * self.m1[name] + (1.0 - alpha) * g
      m2 = beta * self.m2[name] + (1.0 - beta) * g * g
      bc1 = _bias_correction(alpha, n) if self.do_bias_correction else 1.0
      bc2 = _bias_correction(beta, n) if self.do_bias_correction else 1.0
      d = a["lambda_"] * w + (m1 / bc1) / (np.sqrt(m2 / bc2) + a["epsilon"])
    finite = np.isfinite(d)
    self.m1[name] = np.where(finite, m1, self.m1[name])
    self.m2[name] = np.where(finite, m2, self.m2[name])
    return np.where(finite, d, 0.0)

  def _apply(self, name: str, w, d, eta: float) -> np.ndarray:
    """Stage 2: the clamped ratio times eta; a non-finite new weight keeps w (update 0)."""
    with np.errstate(all="ignore"):
      w_sq, d_sq = np.sum(w * w), np.sum(d * d)
      if w_sq != 0.0 and d_sq != 0.0:  # True for NaN sums, as in the kernel
        ratio = eta * _max(self.ratio_min, _min(self.ratio_max, np.sqrt(w_sq / d_sq)))
      else:
        ratio = eta
      delta = -ratio * d
      new = w + delta
    finite = np.isfinite(new)
    self.params[name] = np.where(finite, new, w)
    return np.where(finite, delta, 0.0)


def _per_weight(value, params: dict) -> dict[str, float]:
  if isinstance(value, Mapping):
    return {name: float(value[name]) for name in params}
  return dict.fromkeys(params, float(value))


def _bias_correction(b: float, count: int) -> float:
  """compute_bias_correction_coefficient: 1 - b^count for count > 0, else 1."""
  return 1.0 - b**count if count > 0 else 1.0


def _min(a, b):
  return a if a < b else b  # cu_inc/common.cuh's _Min: NaN b passes through


def _max(a, b):
  return a if a > b else b  # _Max: NaN b passes through
