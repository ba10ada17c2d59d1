"""What a sweep is: its data, model, batch sizes, budget, grids and schedule, and the presets.

Warm-up is a constant number of steps at every batch (``warmup_frac`` of the steps at the
largest batch, 1/5 as the paper's 32K run), then polynomial decay; peak learning rates follow
the square-root rule from each family's anchor batch (``base_lrs``).
"""

from __future__ import annotations

import dataclasses
import os

from optax_lamb_recipes import schedules
from optax_lamb_recipes.model import BertConfig

FAMILIES = ("lamb", "adamw")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """One sweep: data, model, batch sizes, sample budget, learning-rate grids and seeds."""

  name: str
  data: str  # "kjv" or "hmm"
  batches: tuple[int, ...]
  samples: int  # training sequences per run, the same at every batch size
  lamb_lr: float  # LAMB peak lr at the largest batch, before the grid factor
  adamw_lr: float  # AdamW peak lr at the smallest batch, before the grid factor
  lamb_grid: tuple[float, ...] = (1.0,)  # lr factors tried for LAMB at every batch
  adamw_grid: tuple[float, ...] = (0.5, 1.0, 2.0)  # lr factors tried for AdamW at every batch
  seeds: tuple[int, ...] = (0,)  # the first tunes; all report (model init, data order, masks)
  seq_len: int = 32
  seq2: int = 128
  phase2_fraction: float = 0.0  # > 0: a second phase at seq2 with re-warm-up
  warmup_frac: float = 0.2
  power: float = 1.0
  evals: int = 8
  micro: int = 16
  eval_size: int = 512  # sequences in each of the validation and test sets
  model: BertConfig = BertConfig()


PRESETS = {
  "ci": SweepConfig(
    name="ci",
    data="hmm",
    batches=(16, 64),
    samples=1024,
    lamb_lr=0.02,
    adamw_lr=3e-3,
    adamw_grid=(1.0,),
    evals=4,
    eval_size=256,
    model=BertConfig(vocab_size=69, hidden=32, layers=1, heads=2, mlp=64, max_len=128),
  ),
  # The main job: every run leaves the token-frequency plateau. The claim study's runs need
  # about 300 steps to end well below it at a large batch, so the batches stop at 128 and the
  # budget gives B=128 320 steps (40,960 sequences; the old quick preset's 12,288 gave B=128 96
  # steps and B=512 24, and nothing learned from 128 up). The learning rates are the claim grid's
  # best at B=16 and B=128 for both optimizers (LAMB 0.0071 and 0.02, AdamW 1e-3 and 0.0028, the
  # square-root rule joining them); LAMB trains that one rate, AdamW it and half of it. A pilot at
  # B=128 (seed 0): LAMB ended 0.33 nats below the baseline, AdamW 0.17 and, at half its rate,
  # 0.10. The whole job: 378 CPU-seconds (2 cores, AMD EPYC, shared at load 15 to 18).
  "quick": SweepConfig(
    name="quick",
    data="kjv",
    batches=(16, 32, 64, 128),
    samples=40960,
    lamb_lr=0.02,  # at B=128
    adamw_lr=1e-3,  # at B=16
    adamw_grid=(0.5, 1.0),
  ),
  # The claim study's tuning grid (study.py reads its results): >= 150 steps at B=512, 11
  # learning rates per batch. (The grids first stopped at 0.5 and 0.25, then at 0.25 and
  # 0.125: each time an arm chose its lowest factor, a lower one was added, with --reuse.)
  "claim": SweepConfig(
    name="claim",
    data="kjv",
    batches=(16, 32, 64, 128, 256, 512),
    samples=76800,
    lamb_lr=0.08,
    adamw_lr=2e-3,
    lamb_grid=(0.125, 0.25, 0.5, 1.0, 2.0),
    adamw_grid=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0),
    seeds=(0, 1, 2),
    evals=10,
    eval_size=768,
  ),
}


def phases_for(cfg: SweepConfig, batch: int, peak_lr: float) -> list[schedules.Phase]:
  """The schedule of one run: warm-up steps constant across batch sizes, as in the paper."""
  b_max = max(cfg.batches)
  if cfg.phase2_fraction > 0:
    p1, p2 = schedules.two_phase(
      samples=cfg.samples,
      batch1=batch,
      batch2=batch,
      seq1=cfg.seq_len,
      seq2=cfg.seq2,
      lr1=peak_lr,
      lr2=peak_lr,
      warmup1=max(1, round(cfg.warmup_frac * cfg.samples * (1 - cfg.phase2_fraction) / b_max)),
      warmup2=max(1, round(cfg.warmup_frac * cfg.samples * cfg.phase2_fraction / b_max)),
      phase2_fraction=cfg.phase2_fraction,
      power=cfg.power,
    )
    return [p1, p2]
  steps = cfg.samples // batch
  warmup = max(1, round(cfg.warmup_frac * cfg.samples / b_max))
  return [schedules.Phase(batch, cfg.seq_len, steps, peak_lr, warmup, cfg.power)]


def base_lrs(cfg: SweepConfig, batch: int) -> dict[str, float]:
  """Each family's square-root-rule peak lr at ``batch``, before the grid factor."""
  return {
    "lamb": schedules.sqrt_scaled_lr(cfg.lamb_lr, max(cfg.batches), batch),
    "adamw": schedules.sqrt_scaled_lr(cfg.adamw_lr, min(cfg.batches), batch),
  }


def grid(cfg: SweepConfig, family: str) -> tuple[float, ...]:
  return cfg.lamb_grid if family == "lamb" else cfg.adamw_grid


def default_preset(choices=("ci", "quick", "claim")) -> str:
  """``ci`` when ``LAMB_QUICK`` is set (CI's smoke runs), else ``quick``, or ``claim`` for the jobs
  (study, search, budget) that have no quick preset."""
  if os.environ.get("LAMB_QUICK", "") not in ("", "0"):
    return "ci"
  return "quick" if "quick" in choices else "claim"


def from_json(config: dict) -> SweepConfig:
  """The configuration of a results JSON, as the dataclass."""
  config = dict(config)
  config["model"] = BertConfig(**config["model"])
  tuples = ("batches", "lamb_grid", "adamw_grid", "seeds")
  return SweepConfig(**{k: tuple(v) if k in tuples else v for k, v in config.items()})
