"""apex.optimizers.FusedLAMB as float64 NumPy (the library needs CUDA).

Transcribed from NVIDIA/apex at commit 6424da3b4faa6c8f062da4a48c424fff3f02d42d:
  apex/optimizers/fused_lamb.py  lines 63-104 (__init__: defaults, amsgrad refused),
                                 114-244 (step: global grad norm, per-group kernel launch)
  csrc/multi_tensor_lamb.cu      lines 38-192 (LAMBStage1Functor: clip, moments, u),
                                 196-267 (LAMBStage2Functor: which leaves adapt, the step),
                                 269-319 (multi_tensor_lamb_cuda: bias corrections, beta3, norms)

Per step, with the step count t of the parameter's group (every group counts every step):

  G   = ||g||_global over every group's gradients (fp32 and fp16 lists blended)
  c   = G / max_grad_norm if G > max_grad_norm else 1     max_grad_norm is the constructor's,
        never a group's; 0 makes c = inf for any G > 0, so every gradient becomes 0
  g  <- g / c
  L2 mode (adam_w_mode=False):  g <- g + weight_decay p     (after the clip; before the moments)
  m  <- b1 m + b3 g,   b3 = 1 - b1 (grad_averaging) or 1;   v <- b2 v + (1 - b2) g^2
  u   = (m / bc1) / (sqrt(v / bc2) + eps)                   bc = 1 - b^t, or 1 without bias_correction
  adam_w_mode=True:  u <- u + weight_decay p                (inside the ratio)
  if use_nvlamb or weight_decay != 0:  s = lr ||p|| / ||u|| (lr if either norm is 0)
  else:                                s = lr                (no adaptation on undecayed groups)
  p  <- p - s u

weight_decay, lr, betas, eps, bias_correction and grad_averaging are read per group; adam_w_mode
and use_nvlamb are the constructor's. The kernel computes in float32. Refused: amsgrad=True
(RuntimeError); max_grad_norm=None fails in the kernel call (a float is required: TypeError).
"""

from __future__ import annotations

import numpy as np

from ._param_groups import all_params, param_groups, torch_defaults


class FusedLAMB:
  """apex.optimizers.FusedLAMB: `params` a dict path -> array or a list of torch-style groups."""

  def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
               weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
               set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):  # fmt: skip
    if amsgrad:
      raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
    self.defaults = torch_defaults(
      locals(), "lr bias_correction betas eps weight_decay grad_averaging max_grad_norm"
    )
    self.param_groups = param_groups(params, self.defaults)
    self.adam_w_mode = bool(adam_w_mode)
    self.set_grad_none = set_grad_none
    self.use_nvlamb = use_nvlamb
    self.state = {}

  @property
  def params(self) -> dict[str, np.ndarray]:
    return all_params(self.param_groups)

  def step(self, grads: dict) -> None:
    """One optimizer step; a path missing from `grads` has no gradient this step."""
    present = [np.asarray(grads[n], np.float64) for n in self.params if n in grads]
    global_grad_norm = np.sqrt(sum(np.sum(g * g) for g in present))
    max_grad_norm = self.defaults["max_grad_norm"]
    if not isinstance(max_grad_norm, (int, float)):
      raise TypeError(f"multi_tensor_lamb: max_grad_norm must be a float, got {max_grad_norm!r}")
    with np.errstate(divide="ignore"):
      clip = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1.0
    for group in self.param_groups:
      group["step"] = group.get("step", 0) + 1
      self._multi_tensor_lamb(group, grads, clip)

  def _multi_tensor_lamb(self, group, grads, clip):
    beta1, beta2 = group["betas"]
    t = group["step"]
    bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
    beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
    decay, eps, lr = group["weight_decay"], group["eps"], group["lr"]
    for name, p in group["params"].items():
      if name not in grads:
        continue
      state = self.state.setdefault(
        name, {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}
      )
      # Stage 1: the kernel reads p only when decay != 0 (and uses 0 otherwise).
      p_read = p if decay != 0 else np.zeros_like(p)
      scaled_grad = np.asarray(grads[name], np.float64) / clip
      if not self.adam_w_mode:
        scaled_grad = scaled_grad + decay * p_read
      m = state["exp_avg"] = state["exp_avg"] * beta1 + beta3 * scaled_grad
      v = state["exp_avg_sq"] = state["exp_avg_sq"] * beta2 + (1 - beta2) * scaled_grad**2
      update = (m / bc1) / (np.sqrt(v / bc2) + eps)
      if self.adam_w_mode:
        update = update + decay * p_read
      # Stage 2: per-tensor norms of p (before the step) and of the update.
      ratio = lr
      if self.use_nvlamb or decay != 0.0:
        param_norm, update_norm = np.linalg.norm(p), np.linalg.norm(update)
        if update_norm != 0.0 and param_norm != 0.0:
          ratio = lr * (param_norm / update_norm)
      p -= ratio * update
