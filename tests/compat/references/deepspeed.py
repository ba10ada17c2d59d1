"""deepspeed.ops.lamb.FusedLamb as float64 NumPy (the library needs CUDA).

Transcribed from deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641:
  deepspeed/ops/lamb/fused_lamb.py     lines 41-67 (__init__: defaults, amsgrad refused),
                                       69-170 (step: clip factor per parameter, kernel call)
  csrc/lamb/fused_lamb_cuda_kernel.cu  lines 194-239 (part 1: moments, u, the two sums of
                                       squares), 260-319 (part 3: clamped coefficient, the step),
                                       321-370 (fused_lamb_cuda: the bias-corrected step size)

Per parameter, with its own step count t:

  k   = scale;  if max_grad_norm > 0:  c = (grad_norm / scale + 1e-6) / max_grad_norm,
        k = c scale if c > 1         grad_norm is what the caller passes in step(grad_norms=...)
  g  <- g / k
  m  <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2        (no grad_averaging switch)
  u   = m / (sqrt(v) + eps) + weight_decay p                 eps_inside_sqrt: m / sqrt(v + eps);
                                                             no bias correction inside u
  r   = clip(||p|| / ||u||, min_coeff, max_coeff)            (max first, then min); 1, unclamped,
                                                             if either norm is 0
  s   = lr sqrt(1 - b2^t) / (1 - b1^t) if bias_correction else lr   (on the step size)
  p  <- p - s r u

Every leaf adapts, whatever its group's weight decay. With max_grad_norm > 0 the caller must
pass grad_norms: a list with one entry per group, each a list of one norm per parameter (a bare
number for a group is wrapped in a list, and zip then updates only the group's first
parameter); None fails with a TypeError (None / scale). DeepSpeed's engine (fp16 on) wraps LAMB in
FP16_UnfusedOptimizer (deepspeed/runtime/fp16/unfused_optimizer.py at commit
071787e99045b6cf2d434279b2f67c035d226aa7, step_fused_lamb and unscale_and_clip_grads), which
clips with the global norm of all gradients through `scale` and passes no grad_norms; the ratio
stays per parameter. The kernel computes in float32. Refused: amsgrad=True (RuntimeError).
"""

from __future__ import annotations

import math

import numpy as np

from ._param_groups import all_params, param_groups, torch_defaults


class FusedLamb:
  """deepspeed.ops.lamb.FusedLamb: `params` a dict path -> array or torch-style groups."""

  def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
               eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0,
               min_coeff=0.01, amsgrad=False):  # fmt: skip
    if amsgrad:
      raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
    self.defaults = torch_defaults(
      locals(), "lr bias_correction betas eps weight_decay max_grad_norm max_coeff min_coeff"
    )
    self.param_groups = param_groups(params, self.defaults)
    self.eps_mode = 0 if eps_inside_sqrt else 1
    self.state = {}
    self.lamb_coeffs = []

  @property
  def params(self) -> dict[str, np.ndarray]:
    return all_params(self.param_groups)

  def step(self, grads: dict, grad_norms=None, scale=1.0) -> None:
    """One optimizer step; a path missing from `grads` has no gradient this step."""
    if grad_norms is None:
      grad_norms = [None] * len(self.param_groups)
    self.lamb_coeffs = []
    for group, grad_norm_group in zip(self.param_groups, grad_norms, strict=False):
      if grad_norm_group is None:
        grad_norm_group = [None] * len(group["params"])
      elif not isinstance(grad_norm_group, list):
        grad_norm_group = [grad_norm_group]
      for (name, p), grad_norm in zip(group["params"].items(), grad_norm_group, strict=False):
        combined_scale = scale
        if group["max_grad_norm"] > 0:
          if grad_norm is None:
            raise TypeError("unsupported operand type(s) for /: 'NoneType' and 'float'")
          clip = ((grad_norm / scale) + 1e-6) / group["max_grad_norm"]
          if clip > 1:
            combined_scale = clip * scale
        if name not in grads:
          continue
        state = self.state.setdefault(
          name, {"step": 0, "exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}
        )
        state["step"] += 1
        self.lamb_coeffs.append(self._fused_lamb(group, state, p, grads[name], combined_scale))

  def _fused_lamb(self, group, state, p, grad, grad_scale):
    beta1, beta2 = group["betas"]
    eps, decay, t = group["eps"], group["weight_decay"], state["step"]
    if group["bias_correction"]:
      step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
    else:
      step_size = group["lr"]
    scaled_grad = np.asarray(grad, np.float64) / grad_scale
    m = state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * scaled_grad
    v = state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * scaled_grad**2
    denom = np.sqrt(v + eps) if self.eps_mode == 0 else np.sqrt(v) + eps
    update = m / denom + decay * p
    w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(update)
    lamb_coeff = 1.0
    if w_norm != 0 and u_norm != 0:
      lamb_coeff = w_norm / u_norm
      if lamb_coeff > group["max_coeff"]:
        lamb_coeff = group["max_coeff"]
      if lamb_coeff < group["min_coeff"]:
        lamb_coeff = group["min_coeff"]
    p -= step_size * lamb_coeff * update
    return lamb_coeff
