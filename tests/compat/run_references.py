"""Runs a NumPy reference on the problem for one case: the params after step 1 and at the end."""

from __future__ import annotations

import cases
import numpy as np
import problem
from references import apex, deepspeed, keras, tfa, timm, torch_optimizer

_TORCH_CLASSES = {
  "apex": apex.FusedLAMB,
  "deepspeed": deepspeed.FusedLamb,
  "timm": timm.Lamb,
  "torch_optimizer": torch_optimizer.Lamb,
}
_TORCH_DEFAULT_LR = 1e-3  # every torch library's default lr


def _schedule(library: str, case: str, base_lr: float):
  return lambda step: cases.scheduled_lr(library, case, base_lr, step)


def build(library: str, case: str, params: dict | None = None):
  """The library's reference optimizer for `case`, on the problem's (or the given) params."""
  kwargs = dict(cases.CASES[library][case])
  params = problem.initial_params() if params is None else params
  if library in _TORCH_CLASSES:
    return _TORCH_CLASSES[library](cases.torch_param_groups(params), **kwargs)
  if library == "keras":
    if case in cases.SCHEDULED["keras"]:
      kwargs["learning_rate"] = _schedule(library, case, kwargs.get("learning_rate", 0.001))
    opt = keras.Lamb(params, **kwargs)
    opt.exclude_from_weight_decay(var_names=list(problem.NOT_DECAYED_KERAS_NAMES))
    return opt
  if library == "tfa":
    return tfa.LAMB(params, **kwargs)
  raise ValueError(f"library={library!r} is not one of {sorted(cases.CASES)}")


def step(library: str, case: str, opt, t: int, grads: dict) -> None:
  """Step t (0-based) of `opt`, the way the recording script steps the library."""
  if library in _TORCH_CLASSES:
    base_lr = cases.CASES[library][case].get("lr", _TORCH_DEFAULT_LR)
    for group in opt.param_groups:
      group["lr"] = cases.scheduled_lr(library, case, base_lr, t)
    if library == "deepspeed":
      opt.step(grads, grad_norms=cases.deepspeed_grad_norms(grads))
    else:
      opt.step(grads)
  else:
    opt.apply(grads)


def trajectory(library: str, case: str) -> dict[str, dict[str, np.ndarray]]:
  """{'step1': params after the first step, 'final': params after problem.STEPS steps}."""
  opt = build(library, case)
  snapshots = {}
  for t, grads in enumerate(problem.gradients()):
    step(library, case, opt, t, grads)
    if t == 0:
      snapshots["step1"] = {n: p.copy() for n, p in opt.params.items()}
  snapshots["final"] = {n: p.copy() for n, p in opt.params.items()}
  return snapshots
