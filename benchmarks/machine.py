"""The machine and the software a benchmark ran on: device description, results file name, versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess

import jax

import optax_lamb

# Distributions whose versions a report records, where installed.
_DISTRIBUTIONS = (
  "jax",
  "jaxlib",
  "jax-cuda12-plugin",
  "jax-cuda13-plugin",
  "optax",
  "numpy",
  "triton",
)


def _cpu_model() -> str:
  """The CPU's model name from /proc/cpuinfo, else the machine type (as on macOS)."""
  try:
    with open("/proc/cpuinfo") as f:
      match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
  except OSError:
    match = None
  return match.group(1).strip() if match else platform.machine()


def describe_device() -> str:
  device = jax.devices()[0]
  if device.platform != "cpu":
    return device.device_kind
  return f"CPU: {_cpu_model()}, {os.cpu_count()} cores"


def slugify(device_kind: str) -> str:
  """ "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3" (runs of other characters: one '-')."""
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def device_slug() -> str:
  """File name of this machine's results: the device kind, or cpu-<cores>core on a CPU."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return f"cpu-{os.cpu_count()}core"
  return slugify(device.device_kind)


def commit() -> str:
  """The checkout's commit (short hash), "unknown" outside a git clone."""
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"
  except OSError:
    return "unknown"


def versions() -> dict:
  found = {"python": platform.python_version(), "optax_lamb": optax_lamb.__version__}
  for dist in _DISTRIBUTIONS:
    try:
      found[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found
