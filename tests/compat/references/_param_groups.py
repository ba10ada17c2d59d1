"""torch.optim.Optimizer's parameter groups, for the NumPy references of torch optimizers.

As in torch: `params` is either one collection of parameters or a list of group dicts, each
with a 'params' entry and optional per-group overrides of the constructor's defaults (for
example {'params': ..., 'weight_decay': 0.0}); a key a group leaves out takes the default.
Here a collection of parameters is a dict path -> array, copied to float64.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def param_groups(params, defaults: dict) -> list[dict]:
  """The groups torch.optim.Optimizer.__init__ would build: defaults, then each group's keys."""
  groups = [{"params": params}] if isinstance(params, Mapping) else list(params)
  if not groups:
    raise ValueError("optimizer got an empty parameter list")
  built, seen = [], set()
  for group in groups:
    tensors = {name: np.array(value, np.float64) for name, value in group["params"].items()}
    if seen & tensors.keys():
      raise ValueError("some parameters appear in more than one parameter group")
    seen |= tensors.keys()
    built.append({**defaults, **group, "params": tensors})
  return built


def torch_defaults(arguments: Mapping[str, object], names: str) -> dict:
  """The `defaults` a torch optimizer's constructor writes out as `dict(lr=lr, betas=betas, ...)`.

  `arguments` is the constructor's `locals()`; `names` lists the arguments that go into the
  defaults, space-separated, in the library's order.
  """
  return {name: arguments[name] for name in names.split()}


def all_params(groups: list[dict]) -> dict[str, np.ndarray]:
  """Every group's parameters in one dict (the arrays themselves, not copies)."""
  return {name: p for group in groups for name, p in group["params"].items()}
