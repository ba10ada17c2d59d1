"""What a pretraining run is: the model's size, two phases, the optimizer, and the presets.

A phase's ``lr`` is its peak learning rate at batch ``lr_batch`` (its preset's batch); a batch
set on the command line moves the peak by the square-root rule (``schedules.sqrt_scaled_lr``).
``micro_batch`` is what one device takes in one forward/backward pass; a step accumulates
``batch // (micro_batch * devices)`` of them. The data of a step do not depend on the split:
the same run on another device count sees the same sequences and masks.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from optax_lamb_recipes import schedules

# BERT's sizes (Devlin et al. 2019); the vocabulary comes from the tokenizer.
MODELS = {
  "tiny": dict(hidden=64, layers=2, heads=4, mlp=256, max_len=128),
  "base": dict(hidden=768, layers=12, heads=12, mlp=3072, max_len=512),
  "large": dict(hidden=1024, layers=24, heads=16, mlp=4096, max_len=512),
}


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
  """One phase: sequence length, global batch, optimizer steps and learning-rate schedule."""

  seq_len: int
  batch: int
  steps: int
  lr: float
  warmup: int  # steps
  micro_batch: int  # per device and forward/backward pass
  power: float = 0.5  # polynomial decay (NVIDIA's recipe: 0.5; the paper's: 1)
  lr_batch: int | None = None  # the batch at which ``lr`` holds (None: ``batch``)

  def accumulation(self, n_devices: int) -> int:
    """Micro-batches per optimizer step on ``n_devices`` (each takes up to ``micro_batch``)."""
    per_device = min(self.micro_batch, self.batch // n_devices)
    if per_device < 1 or self.batch % (per_device * n_devices):
      raise ValueError(
        f"batch {self.batch} does not split into micro-batches of {per_device} on "
        f"{n_devices} devices: choose a batch that is a multiple of micro_batch x devices"
      )
    return self.batch // (per_device * n_devices)

  @property
  def peak_lr(self) -> float:
    """``lr`` moved from ``lr_batch`` to ``batch`` by the square-root rule."""
    return schedules.sqrt_scaled_lr(self.lr, self.lr_batch or self.batch, self.batch)

  def phase(self) -> schedules.Phase:
    return schedules.Phase(
      self.batch, self.seq_len, self.steps, self.peak_lr, self.warmup, self.power
    )


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A pretraining run: model size, compute dtype, phases, optimizer, seed and cadences."""

  model: str
  phases: tuple[PhaseConfig, ...]
  opt: str = "lamb"
  opt_args: tuple[tuple[str, Any], ...] = ()  # keyword arguments of the optimizer
  dtype: str = "bfloat16"  # compute dtype; parameters and optimizer state are float32
  seed: int = 0
  log_every: int = 10
  checkpoint_every: int = 500
  fsdp: bool = False  # shard params and optimizer state over the devices too

  @property
  def total_steps(self) -> int:
    return sum(p.steps for p in self.phases)

  def to_json(self) -> dict:
    return json_ready(dataclasses.asdict(self))


def json_ready(x: Any) -> Any:
  """Tuples as lists, recursively (what a JSON round trip gives back)."""
  if isinstance(x, dict):
    return {k: json_ready(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [json_ready(v) for v in x]
  return x


def _two_phases(b1, s1, lr1, w1, m1, b2, s2, lr2, w2, m2, seq=(128, 512)) -> tuple:
  return (
    PhaseConfig(seq[0], b1, s1, lr1, w1, m1, lr_batch=b1),
    PhaseConfig(seq[1], b2, s2, lr2, w2, m2, lr_batch=b2),
  )


# The paper's mixed-batch schedule (You et al. 2019, Sec. 4: 64K at length 128 for 9/10 of the
# epochs, 32K at 512 after, 8,599 steps), with NVIDIA's learning rates, warm-up and power for it
# (DeepLearningExamples BERT: 6e-3, 28.43% of 7,038 steps; 4e-3, 12.8% of 1,563 steps; power 0.5).
# Micro-batches per device: what an 80 GB GPU holds in bf16 (set phaseN.micro_batch for others).
PAPER_64K_32K = _two_phases(65536, 7038, 6e-3, 2000, 64, 32768, 1563, 4e-3, 200, 8)

PRESETS = {
  # A CPU run through both phases, in well under two minutes.
  "smoke": RunConfig(
    model="tiny",
    phases=_two_phases(32, 24, 8e-3, 4, 16, 16, 8, 4e-3, 2, 8, seq=(32, 128)),
    log_every=4,
    checkpoint_every=8,
    dtype="float32",  # the CPU has no fast bf16
  ),
  "base": RunConfig(
    model="base",
    phases=_two_phases(65536, 7038, 6e-3, 2000, 128, 32768, 1563, 4e-3, 200, 32),
    checkpoint_every=200,
  ),
  "large": RunConfig(model="large", phases=PAPER_64K_32K, checkpoint_every=200),
}


def parse_value(text: str) -> Any:
  """A Python literal (number, bool, None, tuple, list), else the text as a string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_pairs(items: list[str] | None) -> list[tuple[str, Any]]:
  """``["a=1", "b=(0.9, 0.98)"]`` as ``[("a", 1), ("b", (0.9, 0.98))]``."""
  pairs = []
  for item in items or ():
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"expected KEY=VALUE, got {item!r}")
    pairs.append((key.strip(), parse_value(value.strip())))
  return pairs


def override(cfg: RunConfig, pairs: list[tuple[str, Any]]) -> RunConfig:
  """``cfg`` with fields replaced: ``seed``, ``phase1.batch``, ``phase2.micro_batch``, ...

  ``phaseN`` counts from 1; ``phases=1`` keeps only the first phase.
  """
  for key, value in pairs:
    if key == "phases":
      cfg = dataclasses.replace(cfg, phases=cfg.phases[: int(value)])
    elif key.startswith("phase") and "." in key:
      head, field = key.split(".", 1)
      i = int(head[len("phase") :]) - 1
      if not 0 <= i < len(cfg.phases):
        raise ValueError(f"{key}: this run has {len(cfg.phases)} phase(s)")
      phases = list(cfg.phases)
      phases[i] = _replace(phases[i], field, value)
      cfg = dataclasses.replace(cfg, phases=tuple(phases))
    else:
      cfg = _replace(cfg, key, value)
  return cfg


def _replace(obj: Any, field: str, value: Any) -> Any:
  names = {f.name for f in dataclasses.fields(obj)}
  if field not in names:
    raise ValueError(f"no setting {field!r}; one of {sorted(names)}")
  return dataclasses.replace(obj, **{field: value})


def from_json(data: dict) -> RunConfig:
  """The inverse of ``RunConfig.to_json``."""
  data = dict(data)
  data["phases"] = tuple(PhaseConfig(**p) for p in data["phases"])
  data["opt_args"] = tuple((k, _tuples(v)) for k, v in data["opt_args"])
  return RunConfig(**data)


def _tuples(x: Any) -> Any:
  return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
