"""torch_optimizer.Lamb as float64 NumPy.

Transcribed from jettify/pytorch-optimizer at commit 51e361cb881eda64b4142a315c9529a9ac9950ae
(the 0.3.0 release; identical to the torch_optimizer 0.3.0 wheel; later commits only restyle it):
  torch_optimizer/lamb.py  lines 45-80 (__init__: defaults and refusals), 82-158 (step)

Per parameter, with its own step count t:

  m  <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2      (no clipping, no bias correction in u)
  u   = m / (sqrt(v) + eps) + weight_decay p               (the decay term only if weight_decay != 0)
  w   = min(||p||, clamp_value)                            (torch .clamp(0, clamp_value))
  r   = w / ||u||, 1 if w or ||u|| is 0;  adam=True: r = 1 (computed, then discarded)
  s   = lr sqrt(1 - b2^t) / (1 - b1^t) if debias else lr   (bias correction on the step size)
  p  <- p - s r u

The docstring says eps defaults to 1e-8; the code's default is 1e-6. clamp_value=0 makes w = 0,
so every ratio is 1. lr is the group's 'lr' at the time of the step. Refused (ValueError):
lr <= 0, eps < 0, a beta outside [0, 1), weight_decay < 0, clamp_value < 0.
"""

from __future__ import annotations

import math

import numpy as np

from ._param_groups import all_params, param_groups, torch_defaults


class Lamb:
  """torch_optimizer.Lamb: `params` a dict path -> array or a list of torch-style groups."""

  def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0,
               clamp_value=10, adam=False, debias=False):  # fmt: skip
    if lr <= 0.0:
      raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0.0:
      raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
      raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
      raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if weight_decay < 0:
      raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if clamp_value < 0.0:
      raise ValueError(f"Invalid clamp value: {clamp_value}")
    self.defaults = torch_defaults(locals(), "lr betas eps weight_decay")
    self.clamp_value = clamp_value
    self.adam = adam
    self.debias = debias
    self.param_groups = param_groups(params, self.defaults)
    self.state = {}

  @property
  def params(self) -> dict[str, np.ndarray]:
    return all_params(self.param_groups)

  def step(self, grads: dict) -> None:
    """One optimizer step; a path missing from `grads` has no gradient this step."""
    for group in self.param_groups:
      beta1, beta2 = group["betas"]
      for name, p in group["params"].items():
        if name not in grads:
          continue
        g = np.asarray(grads[name], np.float64)
        state = self.state.setdefault(
          name, {"step": 0, "exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}
        )
        state["step"] += 1
        t = state["step"]
        m = state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * g
        v = state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * g * g
        if self.debias:
          bias_correction = math.sqrt(1 - beta2**t) / (1 - beta1**t)
        else:
          bias_correction = 1
        step_size = group["lr"] * bias_correction
        weight_norm = min(max(np.linalg.norm(p), 0.0), self.clamp_value)
        adam_step = m / (np.sqrt(v) + group["eps"])
        if group["weight_decay"] != 0:
          adam_step = adam_step + group["weight_decay"] * p
        adam_norm = np.linalg.norm(adam_step)
        if weight_norm == 0 or adam_norm == 0:
          trust_ratio = 1.0
        else:
          trust_ratio = weight_norm / adam_norm
        state["trust_ratio"] = trust_ratio
        if self.adam:
          trust_ratio = 1.0
        p -= step_size * trust_ratio * adam_step
