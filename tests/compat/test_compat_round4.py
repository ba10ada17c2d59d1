"""Issue 34 ("Reliability round 4"), failure classes 1, 2 and 4 for the compat constructors.

Written before the fixes, from f5df42e, where they fail (each docstring names its class). lamb's own cases and the wrappers' are in tests/stages/test_stages_round4.py.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.implementations import TINY_BLOCKS

from optax_lamb import compat
from optax_lamb.backends.pallas_triton import PallasTritonBackend as PallasBackend

PALLAS = PallasBackend(block_sizes=TINY_BLOCKS, interpret=True)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}
RTOL = 1e-5  # float32 arrays (injected) against Python floats (built in)
CONSTRUCTORS = {name: getattr(compat, name) for name in compat.__all__}


def _params() -> dict:
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    "b": jnp.asarray(0.1 * rng.normal(size=(3,)), jnp.float32),
  }


def _grads(steps: int) -> list[dict]:
  rng = np.random.default_rng(1)
  shapes = {"w": (4, 3), "b": (3,)}
  return [
    {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    for _ in range(steps)
  ]


def _run(tx, params: dict, grads: list[dict]) -> dict:
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, g)
  return params


def _assert_close(got: dict, want: dict) -> None:
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=1e-7, err_msg=name)


# --- class 1: numeric arguments injected by optax.inject_hyperparams ------------------------

# Each constructor's numeric arguments (betas is a pair, which inject_hyperparams leaves as it
# is), each with a valid value other than its default.
NUMBERS = {
  "apex_fused_lamb": {"lr": 2e-3, "eps": 1e-5, "weight_decay": 0.05, "max_grad_norm": 0.5},
  "deepspeed_fused_lamb": {
    "lr": 2e-3, "eps": 1e-6, "weight_decay": 0.05, "max_grad_norm": 0.5, "max_coeff": 0.5,
    "min_coeff": 0.2,
  },
  "timm_lamb": {"lr": 2e-3, "eps": 1e-5, "weight_decay": 0.05, "max_grad_norm": 0.5},
  "torch_optimizer_lamb": {"lr": 2e-3, "eps": 1e-5, "weight_decay": 0.05, "clamp_value": 0.5},
  "keras_lamb": {
    "learning_rate": 2e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6, "weight_decay": 0.05,
    "clipnorm": 0.5, "clipvalue": 0.1, "global_clipnorm": 0.5,
  },
  "tfa_lamb": {
    "learning_rate": 2e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5, "weight_decay": 0.05,
    "lr": 2e-3, "decay": 0.1, "clipnorm": 0.5, "clipvalue": 0.1, "global_clipnorm": 0.5,
  },
  "onnxruntime_lamb": {
    "lr": 2e-3, "alpha": 0.8, "beta": 0.99, "lambda_coef": 0.05, "epsilon": 1e-5,
    "max_norm_clip": 0.5, "ratio_min": 0.2, "ratio_max": 3.0, "loss_scale": 8.0,
  },
}  # fmt: skip
_INJECTED = [
  (ctor, arg, impl)
  for ctor, args in NUMBERS.items()
  for arg in args
  for impl in ("xla", "reference")
]
_LEARNING_RATE = {name: ("learning_rate" if "learning_rate" in n else "lr") for name, n in NUMBERS.items()}  # fmt: skip
_INJECTED += [(ctor, _LEARNING_RATE[ctor], "pallas") for ctor in NUMBERS]


def _slow_off_xla(cases: list[tuple]) -> list:
  """The XLA path's cases run by default; the reference's and the kernels' with -m slow (CI)."""
  return [pytest.param(*c, marks=() if c[-1] == "xla" else pytest.mark.slow) for c in cases]


@pytest.mark.parametrize("ctor,arg,implementation", _slow_off_xla(_INJECTED))
def test_compat_under_inject_hyperparams(ctor, arg, implementation):
  """Class 1: a compat constructor under optax.inject_hyperparams, one numeric argument given
  (all its numeric defaults become arrays too, traced under jit), equals the constructor built
  with the same Python numbers."""
  kwargs = {arg: NUMBERS[ctor][arg], "implementation": IMPLEMENTATIONS[implementation]}
  params, grads = _params(), _grads(3)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    injected = optax.inject_hyperparams(CONSTRUCTORS[ctor])(**kwargs)
    got = _run(injected, params, grads)
    want = _run(CONSTRUCTORS[ctor](**kwargs), params, grads)
  _assert_close(got, want)


