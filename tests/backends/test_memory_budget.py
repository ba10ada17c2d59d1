"""No parameter-sized temporary in any configuration: the compiler's own count of a donated step.

Every option and combination of `lamb` and the compat constructors, on a small tree with
odd sizes, two leaves of one shape, a stacked leaf, tiny and larger leaves, compiles (nothing runs) to a step whose
temporaries are at most 1% of the params' bytes plus 64 KiB (`BUDGET`), read from
``memory_analysis()`` of XLA:CPU, the figure benchmarks/memory.py reports per parameter.
Two exceptions XLA:CPU leaves (docs/memory.md), each held to what it costs today so that a
regression beyond it still fails: moments stored narrower than float32, 8-bit ones included
(XLA copies them), and
timm's caution (XLA keeps the Adam direction and its sign mask in memory).

The budget holds for the norms' "rows" layout, which `auto` takes on accelerators; on the CPU
backend `auto` takes "columns" (faster on XLA:CPU, 2/PARTIALS of a large leaf for its two
sums), held to that by its own test.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lamb
from optax_lamb import compat
from optax_lamb.core import _ratios

SHAPES = {
  "odd": (600, 500),  # 300,000: no power-of-two blocks
  "odd twin": (600, 500),  # leaves of one shape: XLA shares what their reductions have in common
  "wide": (300, 200),
  "stacked": (4, 512, 64),
  "prime": (100_003,),
  "bias": (768,),
  "tiny": (3,),
  "scalar": (),
}
STACKED = lambda params: {k: (1 if k == "stacked" else 0) for k in params}  # noqa: E731
LR = 1e-3


def _mask(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


CONFIGURATIONS = {
  "lamb": lambda: optax_lamb.lamb(LR, weight_decay=0.01),
  "stacked, clip, masks": lambda: optax_lamb.lamb(
    LR,
    weight_decay=0.01,
    mask=_mask,
    trust_ratio_mask=_mask,
    max_grad_norm=1.0,
    stacked_axes=STACKED,
    min_trust_ratio=0.1,
    max_trust_ratio=10.0,
  ),  # fmt: skip
  "skip_nonfinite": lambda: optax_lamb.lamb(LR, weight_decay=0.01, skip_nonfinite=True),
  "skip, clip, stacked": lambda: optax_lamb.lamb(
    LR, skip_nonfinite=True, max_grad_norm=1.0, stacked_axes=STACKED
  ),
  "schedules": lambda: optax_lamb.lamb(
    optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=optax.linear_schedule(0.1, 0.0, 10)
  ),
  "apex L2": lambda: compat.apex_fused_lamb(LR, adam_w_mode=False, skip_nonfinite=True),
  "deepspeed": lambda: compat.deepspeed_fused_lamb(LR, weight_decay=0.01, max_coeff=5.0),
  "timm decoupled": lambda: compat.timm_lamb(LR, weight_decay=0.01, decoupled_decay=True),
  "torch_optimizer clamp": lambda: compat.torch_optimizer_lamb(LR, clamp_value=5.0),
  "keras clipnorm, stacked": lambda: compat.keras_lamb(
    LR, weight_decay=0.01, clipnorm=1.0, stacked_axes=STACKED
  ),
  "tfa decay": lambda: compat.tfa_lamb(LR, weight_decay=0.01, decay=0.1, global_clipnorm=1.0),
}
LOW_PRECISION = {
  "bfloat16 params, master weights": (
    lambda: optax_lamb.lamb(LR, weight_decay=0.01, master_weights=True),
    jnp.bfloat16,
  ),
  "float16 params, master weights, skip": (
    lambda: optax_lamb.lamb(LR, master_weights=True, skip_nonfinite=True),
    jnp.float16,
  ),
}
NARROW_MOMENTS = {  # (mu_dtype, nu_dtype); int8 / uint8: 8-bit block-wise quantized moments
  "bfloat16 moments": (jnp.bfloat16, jnp.bfloat16),
  "float16 moments, skip": (jnp.float16, jnp.float16),
  "8-bit moments": (jnp.int8, jnp.uint8),
  "8-bit moments, skip, stacked": (jnp.int8, jnp.uint8),
}


# Small leaves only (109 KiB of float32): the budget is then mostly its 64 KiB.
SMALL_SHAPES = {
  **{f"w{i}": (3000,) for i in range(8)},
  "odd": (513,),
  "stacked": (3, 700),
  "matrix": (40, 30),
  "tiny": (3,),
  "scalar": (),
}


def _temporaries(tx, dtype=jnp.float32, fused=False, shapes=SHAPES) -> tuple[int, int]:
  """(compiled temporaries, params' bytes) of one donated step of `tx` on `shapes`."""
  params = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
  state = jax.eval_shape(tx.init, params)

  def step(params, state, grads):
    if fused:
      return optax_lamb.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params).compile()
  param_bytes = sum(math.prod(s) for s in shapes.values()) * jnp.dtype(dtype).itemsize
  return compiled.memory_analysis().temp_size_in_bytes, param_bytes


