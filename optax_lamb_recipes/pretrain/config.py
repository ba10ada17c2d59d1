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
import math
from typing import Any

from optax_lamb_recipes import schedules
from optax_lamb_recipes.presets import PRESETS as _SWEEPS

_QUICK = _SWEEPS["quick"]  # the laptop recipe's tiny-BERT sweep (its AdamW pilot)

DTYPES = ("bfloat16", "float32")  # compute dtypes

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
  eval_every: int = 500  # held-out MLM loss and accuracy
  fsdp: bool = False  # shard params and optimizer state over the devices too
  # Recompute each layer's activations in the backward pass (keep only its input): about a
  # third more compute for activation memory that no longer grows with a layer's internals.
  # Off by default: the presets' micro-batches fit an 80 GB GPU without it, and MFU counts
  # only the model's FLOPs, not the recomputation.
  remat: bool = False

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
    eval_every=8,
    dtype="float32",  # the CPU has no fast bf16
  ),
  "base": RunConfig(
    model="base",
    phases=_two_phases(65536, 7038, 6e-3, 2000, 128, 32768, 1563, 4e-3, 200, 32),
    checkpoint_every=200,
  ),
  "large": RunConfig(model="large", phases=PAPER_64K_32K, checkpoint_every=200),
}


# AdamW's own peak learning rates (LAMB's above are 10x or more what AdamW trains at), one
# (lr, batch at which it holds) per phase; another batch moves it by the square-root rule too.
# smoke: the laptop recipe's pilot for this tiny BERT on the KJV at length 32 (best of 5e-4 to
# 4e-3 at batch 16: ``presets.PRESETS["quick"].adamw_lr``), both phases. base and large:
# RoBERTa's peaks for models of these sizes (Liu et al. 2019, Table 9: 6e-4 and 4e-4, batch 8K)
# at the preset's batch as they are (nobody published AdamW at 64K; not tuned here), and phase 2
# at 2/3 of phase 1 as NVIDIA's LAMB recipe (4e-3 after 6e-3).
ADAMW_LRS = {
  "smoke": ((_QUICK.adamw_lr, min(_QUICK.batches)), (_QUICK.adamw_lr, min(_QUICK.batches))),
  "base": ((6e-4, None), (4e-4, None)),
  "large": ((4e-4, None), (4e-4 * 2 / 3, None)),
}


def preset(name: str, opt: str | None = None) -> RunConfig:
  """The preset ``name`` for optimizer ``opt`` (default: the preset's): AdamW gets its own
  learning rates (``ADAMW_LRS``), the LAMBs (``lamb`` and every ``compat`` one) LAMB's."""
  if name not in PRESETS:
    raise ValueError(f"preset={name!r}: one of {sorted(PRESETS)}")
  cfg = PRESETS[name]
  if opt is None or opt == cfg.opt:
    return cfg
  phases = cfg.phases
  if opt == "adamw":
    phases = tuple(
      dataclasses.replace(p, lr=lr, lr_batch=at or p.batch)
      for p, (lr, at) in zip(phases, ADAMW_LRS[name], strict=True)
    )
  return dataclasses.replace(cfg, opt=opt, phases=phases)


def parse_value(text: str) -> Any:
  """A Python literal (number, bool, None, tuple, list), ``inf`` or ``nan``, else the text."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    pass
  try:
    return float(text)  # inf, nan: refused by name later, as floats
  except ValueError:
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
      if not _is_int(value) or not 1 <= value <= len(cfg.phases):
        raise ValueError(
          f"phases={value!r}: must be a whole number from 1 to {len(cfg.phases)} (this preset's)"
        )
      cfg = dataclasses.replace(cfg, phases=cfg.phases[:value])
    elif key.startswith("phase") and "." in key:
      head, field = key.split(".", 1)
      number = head[len("phase") :]
      i = int(number) - 1 if number.isdigit() else -1
      if not 0 <= i < len(cfg.phases):
        raise ValueError(f"{key}={value!r}: this run has phase1 to phase{len(cfg.phases)}")
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


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
  return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def validate(cfg: RunConfig) -> RunConfig:
  """``cfg`` if every setting is usable, else a ValueError naming the first that is not.

  Runs before anything is written or compiled: a bad value found by the schedule or the
  optimizer after minutes of compiling, or after checkpoints/ exists, is what this prevents.
  """

  def need(ok: bool, name: str, value: Any, what: str) -> None:
    if not ok:
      raise ValueError(f"{name}={value!r}: {what}")

  need(cfg.model in MODELS, "model", cfg.model, f"one of {sorted(MODELS)}")
  need(cfg.dtype in DTYPES, "dtype", cfg.dtype, f"one of {list(DTYPES)}")
  need(_is_int(cfg.seed) and cfg.seed >= 0, "seed", cfg.seed, "must be an integer >= 0")
  for name in ("log_every", "checkpoint_every", "eval_every"):
    value = getattr(cfg, name)
    need(_is_int(value) and value > 0, name, value, "must be a positive integer")
  need(isinstance(cfg.fsdp, bool), "fsdp", cfg.fsdp, "must be True or False")
  need(isinstance(cfg.remat, bool), "remat", cfg.remat, "must be True or False")
  need(len(cfg.phases) > 0, "phases", len(cfg.phases), "a run needs at least one phase")
  max_len = MODELS[cfg.model]["max_len"]
  for i, p in enumerate(cfg.phases):
    at = f"phase{i + 1}."
    for name in ("seq_len", "batch", "steps", "micro_batch"):
      value = getattr(p, name)
      need(_is_int(value) and value > 0, at + name, value, "must be a positive integer")
    need(p.seq_len <= max_len, at + "seq_len", p.seq_len,
         f"longer than BERT-{cfg.model}'s {max_len} positions")  # fmt: skip
    need(_is_int(p.warmup) and p.warmup >= 0, at + "warmup", p.warmup, "must be an integer >= 0")
    need(_is_number(p.lr) and p.lr > 0, at + "lr", p.lr, "must be a positive finite number")
    need(
      _is_number(p.power) and p.power >= 0, at + "power", p.power, "must be a finite number >= 0"
    )
    need(p.lr_batch is None or (_is_int(p.lr_batch) and p.lr_batch > 0), at + "lr_batch",
         p.lr_batch, "must be a positive integer (or None)")  # fmt: skip
    # (These make every value of the warm-up and decay finite and in [0, peak]; the schedule
    # itself is not evaluated: that would start JAX's backend before jax.distributed.)
    need(math.isfinite(p.peak_lr), at + "lr", p.lr, f"gives peak learning rate {p.peak_lr}")
  return cfg


def from_json(data: dict) -> RunConfig:
  """The inverse of ``RunConfig.to_json``."""
  data = dict(data)
  data["phases"] = tuple(PhaseConfig(**p) for p in data["phases"])
  data["opt_args"] = tuple((k, _tuples(v)) for k, v in data["opt_args"])
  return RunConfig(**data)


def _tuples(x: Any) -> Any:
  return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
