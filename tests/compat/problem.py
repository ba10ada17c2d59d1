"""The one problem every LAMB flavour is recorded and checked on (NumPy only, deterministic).

Five leaves, named by '/'-joined paths (the names TF Addons' regexes and Keras' name patterns
are matched against), in two parameter groups:

  decayed      encoder/kernel (16, 8) matrix, conv/kernel (3, 3, 4), temperature () scalar
  not decayed  encoder/bias (8,) zero-initialised, norm/scale (8,) near one

and STEPS steps of gradients, float32. Every step's global gradient norm is above 1 (between
GRAD_NORM_RANGE), so a clip at 1.0 acts on every step and a clip at 5.0 on some. The gradients
do not depend on the parameters: a trajectory is a fixed function of the optimizer alone.
norm/scale gets gradients ten thousand times smaller than the rest, so its sqrt(v) is near 1e-4
and where eps goes (inside or outside the square root, 1e-6 or 1e-8) shows in its update. Each
leaf's gradient has a constant drift plus noise, so the first moment builds up a direction that
the new gradient sometimes contradicts (what timm's `caution` masks).
"""

from __future__ import annotations

import numpy as np

STEPS = 20
SEED = 20
GRAD_NORM_RANGE = (1.5, 40.0)

# path -> (shape, initial scale); a scale of 0 initialises the leaf to zeros.
_LEAVES = {
  "encoder/kernel": ((16, 8), 0.5),
  "encoder/bias": ((8,), 0.0),
  "conv/kernel": ((3, 3, 4), 0.2),
  "norm/scale": ((8,), 1.0),
  "temperature": ((), 2.0),
}
# path -> relative size of its gradients
_GRAD_SCALES = {
  "encoder/kernel": 1.0,
  "encoder/bias": 0.5,
  "conv/kernel": 2.0,
  "norm/scale": 1e-4,
  "temperature": 0.3,
}

DECAYED = ("encoder/kernel", "conv/kernel", "temperature")
NOT_DECAYED = ("encoder/bias", "norm/scale")
NAMES = tuple(_LEAVES)

# Patterns that pick out NOT_DECAYED: TF Addons' regexes (re.search on the TF variable name,
# 'encoder/bias:0') and Keras' `exclude_from_weight_decay(var_names=...)` (re.search on the
# variable's own name, the last path component: 'bias', 'scale').
NOT_DECAYED_REGEXES = ("bias", "norm")
NOT_DECAYED_KERAS_NAMES = ("bias", "scale")


def initial_params() -> dict[str, np.ndarray]:
  """The initial parameters: path -> float32 array."""
  rng = np.random.default_rng(SEED)
  params = {}
  for name, (shape, scale) in _LEAVES.items():
    if scale == 0.0:
      params[name] = np.zeros(shape, np.float32)
    elif name == "norm/scale":
      params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    else:
      params[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  return params


def gradients() -> list[dict[str, np.ndarray]]:
  """STEPS gradients, each path -> float32 array, with global norms inside GRAD_NORM_RANGE."""
  rng = np.random.default_rng(SEED + 1)
  drift = {name: rng.standard_normal(shape) for name, (shape, _) in _LEAVES.items()}
  low, high = GRAD_NORM_RANGE
  targets = np.exp(rng.uniform(np.log(low), np.log(high), STEPS))
  steps = []
  for target in targets:
    raw = {
      name: _GRAD_SCALES[name] * (drift[name] + 1.5 * rng.standard_normal(drift[name].shape))
      for name in NAMES
    }
    norm = np.sqrt(sum(np.sum(g * g) for g in raw.values()))
    steps.append({name: (g * (target / norm)).astype(np.float32) for name, g in raw.items()})
  return steps


def global_norm(tree: dict[str, np.ndarray]) -> float:
  """The L2 norm of all leaves together, in float64."""
  return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values())))


def lr_factor(step: int) -> float:
  """Linear warm-up over 5 steps, then constant: the schedule of the scheduled cases (0-based)."""
  return min(1.0, (step + 1) / 5)