def _budget(param_bytes: int) -> float:
  return 0.01 * param_bytes + 64 * 1024


@pytest.fixture(autouse=True)
def _rows_unless_auto(request):
  """The accelerators' layout of the norms' sums (conftest's rows_layout), unless a test asks
  for "auto"."""
  if "auto_layout" not in request.keywords:
    request.getfixturevalue("rows_layout")


@pytest.mark.auto_layout
@pytest.mark.parametrize("name", ["lamb", "skip, clip, stacked"])
def test_on_the_cpu_the_column_layout_costs_two_accumulators_per_large_leaf(name):
  """`auto` on the CPU: one accumulator of 1/PARTIALS of each large leaf per norm (two norms),
  and more than the rows layout (so the check can fail)."""
  assert _ratios.column_blocks()
  temps, param_bytes = _temporaries(CONFIGURATIONS[name]())
  assert temps <= 2 / _ratios.PARTIALS * param_bytes + _budget(param_bytes), temps / param_bytes
  assert temps > _budget(param_bytes), temps / param_bytes


@pytest.mark.auto_layout
def test_auto_takes_rows_off_the_cpu(monkeypatch):
  assert _ratios.column_blocks()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not _ratios.column_blocks()


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_donated_step_has_no_param_sized_temporary(name):
  temps, param_bytes = _temporaries(CONFIGURATIONS[name]())
  assert temps <= _budget(param_bytes), (name, temps / param_bytes)


def test_update_and_apply_has_no_param_sized_temporary():
  temps, param_bytes = _temporaries(CONFIGURATIONS["skip, clip, stacked"](), fused=True)
  assert temps <= _budget(param_bytes), temps / param_bytes


def test_caution_costs_at_most_two_copies():
  temps, param_bytes = _temporaries(compat.timm_lamb(LR, weight_decay=0.01, caution=True))
  assert temps <= 2 * param_bytes + _budget(param_bytes), temps / param_bytes


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_master_weights_stay_within_the_budget(name):
  make, dtype = LOW_PRECISION[name]
  temps, param_bytes = _temporaries(make(), dtype)
  assert temps <= _budget(param_bytes), (name, temps / param_bytes)


@pytest.mark.parametrize(  # 8-bit, skip, stacked: 6 s, CI runs it (-m slow)
  "name", [pytest.param(n, marks=pytest.mark.slow) if "stacked" in n else n for n in NARROW_MOMENTS]
)
def test_narrow_moments_cost_at_most_their_copy(name):
  """XLA:CPU writes the moments and the params in separate fusions that read the old moments;
  in ``tx.update`` the caller writes the params, so XLA copies the moments: at most the moments'
  bytes beyond the budget (docs/memory.md). 8-bit
  moments: their codes (1 byte a parameter each; the scales, 4/256 of a byte, fall within the
  budget); the moments dequantized and requantized are never written out in float32."""
  mu_dtype, nu_dtype = NARROW_MOMENTS[name]
  stacked = STACKED if "stacked" in name else None
  tx = optax_lamb.lamb(LR, mu_dtype=mu_dtype, nu_dtype=nu_dtype, skip_nonfinite="skip" in name,
                       stacked_axes=stacked)  # fmt: skip
  temps, param_bytes = _temporaries(tx)
  moment_bytes = 2 * param_bytes * jnp.dtype(mu_dtype).itemsize // 4
  assert temps <= moment_bytes + _budget(param_bytes), (name, temps / param_bytes)


