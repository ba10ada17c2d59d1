"""An independent float64 NumPy LAMB, written from the paper, for the tests.

You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2 (LAMB):

  paper            here
  x_t^(i)          params[name] (layer i = one leaf, or one slice of a stacked leaf)
  g_t              grads[name]
  beta_1, beta_2   b1, b2
  m_t, v_t         m[name], v[name]
  m_hat, v_hat     m / (1 - b1^t), v / (1 - b2^t)   (1 and 1 with bias_correction=False)
  r_t              adam = m_hat / (sqrt(v_hat + eps_root) + eps)
  lambda           weight_decay (only where the decay mask is True)
  phi(z) = z       the identity; clamped to [min_ratio, max_ratio] when given
  eta_t            lr(t - 1)  (optax schedules see the 0-based step count)

  x_{t+1} = x_t - eta_t * phi(||x_t||) / ||r_t + lambda x_t|| * (r_t + lambda x_t)

with the ratio 1 when either norm is zero, and global-norm clipping of g_t before
the moments when max_grad_norm is given. With grad_scale, g_t is first divided by
it (a schedule sees the number of calls); with skip_nonfinite a call whose g_t
holds a NaN or an Inf changes nothing and is counted. Plain dicts of NumPy arrays only: no jax,
no optax, no code shared with the library (ml_dtypes for the narrow moment dtypes).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def _as_fn(x):
  return x if callable(x) else (lambda step: x)


class NumpyLamb:
  """Float64 LAMB on a flat dict of arrays."""

  def __init__(self, learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0,
               weight_decay=0.0, decay_mask=None, bias_correction=True, adapt_mask=None,
               min_ratio=None, max_ratio=None, max_grad_norm=None, stacked_axes=None,
               grad_scale=None, skip_nonfinite=False, store_mu=None, store_nu=None):  # fmt: skip
    self.lr = _as_fn(learning_rate)
    self.wd = _as_fn(weight_decay)
    self.b1, self.b2, self.eps, self.eps_root = b1, b2, eps, eps_root
    self.decay_mask = decay_mask or {}
    self.adapt_mask = adapt_mask or {}
    self.bias_correction = bias_correction
    self.min_ratio, self.max_ratio = min_ratio, max_ratio
    self.max_grad_norm = max_grad_norm
    self.stacked_axes = stacked_axes or {}
    self.grad_scale = grad_scale
    self.skip_nonfinite = skip_nonfinite
    self.store_mu = store_mu  # a NumPy dtype the stored m is rounded to (mu_dtype)
    self.store_nu = store_nu  # likewise for v (nu_dtype)
    self.t = 0  # applied steps
    self.calls = 0  # calls, skipped ones included
    self.skipped = self.consecutive = 0
    self.m = self.v = None
    self.ratios = {}
    # Condition number of each ratio, worst layer: (||adam|| + ||wd x||) / ||adam + wd x||
    # times that of the first-moment update. Float32 rounding of u is amplified by it
    # when the decay cancels the Adam step or the new gradient cancels the moment.
    self.ratio_condition = {}
    # How far a run that stores its moments in store_mu/store_nu may drift from this one
    # (_storage_relative): per leaf on the params (absolute, summed over the steps), and
    # relatively on the last step's ratios.
    self.storage_drift = {}
    self.storage_ratio_rtol = 0.0
    # The relative error of this step's u (so of r u) in a run that computes 1 - b^t in
    # float32: b rounded, b^t rounded to an ulp, then the cancellation in 1 - b^t divides
    # both by 1 - b^t, large for b2 near 1.
    self.float32_constants_rtol = 0.0
    self.m_terms = {}  # per leaf, elementwise: b1 |m| + (1 - b1) |g| of the last step

  def _storage_relative(self):
    """How far, relatively, one step's u and ratio may move when stored moments round differently.

    Two runs that store m (v) rounded to a narrow dtype each round to nearest, so
    their stored moments may differ by one unit in the last place: eps |m| (eps |v|).
    An earlier difference decays with b1 (b2) but the next rounding may add one
    more, so at step t m differs by at most min(t - 1, 1 / (1 - b1)) eps |m|; u =
    m^ / sqrt(v^) then by that relative amount plus half of v's, and the ratio,
    whose ||u|| moves by the same relative amount, doubles it for r u.
    """

    def relative(dtype, b):
      if dtype is None:
        return 0.0
      return min(self.t - 1, 1.0 / (1.0 - b)) * float(ml_dtypes.finfo(dtype).eps)

    return 2.0 * (relative(self.store_mu, self.b1) + 0.5 * relative(self.store_nu, self.b2))

  def _float32_constants_rtol(self):
    if not self.bias_correction:
      return 0.0

    def relative(b):  # b rounded to float32, and b^t computed to an ulp in float32
      bt = b**self.t
      return (abs(float(np.float32(b)) ** self.t - bt) + FLOAT32_EPS * bt) / (1 - bt)

    return relative(self.b1) + 0.5 * relative(self.b2)

  def _layer_ratio(self, x, u):
    """phi(||x||) / ||u|| for one layer, with the zero-norm and clamp rules."""
    x_norm = np.sqrt(np.sum(x * x))
    u_norm = np.sqrt(np.sum(u * u))
    if x_norm == 0.0 or u_norm == 0.0:
      return 1.0
    ratio = x_norm / u_norm
    if self.min_ratio is not None:
      ratio = max(ratio, self.min_ratio)
    if self.max_ratio is not None:
      ratio = min(ratio, self.max_ratio)
    return ratio

  def step(self, params, grads):
    params = {k: np.asarray(p, np.float64) for k, p in params.items()}
    grads = {k: np.asarray(g, np.float64) for k, g in grads.items()}
    if self.m is None:
      self.m = {k: np.zeros_like(p) for k, p in params.items()}
      self.v = {k: np.zeros_like(p) for k, p in params.items()}
    scale = self.grad_scale(self.calls) if callable(self.grad_scale) else self.grad_scale
    self.calls += 1
    if scale is not None:
      grads = {k: g / float(scale) for k, g in grads.items()}
    if self.skip_nonfinite and not all(np.all(np.isfinite(g)) for g in grads.values()):
      self.skipped += 1
      self.consecutive += 1
      return params
    self.consecutive = 0
    step_count = self.t  # what an optax schedule sees
    self.t += 1
    if self.max_grad_norm is not None:
      global_norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
      if global_norm > self.max_grad_norm:
        grads = {k: g * self.max_grad_norm / global_norm for k, g in grads.items()}
    if self.bias_correction:
      bc1, bc2 = 1 - self.b1**self.t, 1 - self.b2**self.t
    else:
      bc1 = bc2 = 1.0
    lr, wd = self.lr(step_count), self.wd(step_count)
    storage_relative = self.storage_ratio_rtol = self._storage_relative()
    self.float32_constants_rtol = self._float32_constants_rtol()
    new_params = {}
    for k, x in params.items():
      g = grads[k]
      m_parts = self.b1 * np.abs(self.m[k]) + (1 - self.b1) * np.abs(g)
      self.m_terms[k] = m_parts  # m's float32 rounding is relative to these, not to |m|
      self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
      self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
      m_hat, v_hat = self.m[k] / bc1, self.v[k] / bc2
      u = m_hat / (np.sqrt(v_hat + self.eps_root) + self.eps)
      adam = u
      if self.decay_mask.get(k, True):
        u = u + wd * x
      k_axes = self.stacked_axes.get(k, 0)
      layers_shape = x.shape[:k_axes]
      ratio = np.ones(layers_shape)
      condition = 1.0
      if self.adapt_mask.get(k, True):
        for idx in np.ndindex(*layers_shape):
          ratio[idx] = self._layer_ratio(x[idx], u[idx])
          u_norm = np.linalg.norm(u[idx])
          if u_norm > 0:
            parts = np.linalg.norm(adam[idx]) + np.linalg.norm(u[idx] - adam[idx])
            # m = b1 m + (1 - b1) g can cancel too; its rounding then grows by this much.
            m_condition = np.linalg.norm(m_parts[idx]) / max(np.linalg.norm(self.m[k][idx]), 1e-30)
            condition = max(condition, parts / u_norm * max(1.0, m_condition))
      self.ratio_condition[k] = condition
      self.ratios[k] = ratio
      largest_step = lr * np.max(np.abs(ratio), initial=0.0) * np.max(np.abs(adam), initial=0.0)
      self.storage_drift[k] = self.storage_drift.get(k, 0.0) + largest_step * storage_relative
      new_params[k] = x - lr * ratio.reshape(layers_shape + (1,) * (x.ndim - k_axes)) * u
      if self.store_mu is not None:  # u used the unrounded m; the state keeps it rounded
        self.m[k] = self.m[k].astype(self.store_mu).astype(np.float64)
      if self.store_nu is not None:
        self.v[k] = self.v[k].astype(self.store_nu).astype(np.float64)
    return new_params
