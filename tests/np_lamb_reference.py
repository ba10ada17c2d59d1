"""A float64 NumPy LAMB, written from the paper and optax's docs, independent of optax_lamb.

Used by the fault, mixed-precision, property and long-run tests. Params are a
dict of name -> array; everything is computed in float64.
"""

from __future__ import annotations

import numpy as np


class NumpyLamb:
  """LAMB (You et al. 2019, Algorithm 2) with optax's eps placement, in float64."""

  def __init__(
    self,
    params,
    learning_rate=1e-3,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    eps_root=0.0,
    weight_decay=0.0,
    max_grad_norm=None,
    min_ratio=None,
    max_ratio=None,
    grad_scale=None,
    skip_nonfinite=False,
  ):
    self.lr = learning_rate if callable(learning_rate) else (lambda t: learning_rate)
    self.b1, self.b2, self.eps, self.eps_root = b1, b2, eps, eps_root
    self.wd = weight_decay
    self.max_grad_norm = max_grad_norm
    self.min_ratio, self.max_ratio = min_ratio, max_ratio
    self.grad_scale = grad_scale
    self.skip_nonfinite = skip_nonfinite
    self.m = {k: np.zeros(np.shape(p), np.float64) for k, p in params.items()}
    self.v = {k: np.zeros(np.shape(p), np.float64) for k, p in params.items()}
    self.t = 0  # applied steps
    self.calls = 0
    self.skipped = 0
    self.consecutive = 0
    self.ratios = {k: 1.0 for k in params}

  def step(self, grads, params):
    """Return the new params (float64) after one update with `grads`."""
    params = {k: np.asarray(p, np.float64) for k, p in params.items()}
    grads = {k: np.asarray(g, np.float64) for k, g in grads.items()}
    scale = self.grad_scale
    if callable(scale):
      scale = scale(self.calls)
    self.calls += 1
    if scale is not None:
      grads = {k: g / float(scale) for k, g in grads.items()}
    if self.skip_nonfinite and not all(np.all(np.isfinite(g)) for g in grads.values()):
      self.skipped += 1
      self.consecutive += 1
      return params
    self.consecutive = 0
    if self.max_grad_norm is not None:
      norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
      if norm >= self.max_grad_norm:
        grads = {k: g * (self.max_grad_norm / norm) for k, g in grads.items()}
    lr = self.lr(self.t)
    self.t += 1
    bc1, bc2 = 1 - self.b1**self.t, 1 - self.b2**self.t
    new = {}
    for k, p in params.items():
      g = grads[k]
      self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
      self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
      u = (self.m[k] / bc1) / (np.sqrt(self.v[k] / bc2 + self.eps_root) + self.eps)
      u = u + self.wd * p
      pn, un = np.linalg.norm(p), np.linalg.norm(u)
      if pn == 0 or un == 0:
        r = 1.0
      else:
        r = pn / un
        if self.min_ratio is not None:
          r = max(r, self.min_ratio)
        if self.max_ratio is not None:
          r = min(r, self.max_ratio)
      self.ratios[k] = r
      new[k] = p - lr * r * u
    return new