@pytest.mark.parametrize("mu_dtype", [jnp.bfloat16, jnp.float16])
def test_a_narrow_first_moment_alone_costs_at_most_its_copy(mu_dtype):
  """optax's `mu_dtype` alone (v float32): v is written in pass 1 as float32 moments are and read
  back, so ``tx.update`` copies only m's old values (2 bytes a parameter, not 6), and
  `update_and_apply` nothing beyond the budget."""
  tx = optax_lamb.lamb(LR, weight_decay=0.01, mu_dtype=mu_dtype)
  temps, param_bytes = _temporaries(tx)
  assert temps <= param_bytes // 2 + _budget(param_bytes), temps / param_bytes
  temps, param_bytes = _temporaries(tx, fused=True)
  assert temps <= _budget(param_bytes), temps / param_bytes


SMALL_TREE_IN_THE_DEFAULT_RUN = ("lamb", "skip, clip, stacked", "keras clipnorm, stacked")


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=() if n in SMALL_TREE_IN_THE_DEFAULT_RUN else pytest.mark.slow)
    for n in list(CONFIGURATIONS) + list(LOW_PRECISION)
  ],
)
def test_a_tree_of_small_leaves_on_one_device_stays_within_the_budget(name, monkeypatch):
  """XLA:CPU rewrites a lone sum over a small leaf into partial sums whose input it stores: one
  device's step sums small leaves jointly, so a tree of them holds no copy either."""
  monkeypatch.setattr(jax, "device_count", lambda *args: 1)  # as in a one-device process
  assert _ratios.one_device()
  make, dtype = LOW_PRECISION.get(name, (CONFIGURATIONS.get(name), jnp.float32))
  temps, param_bytes = _temporaries(make(), dtype, shapes=SMALL_SHAPES)
  assert temps <= _budget(param_bytes), (name, temps / param_bytes)


def test_a_tree_of_small_leaves_on_several_devices_costs_more():
  """Where XLA may partition the step (this process has 8 devices), the sums stay one per term
  (a joint reduction would gather a leaf sharded over its axis): the stored inputs are then
  seen (the check can fail)."""
  assert not _ratios.one_device()
  temps, param_bytes = _temporaries(CONFIGURATIONS["lamb"](), shapes=SMALL_SHAPES)
  assert temps > _budget(param_bytes), temps / param_bytes


@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=() if n == "8-bit moments" else pytest.mark.slow) for n in NARROW_MOMENTS],
)
def test_narrow_moments_in_update_and_apply_stay_within_the_budget(name):
  """`update_and_apply` writes the params itself: the moments' writes are ordered after it
  (`_moment_storage.zero_after`), so XLA:CPU writes them in place, no copy (tx.update: above)."""
  mu_dtype, nu_dtype = NARROW_MOMENTS[name]
  stacked = STACKED if "stacked" in name else None
  tx = optax_lamb.lamb(LR, mu_dtype=mu_dtype, nu_dtype=nu_dtype, skip_nonfinite="skip" in name,
                       stacked_axes=stacked)  # fmt: skip
  temps, param_bytes = _temporaries(tx, fused=True)
  assert temps <= _budget(param_bytes), (name, temps / param_bytes)


def test_optax_lamb_is_the_anchor():
  """The same measure on optax.lamb: about twice the params (the check can fail)."""
  temps, param_bytes = _temporaries(optax.lamb(LR, weight_decay=0.01))
  assert temps > 1.5 * param_bytes
