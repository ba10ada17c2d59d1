"""optax_lamb.compat's arguments: what each library refuses is refused alike, what it accepts at
the edges computes what it computes, and the decisions of optax_lamb/compat.py hold.

The exception classes of the recorded libraries come from goldens/<library>.json (written by
record_goldens.py from the libraries themselves); apex's and DeepSpeed's from their source.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import warnings
from pathlib import Path

import cases
import jax
import jax.numpy as jnp
import optax
import problem
import pytest
from compat_runs import CONSTRUCTORS, trajectory
from helpers.two_leaves import tiny_grads, tiny_params
from references import apex, deepspeed, timm, torch_optimizer
from test_compat_libraries import TOLERANCE
from test_references import worst_difference

from optax_lamb import compat

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
    # A scalar array is taken (as optax.inject_hyperparams passes one); one of another shape is not.
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


# --- what the constructors refuse, named as each library spells it ------------------------------

COMPAT = {name: getattr(compat, name) for name in compat.__all__}

# (constructor, argument, value): refused with a ValueError naming the argument: tfa_lamb's
# clips and legacy decay, and keras_lamb's clips, which share the check that let NaN through.
_NONFINITE = [
  ("tfa_lamb", "global_clipnorm", math.nan),
  ("tfa_lamb", "clipnorm", math.nan),
  ("tfa_lamb", "clipvalue", math.nan),
  ("tfa_lamb", "decay", math.inf),
  ("tfa_lamb", "decay", math.nan),
  ("keras_lamb", "global_clipnorm", math.nan),
  ("keras_lamb", "clipnorm", math.nan),
  ("keras_lamb", "clipvalue", math.nan),
]


@pytest.mark.parametrize("ctor,arg,value", _NONFINITE)
def test_nonfinite_clip_and_decay_values_are_refused(ctor, arg, value):
  """A NaN clip threshold (or a non-finite legacy decay) is refused with an error that
  names the argument, not taken as "no clipping" or turned into NaN params."""
  with pytest.raises(ValueError, match=rf"\b{arg}\b"):
    COMPAT[ctor](**{arg: value})


# lamb's and the core's names that a constructor may not have: an error naming one of them
# names an argument the user did not pass.
_CORE_NAMES = {
  "eps", "eps_root", "mask", "learning_rate", "lr", "weight_decay", "max_grad_norm",
  "min_trust_ratio", "max_trust_ratio", "trust_ratio_mask", "max_param_norm", "bias_correction",
  "epsilon", "beta_1", "beta_2", "betas", "clip_norm_eps", "decay_base_lr", "grad_averaging",
  "caution", "weight_decay_placement", "bias_correction_placement",
}  # fmt: skip


_LAMB_OPTIONS = {
  "stacked_axes": -1, "axis_name": 3, "implementation": "nope", "skip_nonfinite": "yes",
  "grad_scale": -1.0, "master_weights": "yes",
}  # fmt: skip


# Values refused beyond a wrong type, per constructor (the library's or the core's limits).
_SPECIAL = {
  "apex_fused_lamb": [("eps", 0.0), ("amsgrad", True), ("max_grad_norm", -1.0), ("lr", -1.0)],
  "deepspeed_fused_lamb": [
    ("eps", 0.0), ("amsgrad", True), ("max_coeff", -1.0), ("min_coeff", math.inf), ("lr", -1.0)
  ],
  "timm_lamb": [("eps", 0.0), ("eps", -1.0), ("lr", -1.0), ("base_lr", 1e-3)],
  "torch_optimizer_lamb": [("eps", 0.0), ("lr", 0.0), ("clamp_value", -1.0), ("betas", (0.9, 1.0))],
  "keras_lamb": [("epsilon", 0.0), ("learning_rate", 1), ("beta_1", 1.0), ("weight_decay", -1.0)],
  "tfa_lamb": [("epsilon", 0.0), ("lr", -1.0), ("decay", -1.0), ("beta_2", 1.0)],
  "onnxruntime_lamb": [
    ("epsilon", 0.0), ("max_norm_clip", 0.0), ("max_norm_clip", -1.0), ("do_bias_correction", 2),
    ("ratio_max", -1.0), ("ratio_min", math.nan), ("lr", -1.0), ("lambda_coef", -1.0),
    ("alpha", 1.0), ("loss_scale", 0.0),
  ],
}  # fmt: skip


# Words of a library's own error messages, quoted as it raises them (timm: "Invalid epsilon").
_LIBRARY_WORDS = {"timm_lamb": {"epsilon"}}


_MASKS = ["weight_decay_mask:value", "weight_decay_mask:callable", "weight_decay_mask:structure"]


def _bad_values(ctor: str) -> list[tuple[str, object]]:
  """Every argument of `ctor` with a value its library (or the core) refuses."""
  cases = []
  for p in inspect.signature(COMPAT[ctor]).parameters.values():
    if p.kind is p.VAR_KEYWORD or p.name in ("weight_decay_mask", "set_grad_none"):
      continue
    if p.name in _LAMB_OPTIONS:  # lamb's keyword-only options: their bad values are below
      continue
    if isinstance(p.default, bool):
      cases.append((p.name, "yes"))
    elif p.name.startswith("exclude_from"):
      cases.append((p.name, "bias"))  # a str, not a list of them
    else:
      cases.append((p.name, "x"))  # a number (or a pair, a schedule) is expected
  return cases + _SPECIAL[ctor] + list(_LAMB_OPTIONS.items())


_ERROR_CASES = [(c, a, v) for c in COMPAT for a, v in _bad_values(c)]


_ERROR_CASES += [(c, m, None) for c in COMPAT if c != "tfa_lamb" for m in _MASKS]


def _raised(ctor: str, arg: str, value: object) -> Exception:
  """The error of building (or, for what is read from the params, of stepping) the optimizer."""
  params = tiny_params()
  if arg.startswith("weight_decay_mask"):
    arg, value = (
      "weight_decay_mask",
      {
        "weight_decay_mask:value": "x",
        "weight_decay_mask:callable": lambda p: jax.tree.map(lambda _: "x", p),
        "weight_decay_mask:structure": {"nope": True},
      }[f"weight_decay_mask:{arg.split(':')[1]}"],
    )
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      tx = COMPAT[ctor](**{arg: value})
      tx.update(tiny_grads(1)[0], tx.init(params), params)
  except Exception as error:  # noqa: BLE001 (any error: its message is what is checked)
    return error
  pytest.fail(f"{ctor}({arg}={value!r}) was accepted")


@pytest.mark.parametrize("ctor,arg,value", _ERROR_CASES)
def test_errors_name_the_argument_as_the_library_spells_it(ctor, arg, value):
  """Every error a compat constructor raises names the argument the user passed, as
  that library spells it, and no core argument the constructor does not have (keras_lamb's
  epsilon, not eps; weight_decay_mask, not mask)."""
  message = str(_raised(ctor, arg, value))
  name = arg.split(":")[0]
  assert re.search(rf"\b{name}\b", message, re.IGNORECASE), f"{name} not in: {message}"
  own = set(inspect.signature(COMPAT[ctor]).parameters) | set(_LAMB_OPTIONS)
  own |= _LIBRARY_WORDS.get(ctor, set())
  foreign = [n for n in sorted(_CORE_NAMES - own) if re.search(rf"\b{n}\b", message)]
  assert not foreign, f"{ctor}({name}=...) names {foreign}, not its arguments: {message}"
