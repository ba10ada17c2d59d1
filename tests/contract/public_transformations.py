"""The one list of public transformations that `test_public_contract.py` runs through optax's
contract: each entry a name, a builder and its numeric arguments (like optax's own test lists).

`build(**numbers)` returns the transformation; its keyword arguments are the entry's numeric
arguments, each given a valid value other than its default that acts on the contract's tiny tree
(a clip that binds, a decay that is on), so that every check runs the transformation with them.
A wrapper's builder wraps `lamb` and also takes lamb's learning rate, so that what it wraps is
injected too. `params_copies` is how many trees shaped like the params the state holds (the
moments, a master copy): what `optax.tree_map_params` must map. `exclusions` names a check the
transformation cannot pass by its library's semantics, with why; the suite then asserts the
exclusion still holds (the clear error, or the difference), so no check is skipped silently.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from helpers.options import LAMB_NUMBERS

import optax_lamb
from optax_lamb import compat

CHECKS = (
  "pure_init",
  "jit",
  "inject_hyperparams",
  "multi_steps",
  "tree_map_params",
  "dtypes",
  "sharding",
)


@dataclasses.dataclass(frozen=True)
class Injection:
  """Numbers `optax.inject_hyperparams` injects together (each a jnp array), against the plain
  constructor given the same Python numbers, `plain` replacing those it refuses as numbers. One
  of an entry's `more_injections` is its `numbers` less `drop` (an argument that cannot be given
  with this one's), plus this one's."""

  numbers: dict[str, Any]
  drop: tuple[str, ...] = ()
  plain: dict[str, Any] = dataclasses.field(default_factory=dict)
  flags: dict[str, Any] = dataclasses.field(default_factory=dict)  # both sides: static arguments
  same_state: bool = True  # False: a `plain` schedule keeps a count in a state the array lacks


@dataclasses.dataclass(frozen=True)
class Exclusion:
  """A check the transformation cannot pass: why, and the error it fails with (asserted)."""

  why: str
  error: type[Exception]
  match: str


@dataclasses.dataclass(frozen=True)
class Entry:
  name: str
  build: Callable[..., optax.GradientTransformation]
  numbers: dict[str, Any]
  params_copies: int
  # the public constructor whose numeric arguments the injections must cover (None: `build`)
  constructor: Callable | None = None
  # numbers that cannot be given with `numbers` (one of two exclusive clips, an alias)
  more_injections: tuple[Injection, ...] = ()
  not_injected: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why
  update_dtype: Callable[[Any], Any] = lambda dtype: dtype  # of a param's dtype
  # how optax.MultiSteps(every 2) goes with it, given `numbers` (None: MultiSteps around it)
  multi_steps: Callable[..., optax.GradientTransformation] | None = None
  exclusions: dict[str, Exclusion] = dataclasses.field(default_factory=dict)
  # inject_hyperparams' static_args: a dtype such as jnp.int8 is callable, so it would be taken
  # for a schedule, called with the step count, and reach the constructor as an array
  static_args: tuple[str, ...] = ()

  def transformation(self) -> optax.GradientTransformation:
    return self.build(**self.numbers)

  def injections(self) -> tuple[Injection, ...]:
    kept = lambda i: {k: v for k, v in self.numbers.items() if k not in i.drop}  # noqa: E731
    more = [dataclasses.replace(i, numbers={**kept(i), **i.numbers}) for i in self.more_injections]
    return (Injection(self.numbers), *more)


LR = 1e-2  # the learning rate a wrapper's lamb is built with (its builder's default)


def _skip_nonfinite(learning_rate=LR, max_consecutive_errors=None):
  return optax_lamb.skip_nonfinite(
    optax_lamb.lamb(learning_rate), max_consecutive_errors=max_consecutive_errors
  )


def _with_master_weights(learning_rate=LR):
  return optax_lamb.with_master_weights(optax_lamb.lamb(learning_rate))


def _offload(learning_rate=LR, *, compute="device"):
  return optax_lamb.offload(optax_lamb.lamb(learning_rate), compute=compute)


def _offload_host(learning_rate=LR):
  return _offload(learning_rate, compute="host")


def _offload_multi_steps(compute):
  """MultiSteps inside the offload, as offload's docstring says to compose them."""
  return lambda learning_rate=LR: optax_lamb.offload(
    optax.MultiSteps(optax_lamb.lamb(learning_rate), every_k_schedule=2), compute=compute
  )