# Values from which a constructor decides something (which leaves adapt, a clip that is off, a
# clamp, the legacy decay): injected as arrays, the decision is taken at each step.
_DECISIONS = [
  ("apex_fused_lamb", {"weight_decay": 0.0}),  # no leaf adapts
  ("apex_fused_lamb", {"max_grad_norm": 0.0}),  # zeroes every gradient
  ("apex_fused_lamb", {"max_grad_norm": math.inf}),  # no clip
  ("apex_fused_lamb", {"weight_decay": 0.0, "adam_w_mode": False}),
  ("timm_lamb", {"weight_decay": 0.0, "decoupled_decay": True}),
  ("timm_lamb", {"weight_decay": 0.05, "decoupled_decay": True, "corrected_weight_decay": True}),
  ("timm_lamb", {"weight_decay": 0.0, "max_grad_norm": math.inf, "trust_clip": True}),
  ("deepspeed_fused_lamb", {"max_coeff": 0.05, "min_coeff": 0.2}),  # r = min_coeff
  ("deepspeed_fused_lamb", {"max_coeff": math.inf, "min_coeff": -1.0}),  # no clamp
  ("deepspeed_fused_lamb", {"max_grad_norm": -1.0}),  # <= 0: no clip
  ("deepspeed_fused_lamb", {"max_grad_norm": 0.3, "eps_inside_sqrt": True}),
  ("torch_optimizer_lamb", {"clamp_value": 0.0}),  # every ratio 1
  ("torch_optimizer_lamb", {"clamp_value": math.inf}),
  ("keras_lamb", {"clipnorm": 0.0}),  # <= 0 clips nothing
  ("keras_lamb", {"clipvalue": -1.0}),
  ("keras_lamb", {"global_clipnorm": -0.5, "weight_decay": 0.1}),
  ("tfa_lamb", {"decay": 0.0, "clipnorm": 0.0}),  # clipnorm 0 zeroes the gradients
  ("tfa_lamb", {"global_clipnorm": 0.05, "clipvalue": 0.0}),
  ("onnxruntime_lamb", {"ratio_min": 1.5, "ratio_max": 0.5}),  # r = ratio_min
  ("onnxruntime_lamb", {"max_norm_clip": math.inf, "ratio_min": -1.0}),  # no clip, no clamp
  ("apex_fused_lamb", {"grad_scale": 8.0}),  # lamb's options' numbers too
  ("keras_lamb", {"grad_scale": 8.0, "clipnorm": 0.2}),
]  # fmt: skip
_DECISION_CASES = [(c, kw, impl) for c, kw in _DECISIONS for impl in ("xla", "reference")]
_DECISION_CASES += [("apex_fused_lamb", {"weight_decay": 0.0}, "pallas")]
_DECISION_CASES += [("torch_optimizer_lamb", {"clamp_value": 0.0}, "pallas")]


@pytest.mark.parametrize(
  "ctor,kwargs,implementation",
  _slow_off_xla(_DECISION_CASES),
  ids=lambda x: str(x).replace(" ", ""),
)
def test_compat_decides_from_injected_values_at_each_step(ctor, kwargs, implementation):
  """Class 1, beyond the listed arguments: what a constructor decides from a number when built,
  it decides from an injected array's value at each step, with the same result."""
  kwargs = {**kwargs, "implementation": IMPLEMENTATIONS[implementation]}
  params, grads = _params(), _grads(3)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    injected = optax.inject_hyperparams(CONSTRUCTORS[ctor])(**kwargs)
    state = injected.init(params)
    got = _run(injected, params, grads)
    want = _run(CONSTRUCTORS[ctor](**kwargs), params, grads)
  assert all(isinstance(v, jax.Array) for v in state.hyperparams.values())
  _assert_close(got, want)


@pytest.mark.parametrize("ctor", sorted(CONSTRUCTORS))
def test_static_args_name_lamb_options_and_callables(ctor):
  """Class 1: lamb's keyword-only options are named in every constructor's signature, so that
  inject_hyperparams' static_args can name a callable one (else taken for a schedule)."""
  stacked = lambda params: {"w": 1, "b": 0}  # noqa: E731
  kwargs = {"stacked_axes": stacked, "implementation": "xla"}
  static = ["stacked_axes"]
  if "weight_decay_mask" in inspect.signature(CONSTRUCTORS[ctor]).parameters:
    kwargs["weight_decay_mask"] = lambda params: {"w": True, "b": False}
    static.append("weight_decay_mask")
  params, grads = _params(), _grads(3)
  injected = optax.inject_hyperparams(CONSTRUCTORS[ctor], static_args=static)(**kwargs)
  _assert_close(_run(injected, params, grads), _run(CONSTRUCTORS[ctor](**kwargs), params, grads))
  want = set(_LAMB_OPTIONS)
  assert want <= set(inspect.signature(CONSTRUCTORS[ctor]).parameters), ctor


