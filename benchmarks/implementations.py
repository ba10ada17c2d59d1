"""The LAMB steps a benchmark can time, by name: optax.lamb and optax_lamb's implementations.

A step is `(params, state, grads) -> (params, state)`, as a training loop calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import optax

import optax_lamb

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01


def update_then_apply(tx: optax.GradientTransformation) -> Callable:
  """The step as optax users write it: `tx.update`, then `optax.apply_updates`."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def update_and_apply(tx: optax.GradientTransformation) -> Callable:
  """The step through `optax_lamb.update_and_apply` (the new params without the updates tree)."""

  def step(params, state, grads):
    return optax_lamb.update_and_apply(tx, grads, state, params)

  return step


def optax_lamb_builder(**options) -> Callable[[], optax.GradientTransformation]:
  return lambda: optax_lamb.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY, **options)


def optax_builder() -> optax.GradientTransformation:
  return optax.lamb(LEARNING_RATE, weight_decay=WEIGHT_DECAY)


def offloaded(compute: str) -> Callable[[], optax.GradientTransformation]:
  return lambda: optax_lamb.offload(optax_lamb_builder()(), compute=compute)


BF16_MOMENTS = {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16}
INT8_MOMENTS = {"mu_dtype": jnp.int8, "nu_dtype": jnp.uint8}  # 8-bit block-wise quantized

# name -> (state family, builder of the transformation, step from transformation). Implementations
# of one family share one state, so the state they advance stays realistic without one copy each;
# the case runner also checks that their state layouts match (a family whose layouts differ, as the
# bfloat16 moments do, gets one state per layout).
IMPLEMENTATIONS: dict[str, tuple[str, Callable, Callable]] = {
  "optax.lamb": ("optax", optax_builder, update_then_apply),
  # implementation="auto": what a user gets without choosing.
  "optax_lamb.lamb": ("ours", optax_lamb_builder(), update_then_apply),
  "update_and_apply": ("ours", optax_lamb_builder(), update_and_apply),
  "reference-chain": ("ours", optax_lamb_builder(implementation="reference"), update_then_apply),
  "xla.lamb": ("ours", optax_lamb_builder(implementation="xla"), update_then_apply),
  "xla.apply": ("ours", optax_lamb_builder(implementation="xla"), update_and_apply),
  # The Pallas kernels: update + apply, and update_and_apply. Without a GPU they run in
  # interpret mode, so only with --quick there.
  "pallas.lamb": ("ours", optax_lamb_builder(implementation="pallas"), update_then_apply),
  "pallas.apply": ("ours", optax_lamb_builder(implementation="pallas"), update_and_apply),
  # The Mosaic GPU kernels (compute capability 9.0 and newer; interpret mode elsewhere).
  "pallas_mosaic_gpu.lamb": (
    "ours",
    optax_lamb_builder(implementation="pallas_mosaic_gpu"),
    update_then_apply,
  ),
  "pallas_mosaic_gpu.apply": (
    "ours",
    optax_lamb_builder(implementation="pallas_mosaic_gpu"),
    update_and_apply,
  ),
  # bfloat16 moments: 20 instead of 28 bytes per parameter to move at the floor.
  "optax_lamb.lamb-bf16": ("ours-bf16", optax_lamb_builder(**BF16_MOMENTS), update_then_apply),
  "update_and_apply-bf16": ("ours-bf16", optax_lamb_builder(**BF16_MOMENTS), update_and_apply),
  "xla.lamb-bf16": (
    "ours-bf16",
    optax_lamb_builder(implementation="xla", **BF16_MOMENTS),
    update_then_apply,
  ),
  # The state in pinned_host memory between steps (optax_lamb.offload): the update on the device
  # (the state copied in and out inside the step) or on the host's cores. Own families: the state
  # lives in another memory.
  "offload.device": ("ours-offload-device", offloaded("device"), update_then_apply),
  "offload.host": ("ours-offload-host", offloaded("host"), update_then_apply),
  # 8-bit moments (docs/quantized_moments.md): about 38 bytes per parameter on the XLA path.
  "optax_lamb.lamb-8bit": ("ours-8bit", optax_lamb_builder(**INT8_MOMENTS), update_then_apply),
  "xla.lamb-8bit": (
    "ours-8bit",
    optax_lamb_builder(implementation="xla", **INT8_MOMENTS),
    update_then_apply,
  ),
}
DEFAULT_IMPLEMENTATIONS = ("optax.lamb", "optax_lamb.lamb", "update_and_apply")