_BETAS = "a pair: inject_hyperparams injects numbers only and keeps a tuple as a static argument"
# optax.MultiSteps chooses between its inner state and the updated one with lax.cond, whose
# branches must agree on memory spaces: the kept state is in host memory, the updated one
# (inside the jitted step, before offload's copy back) in device memory. offload's docstring
# says to put MultiSteps inside (`multi_steps` below), which the check runs instead.
_MULTI_STEPS_OUTSIDE_OFFLOAD = Exclusion(
  "MultiSteps around offload: its lax.cond mixes host and device memory",
  TypeError,
  "cond branches must have equal output types",
)

_lamb_fused_wrappers = functools.partial(optax_lamb.lamb, skip_nonfinite=True, master_weights=True)
_lamb_8bit = functools.partial(optax_lamb.lamb, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)

ENTRIES = (
  Entry("lamb", optax_lamb.lamb, params_copies=2, numbers=LAMB_NUMBERS),
  # lamb's own skipping and master weights (fused into its step): the master copy, two moments
  Entry("lamb(skip_nonfinite, master_weights)", _lamb_fused_wrappers, params_copies=3,
        constructor=optax_lamb.lamb, numbers=LAMB_NUMBERS),
  # 8-bit moments: each a QuantizedMoment (codes shaped like the param, block scales)
  Entry("lamb(mu_dtype=int8, nu_dtype=uint8)", _lamb_8bit, params_copies=2,
        constructor=optax_lamb.lamb, numbers=LAMB_NUMBERS, static_args=("mu_dtype", "nu_dtype")),
  Entry("scale_by_adam", optax_lamb.scale_by_adam, params_copies=2, numbers={
    "b1": 0.8, "b2": 0.99, "eps": 1e-4, "eps_root": 1e-8}),
  Entry("add_decayed_weights", optax_lamb.add_decayed_weights, params_copies=0,
        numbers={"weight_decay": 0.1}),
  Entry("scale_by_trust_ratio", optax_lamb.scale_by_trust_ratio, params_copies=0, numbers={
    "min_norm": 0.05, "trust_coefficient": 0.5, "eps": 1e-3, "min_ratio": 0.5, "max_ratio": 0.7}),
  Entry("clip_by_global_norm", optax_lamb.clip_by_global_norm, params_copies=0,
        numbers={"max_norm": 0.5}),
  # documented: low-precision gradients come back in float32 (they may underflow unscaled)
  Entry("unscale_gradients", optax_lamb.unscale_gradients, params_copies=0,
        numbers={"grad_scale": 4.0},
        update_dtype=lambda dtype: jnp.promote_types(dtype, jnp.float32)),
  Entry("skip_nonfinite", _skip_nonfinite, params_copies=2, constructor=optax_lamb.skip_nonfinite,
        numbers={"learning_rate": 2e-2, "max_consecutive_errors": 3}),
  # master copy, then lamb's two moments
  Entry("with_master_weights", _with_master_weights, params_copies=3,
        constructor=optax_lamb.with_master_weights, numbers={"learning_rate": 2e-2}),
  Entry("offload", _offload, params_copies=2, constructor=optax_lamb.offload,
        numbers={"learning_rate": 2e-2}, multi_steps=_offload_multi_steps("device"),
        exclusions={"multi_steps": _MULTI_STEPS_OUTSIDE_OFFLOAD}),
  Entry("offload(compute=host)", _offload_host, params_copies=2,
        constructor=optax_lamb.offload, numbers={"learning_rate": 2e-2},
        multi_steps=_offload_multi_steps("host"),
        exclusions={"multi_steps": _MULTI_STEPS_OUTSIDE_OFFLOAD}),
  Entry("apex_fused_lamb", compat.apex_fused_lamb, params_copies=2, numbers={
    "lr": 2e-3, "eps": 1e-5, "weight_decay": 0.05, "max_grad_norm": 0.5, "grad_scale": 4.0},
    not_injected={"betas": _BETAS}),
  Entry("deepspeed_fused_lamb", compat.deepspeed_fused_lamb, params_copies=2, numbers={
    "lr": 2e-3, "eps": 1e-6, "weight_decay": 0.05, "max_grad_norm": 0.5, "max_coeff": 0.5,
    "min_coeff": 0.2, "grad_scale": 4.0}, not_injected={"betas": _BETAS}),
  Entry("timm_lamb", compat.timm_lamb, params_copies=2, numbers={
    "lr": 2e-3, "eps": 1e-5, "weight_decay": 0.05, "max_grad_norm": 0.5, "grad_scale": 4.0},
    not_injected={"betas": _BETAS},
    # base_lr acts with corrected_weight_decay, and is refused beside a float lr (its own
    # base): the plain side takes lr as a constant schedule
    more_injections=(Injection(
      {"base_lr": 1e-3},
      plain={"lr": optax.constant_schedule(2e-3)},
      flags={"decoupled_decay": True, "corrected_weight_decay": True}, same_state=False),)),
  Entry("torch_optimizer_lamb", compat.torch_optimizer_lamb, params_copies=2, numbers={
    "lr": 2e-3, "eps": 1e-5, "weight_decay": 0.05, "clamp_value": 0.5, "grad_scale": 4.0},
    not_injected={"betas": _BETAS}),
  # Keras takes one of clipnorm, clipvalue and global_clipnorm
  Entry("keras_lamb", compat.keras_lamb, params_copies=2, numbers={
    "learning_rate": 2e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6, "weight_decay": 0.05,
    "clipnorm": 0.5, "grad_scale": 4.0},
    more_injections=(Injection({"clipvalue": 0.1}, drop=("clipnorm",)),
                     Injection({"global_clipnorm": 0.5}, drop=("clipnorm",)))),
  # TF Addons refuses clipnorm with global_clipnorm; lr is learning_rate's old name
  Entry("tfa_lamb", compat.tfa_lamb, params_copies=2, numbers={
    "learning_rate": 2e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5, "weight_decay": 0.05,
    "decay": 0.1, "clipnorm": 0.5, "clipvalue": 0.1, "grad_scale": 4.0},
    more_injections=(Injection({"global_clipnorm": 0.5}, drop=("clipnorm",)),
                     Injection({"lr": 2e-3}, drop=("learning_rate",)))),
  # grad_scale is loss_scale's other name: one of the two
  Entry("onnxruntime_lamb", compat.onnxruntime_lamb, params_copies=2, numbers={
    "lr": 2e-3, "alpha": 0.8, "beta": 0.99, "lambda_coef": 0.05, "epsilon": 1e-5,
    "max_norm_clip": 0.5, "ratio_min": 0.2, "ratio_max": 3.0, "loss_scale": 8.0},
    more_injections=(Injection({"grad_scale": 4.0}, drop=("loss_scale",)),)),
)  # fmt: skip


def numeric_parameters(function: Callable) -> set[str]:
  """The parameters of `function` that take a number: a number (not a bool) as default, or an
  annotation that names a float or a schedule."""
  names = set()
  for name, p in inspect.signature(function).parameters.items():
    default_is_number = isinstance(p.default, int | float) and not isinstance(p.default, bool)
    annotation = str(p.annotation)
    if default_is_number or re.search(r"\b(float|int|ScalarOrSchedule)\b", annotation):
      names.add(name)
  return names
