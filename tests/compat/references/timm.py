"""timm.optim.Lamb as float64 NumPy.

Transcribed from huggingface/pytorch-image-models at commit
aa4b5850c1543fa488abf260f18390eda46cf85d (the files are identical in the timm 1.0.29 wheel):
  timm/optim/lamb.py      lines 90-123 (__init__), 134-150 (_get_clip_grad_norm), 152-252 (step)
  timm/optim/_helpers.py  lines 37-41 (_get_value), 68-83 (_validate_scalar, _add_scaled_)

Per step, with the step count t of the parameter's group (every group counts every step):

  c   = max(||g||_global / max_grad_norm, 1)        global norm over every group's gradients;
        max_grad_norm is read from the constructor's defaults, never a group's; None: no clip;
        0: c = inf and every gradient becomes 0 (NaN if all gradients are 0)
  g  <- g / c
  m  <- b1 m + b3 g,   b3 = 1 - b1 (grad_averaging) or 1
  v  <- b2 v + (1 - b2) g^2
  u   = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)     bc = 1 - b^t, or 1 without bias_correction
  caution:  k = [u * g > 0] (the clipped g, u before any decay);  u <- u * k / max(mean(k), 1e-3)
            (mean over the leaf's elements)
  if weight_decay != 0:
    decoupled_decay:  p <- p - s * weight_decay * p, s = lr (corrected_weight_decay:
                      lr^2 / the constructor's lr); before the trust ratio, so ||p|| below is
                      the decayed one, and the decay is outside the ratio
    else:             u <- u + weight_decay * p     (inside the ratio)
  if weight_decay != 0 or always_adapt:
    r = ||p|| / ||u|| (1 if either is 0);  trust_clip: r <- min(r, 1);  u <- r u
  p <- p - lr u

lr is the group's 'lr' at the time of the step (a scheduler writes it there).
"""

from __future__ import annotations

import numpy as np

from ._param_groups import all_params, param_groups, torch_defaults


def _validate_scalar(name, value):
  if float(value) < 0.0:
    raise ValueError(f"Invalid {name}: {value}")


class Lamb:
  """timm.optim.Lamb: `params` a dict path -> array or a list of torch-style groups."""

  def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
               weight_decay=0.01, grad_averaging=True, max_grad_norm=1.0, trust_clip=False,
               always_adapt=False, caution=False, decoupled_decay=False,
               corrected_weight_decay=False):  # fmt: skip
    _validate_scalar("learning rate", lr)
    _validate_scalar("epsilon", eps)
    _validate_scalar("weight_decay", weight_decay)
    self.defaults = torch_defaults(
      locals(),
      "lr bias_correction betas eps weight_decay grad_averaging max_grad_norm trust_clip"
      " always_adapt caution decoupled_decay corrected_weight_decay",
    )
    self.param_groups = param_groups(params, self.defaults)
    self.state = {}

  @property
  def params(self) -> dict[str, np.ndarray]:
    return all_params(self.param_groups)

  def _clip_divisor(self, grads):
    max_grad_norm = self.defaults["max_grad_norm"]
    if max_grad_norm is None:
      return None
    present = [np.asarray(grads[n], np.float64) for n in self.params if n in grads]
    global_norm = np.sqrt(sum(np.sum(g * g) for g in present))
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.maximum(global_norm / np.float64(max_grad_norm), 1.0)

  def step(self, grads: dict) -> None:
    """One optimizer step; a path missing from `grads` has no gradient this step."""
    clip = self._clip_divisor(grads)
    for group in self.param_groups:
      beta1, beta2 = group["betas"]
      beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
      group["step"] = group.get("step", 0) + 1
      if not any(n in grads for n in group["params"]):
        continue
      t = group["step"]
      if group["bias_correction"]:
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
      else:
        bc1, bc2 = 1.0, 1.0
      for name, p in group["params"].items():
        if name not in grads:
          continue
        g = np.asarray(grads[name], np.float64)
        if clip is not None:
          g = g / clip
        state = self.state.setdefault(
          name, {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}
        )
        m = state["exp_avg"] = beta1 * state["exp_avg"] + beta3 * g
        v = state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * g * g
        update = (m / bc1) / (np.sqrt(v) / bc2**0.5 + group["eps"])
        if group["caution"]:
          keep = (update * g > 0).astype(np.float64)
          update = update * (keep / max(keep.mean(), 1e-3))
        weight_decay = group["weight_decay"]
        if weight_decay != 0:
          if group["decoupled_decay"]:
            if group["corrected_weight_decay"]:
              wd_scale = group["lr"] ** 2 / self.defaults["lr"]
            else:
              wd_scale = group["lr"]
            p -= wd_scale * weight_decay * p
          else:
            update = update + weight_decay * p
        if weight_decay != 0 or group["always_adapt"]:
          w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(update)
          ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
          if group["trust_clip"]:
            ratio = min(ratio, 1.0)
          update = update * ratio
        p -= group["lr"] * update