@pytest.mark.parametrize(
  "ctor,arg", [("keras_lamb", "clipnorm"), ("keras_lamb", "global_clipnorm"),
               ("deepspeed_fused_lamb", "max_grad_norm"), ("apex_fused_lamb", "max_grad_norm")],
)  # fmt: skip
def test_a_nan_array_threshold_is_never_read_as_off(ctor, arg):
  """Class 1 and 2: a NaN threshold given as an array (not checkable when built) poisons the
  step; it is never read as "clips nothing"."""
  tx = CONSTRUCTORS[ctor](**{arg: jnp.float32(math.nan)}, implementation="xla")
  params = _params()
  updates, _ = jax.jit(tx.update)(_grads(1)[0], tx.init(params), params)
  assert not any(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


# --- class 2: silent wrong results -------------------------------------------------------------

# (constructor, argument, value): refused with a ValueError naming the argument. The issue's
# tfa_lamb cases, and keras_lamb's clips, which share the check that lets NaN through.
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
  """Class 2: a NaN clip threshold (or a non-finite legacy decay) is refused with an error that
  names the argument, not taken as "no clipping" or turned into NaN params."""
  with pytest.raises(ValueError, match=rf"\b{arg}\b"):
    CONSTRUCTORS[ctor](**{arg: value})


@pytest.mark.parametrize("ctor", ["keras_lamb", "tfa_lamb"])
def test_per_variable_clipnorm_clips_each_stacked_layer(ctor, device_count_seen):
  """Class 2: with stacked_axes, Keras' and TF Addons' per-variable clipnorm must compute what a
  model with one variable per layer computes (per slice). The lead decides between per slice
  and documenting per leaf: the assertion marked PER SLICE is the one that decides."""
  rng = np.random.default_rng(2)
  layers = 3
  stacked = {"w": jnp.asarray(rng.normal(size=(layers, 4, 3)), jnp.float32)}
  grads = []
  for _ in range(3):  # layers with gradient norms far apart, so a shared clip differs
    g = rng.normal(size=(layers, 4, 3)) * np.array([0.01, 1.0, 30.0])[:, None, None]
    grads.append({"w": jnp.asarray(g, jnp.float32)})
  split = lambda tree: {f"w{i}": tree["w"][i] for i in range(layers)}
  with_stacking = CONSTRUCTORS[ctor](clipnorm=0.1, stacked_axes={"w": 1})
  per_layer = CONSTRUCTORS[ctor](clipnorm=0.1)
  got = split(_run(with_stacking, stacked, grads))
  want = _run(per_layer, split(stacked), [split(g) for g in grads])
  _assert_close(got, want)  # PER SLICE


# --- class 4: every error names the argument as the library spells it ------------------------

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
  for p in inspect.signature(CONSTRUCTORS[ctor]).parameters.values():
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


_ERROR_CASES = [(c, a, v) for c in CONSTRUCTORS for a, v in _bad_values(c)]
_ERROR_CASES += [(c, m, None) for c in CONSTRUCTORS if c != "tfa_lamb" for m in _MASKS]


def _raised(ctor: str, arg: str, value: object) -> Exception:
  """The error of building (or, for what is read from the params, of stepping) the optimizer."""
  params = _params()
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
      tx = CONSTRUCTORS[ctor](**{arg: value})
      tx.update(_grads(1)[0], tx.init(params), params)
  except Exception as error:  # noqa: BLE001 (any error: its message is what is checked)
    return error
  pytest.fail(f"{ctor}({arg}={value!r}) was accepted")


@pytest.mark.parametrize("ctor,arg,value", _ERROR_CASES)
def test_errors_name_the_argument_as_the_library_spells_it(ctor, arg, value):
  """Class 4: every error a compat constructor raises names the argument the user passed, as
  that library spells it, and no core argument the constructor does not have (keras_lamb's
  epsilon, not eps; weight_decay_mask, not mask)."""
  message = str(_raised(ctor, arg, value))
  name = arg.split(":")[0]
  assert re.search(rf"\b{name}\b", message, re.IGNORECASE), f"{name} not in: {message}"
  own = set(inspect.signature(CONSTRUCTORS[ctor]).parameters) | set(_LAMB_OPTIONS)
  own |= _LIBRARY_WORDS.get(ctor, set())
  foreign = [n for n in sorted(_CORE_NAMES - own) if re.search(rf"\b{n}\b", message)]
  assert not foreign, f"{ctor}({name}=...) names {foreign}, not its arguments: {message}"
