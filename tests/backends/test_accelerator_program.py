"""No host round trip in the step an accelerator runs: lowered for a GPU (and a TPU), on the CPU.

XLA:GPU runs a conditional's branch choice and a while loop's predicate on the host: it copies
the predicate from the device and waits for it, every step (benchmarks/NOTES.md, "The XLA path's
host wait"). So the step lowered for ``cuda`` (``jax.jit(step).trace(...).lower(
lowering_platforms=...)``: lowering only, nothing compiled, no GPU needed) must hold no
``stablehlo.case``/``stablehlo.if`` whose index is computed from the step's data, and no
``stablehlo.while``, in every configuration of `lamb`, its stages, every compat constructor and
`offload`, in both step forms, for the implementations "xla", "auto" and "reference" (traced on
the CPU, "auto" takes the XLA path, which is what several GPUs under jit and TPUs get).

What stays, and is counted apart: ``jax.lax.platform_dependent`` (the package's CPU-only
choices) lowered for one platform leaves a ``stablehlo.case`` on a constant index (and cases on
that case's constant results), one branch each, which XLA folds before anything runs. A case
is static here when its index is a constant, such a case's result (every branch returning a
constant), or the ``_platform_index`` argument of a multi-platform lowering.

TPU: jax 0.10.2 lowers for "tpu" without the hardware (the lowering rules are jax's own), so
every configuration is checked for it too.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lamb
from optax_lamb import compat

PLATFORMS = ("cuda", "tpu")
SHAPES = {
  "w": (128, 64),  # 8-bit moments quantize it (>= 4096 elements, a last axis > 1)
  "stack": (2, 64, 64),  # stacked: a ratio per slice
  "b": (64,),
  "s": (),
}
STACKED = {"w": 0, "stack": 1, "b": 0, "s": 0}
LR = 1e-3
RULE = optax_lamb.SpikeRule(factor=3.0, warmup_steps=2, decay=0.9)


def _lamb(**kwargs):
  return lambda impl: optax_lamb.lamb(LR, weight_decay=0.01, implementation=impl, **kwargs)


def _compat(make, **kwargs):
  return lambda impl: make(implementation=impl, **kwargs)


# name: (implementation -> transformation, params' dtype, extra update arguments)
LAMB = {
  "default": _lamb(),
  "max_grad_norm": _lamb(max_grad_norm=1.0),
  "skip_nonfinite": _lamb(skip_nonfinite=True),
  "skip, clip, spikes": _lamb(skip_nonfinite=True, max_grad_norm=1.0, skip_spikes=RULE),
  "grad_scale": _lamb(grad_scale=1024.0),
  "grad_scale per step, skip": _lamb(skip_nonfinite=True),
  "bf16 params, master weights, skip": _lamb(master_weights=True, skip_nonfinite=True),
  "bf16 moments": _lamb(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
  "bf16 moments, skip, clip": _lamb(
    mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, skip_nonfinite=True, max_grad_norm=1.0
  ),
  "8-bit moments": _lamb(mu_dtype=jnp.int8, nu_dtype=jnp.uint8),
  "8-bit moments, skip, stacked": _lamb(
    mu_dtype=jnp.int8, nu_dtype=jnp.uint8, skip_nonfinite=True, stacked_axes=STACKED
  ),
  "stacked, clip, ratio bounds": _lamb(
    stacked_axes=STACKED, max_grad_norm=1.0, min_trust_ratio=0.1, max_trust_ratio=10.0
  ),
}
COMPAT = {
  "apex": _compat(compat.apex_fused_lamb, lr=LR, weight_decay=0.01, max_grad_norm=1.0),
  "apex L2, skip": _compat(compat.apex_fused_lamb, lr=LR, adam_w_mode=False, skip_nonfinite=True),
  "deepspeed": _compat(compat.deepspeed_fused_lamb, lr=LR, weight_decay=0.01, max_coeff=5.0),
  "timm": _compat(compat.timm_lamb, lr=LR, weight_decay=0.01, max_grad_norm=1.0),
  "timm caution": _compat(compat.timm_lamb, lr=LR, weight_decay=0.01, caution=True),
  "torch_optimizer": _compat(compat.torch_optimizer_lamb, lr=LR, clamp_value=5.0),
  "keras": _compat(compat.keras_lamb, learning_rate=LR, weight_decay=0.01, clipnorm=1.0),
  "tfa": _compat(compat.tfa_lamb, learning_rate=LR, weight_decay=0.01, global_clipnorm=1.0),
  "onnxruntime": _compat(compat.onnxruntime_lamb, lr=LR, lambda_coef=0.01, max_norm_clip=1.0),
  "onnxruntime, skip, loss_scale": _compat(
    compat.onnxruntime_lamb, lr=LR, loss_scale=512.0, skip_nonfinite=True
  ),
}
STAGES = {  # the public stages have no implementation: plain jnp
  "scale_by_adam": lambda: optax_lamb.scale_by_adam(),
  "scale_by_adam 8-bit": lambda: optax_lamb.scale_by_adam(mu_dtype=jnp.int8, nu_dtype=jnp.uint8),
  "add_decayed_weights": lambda: optax_lamb.add_decayed_weights(0.01),
  "scale_by_trust_ratio": lambda: optax_lamb.scale_by_trust_ratio(stacked_axes=STACKED),
  "clip_by_global_norm": lambda: optax_lamb.clip_by_global_norm(1.0),
  "skip_nonfinite": lambda: optax_lamb.skip_nonfinite(optax_lamb.clip_by_global_norm(1.0)),
  "skip_nonfinite, spikes, check_results": lambda: optax_lamb.skip_nonfinite(
    optax_lamb.scale_by_adam(), check_results=True, spikes=RULE
  ),
  "unscale_gradients": lambda: optax_lamb.unscale_gradients(1024.0),
}
EXTRA = {  # update arguments a configuration is stepped with
  "skip, clip, spikes": {"value": 2.0},
  "grad_scale per step, skip": {"grad_scale": 512.0},
  "skip_nonfinite, spikes, check_results": {"value": 2.0},
}
BF16_PARAMS = {"bf16 params, master weights, skip"}

_CASE = re.compile(r'^\s*(?:(%[\w#:]+)(?::\d+)?\s*=\s*)?"?stablehlo\.(case|if)"?\(?\s*(%[\w#]+)')
_DEF = re.compile(r"^\s*(%[\w#]+)(?::\d+)?\s*=\s*\"?([\w.]+)")


def control_flow(text: str) -> dict[str, int]:
  """Counts in a lowered module's text: "dynamic" cases/ifs (an index from the data), "static"
  ones (constant index, as `jax.lax.platform_dependent` leaves them), and "while" loops."""
  counts = {"dynamic": 0, "static": 0, "while": 0}
  for func in re.split(r"\n(?=\s*func\.func )", text):
    lines = func.splitlines()
    defs = {m.group(1): (i, m.group(2)) for i, line in enumerate(lines) if (m := _DEF.match(line))}
    platform_args = set(re.findall(r'(%arg\d+): [^,)]*\{[^}]*"_platform_index"', func))
    static = set(platform_args) | {
      name for name, (_, op) in defs.items() if op == "stablehlo.constant"
    }
    for i, line in enumerate(lines):
      counts["while"] += bool(re.search(r"\bstablehlo\.while\b", line))
      m = _CASE.match(line)
      if not m:
        continue
      result, index = m.group(1), m.group(3)
      if index not in static:
        counts["dynamic"] += 1
        continue
      counts["static"] += 1
      if result is not None and _returns_constants(lines, i):
        static.add(result)
  return counts


def _returns_constants(lines: list[str], start: int) -> bool:
  """Whether the case starting at `start` returns, in every branch, a constant of its own (the
  platform-index mapping `platform_dependent` lowers to), up to its closing line."""
  depth, body = 0, []
  for line in lines[start:]:
    depth += line.count("{") - line.count("}")
    body.append(line.strip())
    if depth <= 0 and len(body) > 1:
      break
  inner = [x for x in body[1:-1] if x not in ("}, {", "}) : (tensor<i32>) -> tensor<i32>")]
  return all(re.match(r"(%\w+ = stablehlo\.constant|stablehlo\.return %\w+ :)", x) for x in inner)


def _tree(dtype=jnp.float32):
  return {k: jax.ShapeDtypeStruct(s, dtype) for k, s in SHAPES.items()}


def lowered_texts(tx, fused: bool, dtype=jnp.float32, extra=None) -> dict[str, str]:
  """The text of one step of `tx` (`tx.update` and `optax.apply_updates` in one jit, or with
  `fused` `optax_lamb.update_and_apply`) on the small tree, traced once and lowered for each of
  `PLATFORMS` (one trace serves them all). `extra`:
  `tx.update`'s extra arguments (`update_and_apply` takes none: the step without them)."""
  params = _tree(dtype)
  state = jax.eval_shape(tx.init, params)
  extra = {} if fused else {k: jnp.float32(v) for k, v in (extra or {}).items()}

  def step(params, state, grads, extra):
    if fused:
      return optax_lamb.update_and_apply(tx, grads, state, params, **extra)
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, params, extra)
    return {p: traced.lower(lowering_platforms=(p,)).as_text() for p in PLATFORMS}


