"""The compat constructors under optax.inject_hyperparams: each numeric argument injected as an
array (traced under jit) computes what the constructor built with the same Python number
computes, decisions taken from a number are taken from the array at each step, and lamb's
options are named in every signature (so static_args can name a callable one).
"""

from __future__ import annotations

import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.implementations import TINY_BLOCKS
from helpers.two_leaves import assert_close, run_steps, tiny_grads, tiny_params

from optax_lamb import compat
from optax_lamb.backends.pallas_triton import PallasTritonBackend as PallasBackend

PALLAS = PallasBackend(block_sizes=TINY_BLOCKS, interpret=True)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}
CONSTRUCTORS = {name: getattr(compat, name) for name in compat.__all__}
# lamb's keyword-only options, which every constructor takes too.
LAMB_OPTIONS = (
  "stacked_axes",
  "axis_name",
  "implementation",
  "skip_nonfinite",
  "grad_scale",
  "master_weights",
)


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
  """A compat constructor under optax.inject_hyperparams, one numeric argument given
  (all its numeric defaults become arrays too, traced under jit), equals the constructor built
  with the same Python numbers."""
  kwargs = {arg: NUMBERS[ctor][arg], "implementation": IMPLEMENTATIONS[implementation]}
  params, grads = tiny_params(), tiny_grads(3)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    injected = optax.inject_hyperparams(CONSTRUCTORS[ctor])(**kwargs)
    got = run_steps(injected, params, grads)
    want = run_steps(CONSTRUCTORS[ctor](**kwargs), params, grads)
  assert_close(got, want)


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
  """Beyond the numeric arguments: what a constructor decides from a number when built,
  it decides from an injected array's value at each step, with the same result."""
  kwargs = {**kwargs, "implementation": IMPLEMENTATIONS[implementation]}
  params, grads = tiny_params(), tiny_grads(3)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*interpret mode")
    injected = optax.inject_hyperparams(CONSTRUCTORS[ctor])(**kwargs)
    state = injected.init(params)
    got = run_steps(injected, params, grads)
    want = run_steps(CONSTRUCTORS[ctor](**kwargs), params, grads)
  assert all(isinstance(v, jax.Array) for v in state.hyperparams.values())
  assert_close(got, want)


@pytest.mark.parametrize("ctor", sorted(CONSTRUCTORS))
def test_static_args_name_lamb_options_and_callables(ctor):
  """lamb's keyword-only options are named in every constructor's signature, so that
  inject_hyperparams' static_args can name a callable one (else taken for a schedule)."""
  stacked = lambda params: {"w": 1, "b": 0}  # noqa: E731
  kwargs = {"stacked_axes": stacked, "implementation": "xla"}
  static = ["stacked_axes"]
  if "weight_decay_mask" in inspect.signature(CONSTRUCTORS[ctor]).parameters:
    kwargs["weight_decay_mask"] = lambda params: {"w": True, "b": False}
    static.append("weight_decay_mask")
  params, grads = tiny_params(), tiny_grads(3)
  injected = optax.inject_hyperparams(CONSTRUCTORS[ctor], static_args=static)(**kwargs)
  assert_close(
    run_steps(injected, params, grads), run_steps(CONSTRUCTORS[ctor](**kwargs), params, grads)
  )
  want = set(LAMB_OPTIONS)
  assert want <= set(inspect.signature(CONSTRUCTORS[ctor]).parameters), ctor


@pytest.mark.parametrize(
  "ctor,arg", [("keras_lamb", "clipnorm"), ("keras_lamb", "global_clipnorm"),
               ("deepspeed_fused_lamb", "max_grad_norm"), ("apex_fused_lamb", "max_grad_norm")],
)  # fmt: skip
def test_a_nan_array_threshold_is_never_read_as_off(ctor, arg):
  """A NaN threshold given as an array (not checkable when built) poisons the
  step; it is never read as "clips nothing"."""
  tx = CONSTRUCTORS[ctor](**{arg: jnp.float32(math.nan)}, implementation="xla")
  params = tiny_params()
  updates, _ = jax.jit(tx.update)(tiny_grads(1)[0], tx.init(params), params)
  assert not any(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
