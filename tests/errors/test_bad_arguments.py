"""Every Python-valued argument is checked when the transformation is built.

Each bad value of each argument of `lamb` and of the public stages and wrappers
raises when the transformation is built, with ``{name} must be ..., got
{name}={value!r}``. NaN fails every comparison, so it is tried for every
number; so are inf, wrong types (None, strings, bools for numbers, non-scalar
arrays) and integer dtypes for the moment dtypes. Python ints for float
arguments, NumPy scalars, jax scalar arrays (``optax.inject_hyperparams``, also
under jit) and schedules stay accepted. A bad ``grad_scale`` at update: `failed_calls.py`.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb
from optax_lamb import compat

NAN, INF = float("nan"), float("inf")
lamb = functools.partial(optax_lamb.lamb, 1e-3)


def case(factory, error, shown=None, **kwargs):
  """A bad call `factory(**kwargs)`; `shown`: the text after "got " (default name=value)."""
  if shown is None:
    ((name, value),) = kwargs.items()
    shown = f"{name}={value!r}"
  label = getattr(factory, "__name__", None) or factory.func.__name__
  return pytest.param(factory, kwargs, error, shown, id=f"{label}({shown})")


CASES = [
  # lamb: each argument, in the order of its signature.
  case(optax_lamb.lamb, TypeError, learning_rate=None),
  case(optax_lamb.lamb, TypeError, learning_rate="1e-3"),
  case(optax_lamb.lamb, TypeError, learning_rate=True),
  case(optax_lamb.lamb, ValueError, learning_rate=NAN),
  case(optax_lamb.lamb, ValueError, learning_rate=INF),
  case(optax_lamb.lamb, ValueError, learning_rate=-1e-3),
  case(optax_lamb.lamb, ValueError, learning_rate=np.float32(NAN)),
  case(optax_lamb.lamb, ValueError, learning_rate=np.asarray(NAN)),
  case(optax_lamb.lamb, TypeError, learning_rate=jnp.ones(2)),
  case(optax_lamb.lamb, TypeError, learning_rate=jnp.asarray(True)),
  case(lamb, ValueError, b1=NAN),
  case(lamb, ValueError, b1=1.0),
  case(lamb, ValueError, b1=-0.1),
  case(lamb, TypeError, b1="0.9"),
  case(lamb, TypeError, b1=None),
  case(lamb, ValueError, b2=NAN),
  case(lamb, ValueError, b2=INF),
  case(lamb, ValueError, b2=1.5),
  case(lamb, ValueError, b2=-1e-3),
  case(lamb, ValueError, eps=NAN),
  case(lamb, ValueError, eps=INF),
  case(lamb, ValueError, eps=-1e-8),
  case(lamb, TypeError, eps=None),
  case(lamb, ValueError, eps_root=NAN),
  case(lamb, ValueError, eps_root=INF),
  case(lamb, ValueError, eps_root=-1.0),
  case(lamb, ValueError, "eps=0.0, eps_root=0.0", eps=0.0, eps_root=0.0),
  case(lamb, ValueError, "eps=0, eps_root=0.0", eps=0),
  case(lamb, ValueError, weight_decay=NAN),
  case(lamb, ValueError, weight_decay=INF),
  case(lamb, ValueError, weight_decay=-0.01),
  case(lamb, TypeError, weight_decay="0.01"),
  case(lamb, TypeError, weight_decay=None),
  case(lamb, TypeError, mask="no"),
  case(lamb, TypeError, mask=1),
  case(lamb, TypeError, "mask['b']=0", mask={"w": True, "b": 0}),
  case(lamb, TypeError, bias_correction="no"),
  case(lamb, TypeError, bias_correction=1),
  case(lamb, TypeError, bias_correction=None),
  case(lamb, TypeError, trust_ratio_mask="no"),
  case(lamb, TypeError, trust_ratio_mask=0),
  case(lamb, TypeError, "trust_ratio_mask['w']='yes'", trust_ratio_mask={"w": "yes"}),
  case(lamb, ValueError, min_trust_ratio=NAN),
  case(lamb, ValueError, min_trust_ratio=INF),
  case(lamb, ValueError, min_trust_ratio=-1.0),
  case(lamb, TypeError, min_trust_ratio="0.1"),
  case(lamb, ValueError, max_trust_ratio=NAN),
  case(lamb, ValueError, max_trust_ratio=INF),
  case(lamb, ValueError, max_trust_ratio=-1.0),
  case(
    lamb,
    ValueError,
    "min_trust_ratio=2.0 > max_trust_ratio=1.0",
    min_trust_ratio=2.0,
    max_trust_ratio=1.0,
  ),
  case(lamb, ValueError, max_grad_norm=NAN),
  case(lamb, ValueError, max_grad_norm=INF),
  case(lamb, ValueError, max_grad_norm=0.0),
  case(lamb, ValueError, max_grad_norm=-1.0),
  case(lamb, TypeError, max_grad_norm="1.0"),
  case(lamb, TypeError, stacked_axes="1"),
  case(lamb, TypeError, stacked_axes=1.0),
  case(lamb, TypeError, stacked_axes=True),
  case(lamb, ValueError, stacked_axes=-1),
  case(lamb, ValueError, "stacked_axes['w']=-1", stacked_axes={"w": -1, "b": 0}),
  case(lamb, TypeError, mu_dtype=jnp.int32),
  case(lamb, TypeError, mu_dtype="no"),
  case(lamb, TypeError, mu_dtype=bool),
  case(lamb, TypeError, nu_dtype="int16"),
  case(lamb, TypeError, nu_dtype=jnp.complex64),
  case(lamb, TypeError, axis_name=1),
  case(lamb, TypeError, "axis_name[1]=2", axis_name=("data", 2)),
  case(lamb, TypeError, "axis_name['w']=3", axis_name={"w": 3, "b": None}),
  case(lamb, ValueError, implementation="cuda"),
  case(lamb, ValueError, implementation=None),
  case(lamb, TypeError, skip_nonfinite=None),
  case(lamb, TypeError, skip_nonfinite="no"),
  case(lamb, ValueError, grad_scale=NAN),
  case(lamb, ValueError, grad_scale=INF),
  case(lamb, TypeError, grad_scale="1024"),
  case(lamb, TypeError, grad_scale=jnp.ones(2)),
  case(lamb, TypeError, master_weights="yes"),
  case(lamb, TypeError, master_weights=None),
  # The stages and wrappers, with their own argument names.
  case(optax_lamb.scale_by_adam, ValueError, b1=NAN),
  case(optax_lamb.scale_by_adam, ValueError, b1=1.0),
  case(optax_lamb.scale_by_adam, ValueError, b2=1.0),
  case(optax_lamb.scale_by_adam, ValueError, eps=NAN),
  case(optax_lamb.scale_by_adam, ValueError, eps=-1.0),
  case(optax_lamb.scale_by_adam, ValueError, eps_root=INF),
  case(optax_lamb.scale_by_adam, ValueError, "eps=0.0, eps_root=0", eps=0.0, eps_root=0),
  case(optax_lamb.scale_by_adam, TypeError, bias_correction="no"),
  case(optax_lamb.scale_by_adam, TypeError, mu_dtype=jnp.int32),
  case(optax_lamb.scale_by_adam, TypeError, nu_dtype="uint16"),
  case(optax_lamb.add_decayed_weights, ValueError, weight_decay=NAN),
  case(optax_lamb.add_decayed_weights, ValueError, weight_decay=-1.0),
  case(optax_lamb.add_decayed_weights, TypeError, weight_decay="0.1"),
  case(optax_lamb.add_decayed_weights, TypeError, mask="no"),
  case(optax_lamb.scale_by_trust_ratio, ValueError, min_norm=NAN),
  case(optax_lamb.scale_by_trust_ratio, ValueError, min_norm=-1.0),
  case(optax_lamb.scale_by_trust_ratio, ValueError, trust_coefficient=NAN),
  case(optax_lamb.scale_by_trust_ratio, ValueError, trust_coefficient=0.0),
  case(optax_lamb.scale_by_trust_ratio, ValueError, trust_coefficient=INF),
  case(optax_lamb.scale_by_trust_ratio, ValueError, eps=NAN),
  case(optax_lamb.scale_by_trust_ratio, TypeError, mask="no"),
  case(optax_lamb.scale_by_trust_ratio, ValueError, min_ratio=NAN),
  case(optax_lamb.scale_by_trust_ratio, ValueError, max_ratio=INF),
  case(
    optax_lamb.scale_by_trust_ratio,
    ValueError,
    "min_ratio=3.0 > max_ratio=2.0",
    min_ratio=3.0,
    max_ratio=2.0,
  ),
  case(optax_lamb.scale_by_trust_ratio, TypeError, stacked_axes="1"),
  case(optax_lamb.scale_by_trust_ratio, TypeError, axis_name=1),
  case(optax_lamb.clip_by_global_norm, ValueError, max_norm=NAN),
  case(optax_lamb.clip_by_global_norm, ValueError, max_norm=0.0),
  case(optax_lamb.clip_by_global_norm, ValueError, max_norm=INF),
  case(optax_lamb.clip_by_global_norm, TypeError, max_norm=None),
  case(functools.partial(optax_lamb.clip_by_global_norm, 1.0), TypeError, axis_name=0),
  case(optax_lamb.unscale_gradients, ValueError, grad_scale=NAN),
  case(optax_lamb.unscale_gradients, ValueError, grad_scale=0.0),
  case(optax_lamb.unscale_gradients, TypeError, grad_scale="2"),
  case(optax_lamb.with_master_weights, TypeError, inner="sgd"),
  case(optax_lamb.with_master_weights, TypeError, inner=None),
  case(
    functools.partial(optax_lamb.with_master_weights, optax.sgd(0.1)),
    TypeError,
    dtype=jnp.int32,
  ),
  case(functools.partial(optax_lamb.with_master_weights, optax.sgd(0.1)), TypeError, dtype=None),
  case(optax_lamb.skip_nonfinite, TypeError, inner="sgd"),
  case(functools.partial(optax_lamb.skip_nonfinite, optax.sgd(0.1)), TypeError, axis_name=3),
  *(
    case(functools.partial(optax_lamb.skip_nonfinite, optax.sgd(0.1)), error, **kw)
    for error, kw in [
      (ValueError, dict(max_consecutive_errors=-1)),
      (TypeError, dict(max_consecutive_errors=1.5)),
      (TypeError, dict(max_consecutive_errors=True)),
      (TypeError, dict(check_results="yes")),
    ]
  ),
  case(
    functools.partial(optax_lamb.skip_nonfinite, optax.sgd(0.1)),
    TypeError,
    "axis_name[1]=3",
    axis_name=("i", 3),
  ),
]


@pytest.mark.parametrize("factory, kwargs, error, shown", CASES)
def test_bad_argument_fails_when_built_naming_it(factory, kwargs, error, shown):
  name = re.match(r"\w+", shown).group()
  with pytest.raises(error, match=rf"^{name} must be .*got {re.escape(shown)}$"):
    factory(**kwargs)


@pytest.mark.parametrize(
  "factory", [optax_lamb.lamb, optax_lamb.scale_by_adam], ids=["lamb", "adam"]
)
@pytest.mark.parametrize(
  "kwargs, shown",
  [
    ({"mu_dtype": jnp.uint8}, "mu_dtype=uint8"),
    ({"mu_dtype": "uint8"}, "mu_dtype=uint8"),
    ({"nu_dtype": jnp.int8}, "nu_dtype=int8"),
    ({"nu_dtype": np.int8}, "nu_dtype=int8"),
  ],
)
def test_the_wrong_8bit_dtype_for_a_moment_fails_naming_it(factory, kwargs, shown):
  # int8 selects the signed quantized map of m, uint8 the unsigned one of v: never a cast.
  kwargs = {**kwargs, "learning_rate": 1e-3} if factory is optax_lamb.lamb else kwargs
  with pytest.raises(ValueError, match=rf"^{re.escape(shown)}: 8-bit moments are block-wise"):
    factory(**kwargs)


def test_the_8bit_dtypes_select_quantized_moments():
  params = {"w": jnp.ones((16, 256)), "b": jnp.ones(3)}
  for tx in (
    optax_lamb.lamb(1e-3, mu_dtype=jnp.int8, nu_dtype=jnp.uint8),
    optax_lamb.scale_by_adam(mu_dtype="int8", nu_dtype="uint8"),
  ):
    adam = next(s for s in jax.tree.leaves(tx.init(params), is_leaf=lambda x: hasattr(x, "mu"))
                if hasattr(s, "mu"))  # fmt: skip
    assert adam.mu["w"].codes.dtype == jnp.int8 and adam.nu["w"].codes.dtype == jnp.uint8
    assert adam.mu["b"].dtype == adam.nu["b"].dtype == jnp.float32  # small: float32


def params_and_grads():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.ones(3)}
  return params, jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(learning_rate=0),  # ints for float arguments
    dict(b1=0, b2=0, eps=0, eps_root=1, weight_decay=0, min_trust_ratio=0, max_trust_ratio=10),
    dict(max_grad_norm=1, grad_scale=2),
    dict(learning_rate=np.float32(1e-3), weight_decay=np.float64(0.1), b1=np.float16(0.5)),
    dict(learning_rate=np.asarray(1e-3), weight_decay=jnp.asarray(0.1), grad_scale=jnp.asarray(2)),
    dict(learning_rate=optax.linear_schedule(1e-3, 0.0, 10), weight_decay=lambda count: 0.01),
    dict(min_trust_ratio=1.0, max_trust_ratio=1.0),
    dict(bias_correction=np.bool_(False), skip_nonfinite=np.True_, master_weights=False),
    dict(mu_dtype="bfloat16", nu_dtype=jnp.float32),
    dict(mu_dtype=np.dtype("float16"), nu_dtype=jnp.bfloat16),
    dict(mask={"w": np.True_, "b": False}, trust_ratio_mask={"w": True, "b": None}),
    dict(stacked_axes={"w": np.int64(1), "b": None}, trust_ratio_mask=True, mask=False),
    dict(axis_name={"w": None, "b": None}),
  ],
)
def test_good_arguments_are_accepted(kwargs):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  params, grads = params_and_grads()
  tx = optax_lamb.lamb(**kwargs)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
  if kwargs["learning_rate"] == 0:
    assert all(not bool(jnp.any(u)) for u in jax.tree.leaves(updates))


def test_array_hyperparameters_are_not_checked_at_build_time():
  # A jax array may be a tracer (inject_hyperparams under jit): its value is not read.
  optax_lamb.lamb(jnp.asarray(1e-3), b1=jnp.asarray(0.9), weight_decay=jnp.asarray(NAN))


def test_inject_hyperparams_passes_every_number_as_an_array_under_jit():
  """inject_hyperparams builds lamb inside init and the jitted update, with (traced) arrays."""
  numbers = dict(
    learning_rate=1e-2,
    b1=0.8,
    b2=0.99,
    eps=1e-6,
    eps_root=0,  # an int array
    weight_decay=0.1,
    min_trust_ratio=0.1,
    max_trust_ratio=5.0,
    max_grad_norm=1.0,
    grad_scale=4.0,
  )
  params, grads = params_and_grads()
  injected = optax.inject_hyperparams(optax_lamb.lamb)(**numbers, bias_correction=False)
  plain = optax_lamb.lamb(**numbers, bias_correction=False)
  state = jax.jit(injected.init)(params)
  assert isinstance(state.hyperparams["eps_root"], jax.Array)
  got, _ = jax.jit(injected.update)(grads, state, params)
  want, _ = plain.update(grads, plain.init(params), params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_inject_hyperparams_reports_a_bad_value_by_name():
  params, _ = params_and_grads()
  with pytest.raises(TypeError, match=r"learning_rate must be .*got learning_rate='1e-3'$"):
    optax.inject_hyperparams(optax_lamb.lamb)(learning_rate="1e-3").init(params)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (
      dict(skip_nonfinite="yes"),
      TypeError,
      r"skip_nonfinite must be True or False, got skip_nonfinite='yes'",
    ),
    (
      dict(master_weights=1),
      TypeError,
      r"master_weights must be True or False, got master_weights=1",
    ),
    (
      dict(grad_scale=0.0),
      ValueError,
      r"grad_scale must be a finite number > 0, got grad_scale=0.0",
    ),
    (
      dict(grad_scale=-1024),
      ValueError,
      r"grad_scale must be a finite number > 0, got grad_scale=-1024",
    ),
  ],
)
def test_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_lamb.lamb(1e-2, **kwargs)


# ------------------------------------------ compat.onnxruntime_lamb's do_bias_correction

ORT_SPELLINGS = [1, 0, True, False, np.int64(1), np.int32(0), np.bool_(True), jnp.asarray(1),
                 jnp.asarray(0, jnp.int8), jnp.asarray(True)]  # fmt: skip


def _ort_steps(tx, params, grads, update=None, steps=2):
  """The updates of the last of `steps` steps (the gradients scaled differently each step)."""
  update = update or tx.update
  state = tx.init(params)
  for step in range(steps):
    scaled = jax.tree.map(lambda g, k=1 + step: g * k, grads)
    updates, state = update(scaled, state, params)
  return updates


def _ort(**kwargs):  # with weight decay, bias correction changes the direction, not only its scale
  return compat.onnxruntime_lamb(0.1, lambda_coef=0.5, **kwargs)


@pytest.mark.parametrize("flag", ORT_SPELLINGS, ids=repr)
def test_onnxruntime_do_bias_correction_takes_ort_spellings(flag):
  """0/1 (ONNX Runtime's own spelling, an int attribute), bools and 0-d integer or boolean arrays
  build the same step as the bool; directly and through inject_hyperparams, which keeps an int
  (not a bool) as an array in its state, traced under jit."""
  params, grads = params_and_grads()
  on = bool(flag)
  want = _ort_steps(_ort(do_bias_correction=on), params, grads)
  other = _ort_steps(_ort(do_bias_correction=not on), params, grads)
  got = _ort_steps(_ort(do_bias_correction=flag), params, grads)
  chex.assert_trees_all_equal(got, want)
  inject = lambda flag: optax.inject_hyperparams(compat.onnxruntime_lamb)(
    lr=0.1, lambda_coef=0.5, do_bias_correction=flag
  )  # its hyper-parameters as arrays: the same step as a bool flag's (which it keeps static)
  injected, static = inject(flag), inject(on)
  for jit in (False, True):
    update = jax.jit(injected.update) if jit else injected.update
    got = _ort_steps(injected, params, grads, update)
    expected = _ort_steps(static, params, grads, jax.jit(static.update) if jit else None)
    chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(got["w"], other["w"], rtol=1e-3)  # the flag chose the step


@pytest.mark.parametrize(
  "flag", [2, -1, 1.0, "1", None, jnp.asarray(2), jnp.ones(2, jnp.int32), jnp.asarray(1.0)],
  ids=repr,
)  # fmt: skip
def test_onnxruntime_do_bias_correction_outside_0_and_1_is_refused_naming_it(flag):
  shown = re.escape(f"do_bias_correction={flag!r}")
  with pytest.raises(RuntimeError, match=rf"do_bias_correction must be either 0 or 1.*{shown}"):
    compat.onnxruntime_lamb(0.1, do_bias_correction=flag)