def _check(tx, fused, dtype=jnp.float32, extra=None):
  for platform, text in lowered_texts(tx, fused, dtype, extra).items():
    counts = control_flow(text)
    assert counts["dynamic"] == 0 and counts["while"] == 0, (platform, counts)


FORMS = pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])


@FORMS
@pytest.mark.parametrize("implementation", ["xla", "auto", "reference"])
@pytest.mark.parametrize("name", list(LAMB))
def test_lamb_on_an_accelerator_has_no_host_round_trip(name, implementation, fused):
  dtype = jnp.bfloat16 if name in BF16_PARAMS else jnp.float32
  _check(LAMB[name](implementation), fused, dtype, EXTRA.get(name))


@FORMS
@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("name", list(COMPAT))
def test_compat_on_an_accelerator_has_no_host_round_trip(name, implementation, fused):
  _check(COMPAT[name](implementation), fused)


@pytest.mark.parametrize("name", list(STAGES))
def test_stages_on_an_accelerator_have_no_host_round_trip(name):
  tx = STAGES[name]()
  _check(tx, False, extra=EXTRA.get(name))


@FORMS
@pytest.mark.parametrize("name", ["default", "skip, clip, spikes", "8-bit moments"])
def test_offload_on_an_accelerator_has_no_host_round_trip(name, fused):
  tx = optax_lamb.offload(LAMB[name]("xla"))
  _check(tx, fused, extra=EXTRA.get(name))


def test_the_counter_tells_data_from_platform():
  """The counter itself: a data-dependent `lax.cond` and `fori_loop` are counted, a
  `platform_dependent` choice is static, in one-platform and two-platform lowerings."""

  def step(x):
    y = jax.lax.platform_dependent(x, cpu=lambda a: 2 * a, default=jnp.sin)
    y = jax.lax.cond(y[0] > 0, lambda a: a + 1, lambda a: a, y)
    return jax.lax.fori_loop(0, 3, lambda i, a: a * 2, y)

  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  for platforms in [("cuda",), ("tpu",), ("cpu", "cuda")]:
    text = jax.jit(step).trace(x).lower(lowering_platforms=platforms).as_text()
    counts = control_flow(text)
    assert counts["dynamic"] == 1 and counts["while"] == 1 and counts["static"] >= 1, counts
  plain = jax.jit(lambda x: jax.lax.platform_dependent(x, cpu=jnp.cos, default=jnp.sin))
  counts = control_flow(plain.trace(x).lower(lowering_platforms=("cuda",)).as_text())
  assert counts == {"dynamic": 0, "static": counts["static"], "while": 0} and counts["static"]
