"""What a run reports every N steps: loss, learning rate, gradient norm, trust-ratio quantiles,
tokens/s per device, MFU, seconds per step and seconds spent saving checkpoints (kept out of the
throughput), and the held-out loss and accuracy at each evaluation; printed, written for
TensorBoard (``tensorboardX``: tags under ``train/``, ``opt/`` and ``eval/``, and ``train/phase``)
and appended to ``metrics.jsonl``, with a progress bar. Process 0 writes; the others only train.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

# Dense bf16 peak TFLOP/s per device, from the vendors' data sheets, by a substring of
# ``jax.Device.device_kind`` (first match wins). Pass --peak-tflops for anything else.
PEAK_TFLOPS = (
  ("H100 PCIe", 756.0),
  ("H100", 989.0),
  ("H200", 989.0),
  ("GH200", 989.0),
  ("A100", 312.0),
  ("L4", 121.0),
  ("TPU v4", 275.0),
  ("TPU v5 lite", 197.0),
  ("TPU v5", 459.0),
  ("TPU v6", 918.0),
)
QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)
METRICS_FILE = "metrics.jsonl"


def peak_flops(device_kind: str, tflops: float | None = None) -> float | None:
  """The device's peak FLOP/s: ``tflops`` if given, else the table's, else None (no MFU)."""
  if tflops is not None:
    return tflops * 1e12
  for name, value in PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return value * 1e12
  return None


def summarize(
  raw: dict[str, Any], *, tokens: int, seconds: float, flops: float, devices: int,
  peak: float | None,
) -> dict[str, float]:  # fmt: skip
  """One log line's numbers: the step's device metrics and the window's throughput.

  ``tokens`` and ``flops`` were trained in ``seconds`` over ``devices`` devices.
  """
  out = {k: float(raw[k]) for k in ("loss", "lr", "grad_norm")}
  if "trust_ratios" in raw:
    ratios = np.asarray(raw["trust_ratios"], np.float64)
    for q, value in zip(QUANTILES, np.quantile(ratios, QUANTILES), strict=True):
      out[f"trust_ratio/q{round(100 * q):02d}"] = float(value)
  out["tokens_per_s_per_device"] = tokens / seconds / devices
  if peak is not None:
    out["mfu"] = flops / seconds / devices / peak
  return out


def tensorboard_tag(key: str) -> str:
  """A metrics.jsonl key's TensorBoard tag: the optimizer's numbers under ``opt/``, held-out
  ones under ``eval/`` (already), the rest (loss, throughput, timings, phase) under ``train/``."""
  if key.startswith("eval/"):
    return key
  if key in ("lr", "grad_norm") or key.startswith("trust_ratio/"):
    return f"opt/{key}"
  return f"train/{key}"


class Logger:
  """Prints, writes TensorBoard scalars and ``metrics.jsonl`` (dropping lines after ``start``
  when a run resumes), and moves a progress bar; a no-op but for the bar off process 0."""

  def __init__(
    self, out_dir: str, start: int, total: int, lead: bool, progress: bool = True
  ) -> None:
    self.lead = lead
    self.writer = self.file = None
    if lead:
      from tensorboardX import SummaryWriter

      self.writer = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=start or None)
      path = os.path.join(out_dir, METRICS_FILE)
      kept = _lines_up_to(path, start)
      self.file = open(path, "w")
      self.file.writelines(kept)
      self.file.flush()
    self.bar = None
    if lead and progress:
      from tqdm import tqdm

      self.bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True)

  def advance(self, steps: int = 1) -> None:
    if self.bar is not None:
      self.bar.update(steps)

  def log(self, step: int, phase: int, values: dict[str, float]) -> None:
    if not self.lead:
      return
    for key, value in {**values, "phase": phase + 1}.items():
      self.writer.add_scalar(tensorboard_tag(key), value, step)
    self.file.write(json.dumps({"step": step, "phase": phase, **values}) + "\n")
    self.file.flush()
    shown = ("loss", "eval/loss", "eval/accuracy", "lr", "grad_norm", "trust_ratio/q50",
             "tokens_per_s_per_device", "mfu", "step_s", "checkpoint_s")  # fmt: skip
    text = "  ".join(f"{k} {values[k]:.4g}" for k in shown if k in values)
    line = f"step {step} (phase {phase + 1})  {text}"
    if self.bar is not None:
      self.bar.write(line)
    else:
      print(line, flush=True)

  def message(self, text: str) -> None:
    if self.lead:
      (self.bar.write if self.bar is not None else print)(text)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    if self.writer is not None:
      self.writer.close()
      self.file.close()


def _lines_up_to(path: str, step: int) -> list[str]:
  """The lines of an earlier ``metrics.jsonl`` at steps <= ``step`` (none for a fresh start)."""
  if not os.path.exists(path) or step == 0:
    return []
  with open(path) as f:
    return [line for line in f if line.strip() and json.loads(line)["step"] <= step]


def read_metrics(out_dir: str) -> list[dict[str, Any]]:
  """The records of a run's ``metrics.jsonl``."""
  with open(os.path.join(out_dir, METRICS_FILE)) as f:
    return [json.loads(line) for line in f if line.strip()]
