"""optax_lamb.compat's arguments: what each library refuses is refused alike, what it accepts at
the edges computes what it computes, and the decisions of optax_lamb/compat.py hold.

The exception classes of the recorded libraries come from goldens/<library>.json (written by
record_goldens.py from the libraries themselves); apex's and DeepSpeed's from their source.
"""

from __future__ import annotations

import json
from pathlib import Path

import cases
import jax.numpy as jnp
import optax
import problem
import pytest
from compat_runs import CONSTRUCTORS, trajectory
from references import apex, deepspeed, timm, torch_optimizer
from test_compat_libraries import TOLERANCE
from test_references import worst_difference

GOLDENS = Path(__file__).resolve().parent / "goldens"
_FROM_SOURCE = {"apex": "RuntimeError", "deepspeed": "RuntimeError"}  # amsgrad=True
# Where compat answers otherwise, on purpose (see the constructors' docstrings):
_DIFFERENT = {
  # TF Addons fails on epsilon=0 by reaching for tf.backend_config (AttributeError)
  ("tfa", "zero_epsilon"): "ValueError",
  # weight_decay_mask is compat's own argument (Keras: exclude_from_weight_decay)
  ("keras", "unknown_argument"): "accepted",
}


def _library_answer(library: str, name: str) -> str:
  if (library, name) in _DIFFERENT:
    return _DIFFERENT[library, name]
  if library in cases.RECORDED:
    return json.loads((GOLDENS / f"{library}.json").read_text())["refused"][name]
  return _FROM_SOURCE[library] if name == "amsgrad" else "TypeError"


_CORRECTED = {"weight_decay": 0.1, "decoupled_decay": True, "corrected_weight_decay": True}
REFUSED = [(library, name) for library in cases.REFUSED for name in cases.REFUSED[library]]


@pytest.mark.parametrize("library,name", REFUSED)
def test_refuses_what_the_library_refuses(library, name):
  kwargs = cases.REFUSED[library][name]
  expected = _library_answer(library, name)
  if expected == "accepted":
    CONSTRUCTORS[library](**kwargs)
    return
  with pytest.raises(Exception) as error:  # noqa: B017 (the class is compared by name below)
    CONSTRUCTORS[library](**kwargs)
  assert type(error.value).__name__ == expected, error.value
  message = str(error.value).lower()
  assert any(key.lower() in message for key in kwargs) or "amsgrad" in message, message


@pytest.mark.parametrize(
  "library,kwargs,error,named",
  [
    ("keras", {"use_ema": True}, TypeError, "use_ema"),
    ("tfa", {"weight_decay_rate": 0.1}, TypeError, "weight_decay_rate"),
    ("apex", {"max_grad_norm": None}, TypeError, "max_grad_norm"),
    ("apex", {"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ("timm", {"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    # A scalar array is taken (issue 34: optax.inject_hyperparams); one of another shape is not.
    ("apex", {"weight_decay": jnp.asarray([0.1, 0.2])}, TypeError, "weight_decay"),
    ("deepspeed", {"max_coeff": jnp.ones(2)}, TypeError, "max_coeff"),
    ("keras", {"clipnorm": jnp.ones(2)}, TypeError, "clipnorm"),
    ("tfa", {"decay": jnp.ones(2)}, TypeError, "decay"),
    ("timm", {"lr": optax.constant_schedule(0.1), **_CORRECTED}, ValueError, "base_lr"),
    ("timm", {"lr": 0.1, "base_lr": 0.1}, ValueError, "base_lr"),
    ("deepspeed", {"max_coeff": -1.0}, ValueError, "max_coeff"),
    ("deepspeed", {"min_coeff": float("nan")}, ValueError, "min_coeff"),
    ("tfa", {"exclude_from_weight_decay": "bias"}, TypeError, "exclude_from_weight_decay"),
    ("tfa", {"epsilon": None}, ValueError, "epsilon"),
    ("apex", {"betas": (0.9, 0.999, 0.9)}, TypeError, "betas"),
    ("apex", {"betas": (0.9, 1.0)}, ValueError, "betas[1]"),
    ("keras", {"beta_1": 1.0}, ValueError, "beta_1"),
    ("keras", {"weight_decay": -0.1}, ValueError, "weight_decay"),
    ("deepspeed", {"lr": -1.0}, ValueError, "lr"),
    ("apex", {"weight_decay_mask": {"w": 1}}, TypeError, "weight_decay_mask"),
    ("apex", {"use_nvlamb": 1}, TypeError, "use_nvlamb"),
    ("timm", {"implementation": "cuda"}, ValueError, "implementation"),
  ],
)
def test_refuses_what_compat_cannot_compute(library, kwargs, error, named):
  with pytest.raises(error, match=named.replace("[", r"\[").replace("]", r"\]")):
    CONSTRUCTORS[library](**kwargs)


def _groups():
  return cases.torch_param_groups(problem.initial_params())


def _run_reference(optimizer, deepspeed_norms=False):
  for grads in problem.gradients():
    if deepspeed_norms:
      optimizer.step(grads, grad_norms=cases.deepspeed_grad_norms(grads))
    else:
      optimizer.step(grads)
  return optimizer.params


_MASK = {name: name in problem.DECAYED for name in problem.NAMES}


@pytest.mark.parametrize(
  "library,reference,kwargs",
  [
    # DeepSpeed clamps with max_coeff, then min_coeff: r = min_coeff when min_coeff > max_coeff
    ("deepspeed", deepspeed.FusedLamb, {"lr": 0.01, "min_coeff": 0.3, "max_coeff": 0.1}),
    # max_grad_norm <= 0: no clipping; a negative min_coeff clamps nothing
    ("deepspeed", deepspeed.FusedLamb, {"lr": 0.01, "max_grad_norm": -1.0, "min_coeff": -1.0}),
    # clamp_value=0: ||p|| clamped to 0, so every ratio is 1
    ("torch_optimizer", torch_optimizer.Lamb, {"lr": 0.01, "weight_decay": 0.1, "clamp_value": 0}),
    # L2 with the gradients zeroed by max_grad_norm=0: only the decay moves p
    ("apex", apex.FusedLAMB, {"lr": 0.01, "adam_w_mode": False, "max_grad_norm": 0.0}),
    # weight_decay=0: no leaf adapts (timm's rule); decoupled_decay then changes nothing
    ("timm", timm.Lamb, {"lr": 0.01, "weight_decay": 0.0, "decoupled_decay": True}),
  ],
)
def test_edge_values_compute_what_the_library_computes(library, reference, kwargs):
  want = _run_reference(reference(_groups(), **kwargs), deepspeed_norms=library == "deepspeed")
  tx = CONSTRUCTORS[library](**kwargs, weight_decay_mask=_MASK, implementation="xla")
  ours = trajectory(tx)["final"]
  worst, leaf = worst_difference(ours, want)
  assert worst <= TOLERANCE, f"{worst:.2e} on {leaf}"
