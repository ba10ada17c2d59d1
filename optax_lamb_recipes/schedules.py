"""The learning-rate rules of the BERT large-batch recipe, as plain optax schedules.

- :func:`sqrt_scaled_lr`: the learning rate grows as the square root of the batch
  (You et al. 2019, Table 4: about 5e-3 * sqrt(B / 32768)).
- :func:`warmup_poly_decay`: linear warm-up over a number of steps that stays the same at
  every batch size (so the warm-up *fraction* grows with the batch), then polynomial decay to 0
  (power 1 in the paper, 0.5 in NVIDIA's recipe).
- :func:`two_phase`: the mixed-sequence-length schedule: phase 1 at short sequences, phase 2
  at long ones with its own warm-up ("re-warm-up") and the optimizer moments carried over.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import optax


def sqrt_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
  """``base_lr * sqrt(batch / base_batch)``: the square-root scaling rule."""
  if base_batch <= 0 or batch <= 0:
    raise ValueError(f"batch sizes must be positive, got {base_batch=}, {batch=}")
  return base_lr * math.sqrt(batch / base_batch)


def warmup_poly_decay(
  peak_lr, warmup_steps, total_steps, power: float = 1.0, end_lr: float = 0.0
) -> optax.Schedule:
  """Linear warm-up from 0 to ``peak_lr`` in ``warmup_steps``, then polynomial decay to ``end_lr``.

  .. math::
    \\eta_t = \\eta \\, t / W \\quad (t < W), \\qquad
    \\eta_t = \\eta_{end} + (\\eta - \\eta_{end}) (1 - (t - W) / (T - W))^{p} \\quad (W \\le t \\le T)

  and ``end_lr`` after T. The same values as ``optax.join_schedules([optax.linear_schedule(0,
  peak, W), optax.polynomial_schedule(peak, end, p, T - W)], [W])``, written so that every
  argument (peak, W, T) may be a traced value: one compiled training step then serves every
  batch size of a sweep.
  """
  if isinstance(warmup_steps, int) and isinstance(total_steps, int):
    if not 0 <= warmup_steps < total_steps:
      raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps=}, {total_steps=}")

  def schedule(count):
    t = jnp.asarray(count, jnp.float32)
    warm = peak_lr * t / jnp.maximum(warmup_steps, 1)
    frac = jnp.clip((t - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
    decay = end_lr + (peak_lr - end_lr) * (1.0 - frac) ** power
    return jnp.where(t < warmup_steps, warm, decay)

  return schedule


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase of pre-training: its batch, sequence length, length in steps, and schedule."""

  batch: int
  seq_len: int
  steps: int
  peak_lr: float
  warmup_steps: int
  power: float = 1.0

  def schedule(self, peak_lr=None) -> optax.Schedule:
    """This phase's schedule, counting its own steps from 0 (``peak_lr`` overrides, may be traced)."""
    lr = self.peak_lr if peak_lr is None else peak_lr
    return warmup_poly_decay(lr, self.warmup_steps, self.steps, self.power)


def two_phase(
  *,
  samples: int,
  batch1: int,
  batch2: int,
  seq1: int,
  seq2: int,
  lr1: float,
  lr2: float,
  warmup1: int,
  warmup2: int,
  phase2_fraction: float = 0.1,
  power: float = 1.0,
) -> tuple[Phase, Phase]:
  """The paper's mixed-batch split: ``1 - phase2_fraction`` of the samples at ``seq1``, the rest at ``seq2``.

  Each phase has its own warm-up and decay; the optimizer moments are carried from phase 1 to
  phase 2 (see :func:`optax_lamb_recipes.train.carry_over_moments`).
  """
  if not 0 < phase2_fraction < 1:
    raise ValueError(f"phase2_fraction must be in (0, 1), got {phase2_fraction}")
  steps1 = round(samples * (1 - phase2_fraction)) // batch1
  steps2 = round(samples * phase2_fraction) // batch2
  return (
    Phase(batch1, seq1, steps1, lr1, warmup1, power),
    Phase(batch2, seq2, steps2, lr2, warmup2, power),
  )
