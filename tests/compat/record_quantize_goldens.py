"""Records bitsandbytes' block-wise 8-bit quantization into tests/compat/goldens/.

Writes bitsandbytes_quantize.npz: its two dynamic code tables
(``create_dynamic_map(signed=True|False)``, keys 'signed/code', 'unsigned/code') and,
for every case of CASES, the input '<case>/x', and what ``quantize_blockwise`` /
``dequantize_blockwise`` (block 256, the map of the case) return: '<case>/index'
(uint8 table indices), '<case>/absmax', '<case>/dequantized'. bitsandbytes_quantize.json
records the versions and the environment, and whether ``LAMB8bit`` and ``AdamW8bit``
moved a parameter of 8,192 elements identically over three steps (on the CPU, bitsandbytes
0.50.2 runs the same Adam update for both, with no trust ratio; docs/quantized_moments.md).

bitsandbytes flattens a tensor before splitting it into blocks; the cases are 1-D or have a
last axis that is a multiple of 256, where its blocks are ours. tests/compat/test_quantize_goldens.py
reads the files; nothing here runs in the test suite. bitsandbytes and torch stay out of the
project's environments, in a venv of their own (torch's CPU wheel):

  python -m venv /tmp/bnb && /tmp/bnb/bin/pip install torch==2.13.0 bitsandbytes==0.50.2 numpy
  /tmp/bnb/bin/python tests/compat/record_quantize_goldens.py
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

GOLDENS = Path(__file__).resolve().parent / "goldens"
BLOCK = 256


def _log_uniform(rng: np.random.Generator, shape: tuple[int, ...], decades: float) -> np.ndarray:
  """Magnitudes spread evenly over `decades` decades below 1 (every decade of the map)."""
  return 10.0 ** -rng.uniform(0, decades, size=shape)


def cases() -> dict[str, tuple[np.ndarray, bool]]:
  """name -> (float32 input, signed map)."""
  rng = np.random.default_rng(20261125)
  rows = 10.0 ** rng.uniform(-4, 2, size=(4, 1))  # a magnitude per row, as in a moment leaf
  signs = np.where(rng.uniform(size=(2, 768)) < 0.5, -1.0, 1.0)
  out = {
    "signed_normal": (rng.normal(size=(4, 512)) * rows, True),
    "unsigned_squares": ((rng.normal(size=(4, 512)) * rows) ** 2, False),
    "signed_wide": (signs * _log_uniform(rng, (2, 768), 8), True),
    "unsigned_wide": (_log_uniform(rng, (2, 768), 8), False),
    "signed_partial_1d": (rng.normal(size=600), True),
    "unsigned_partial_1d": (rng.normal(size=600) ** 2, False),
  }
  return {name: (x.astype(np.float32), signed) for name, (x, signed) in out.items()}


def _lamb8bit_is_adamw8bit(torch, bnb) -> bool:
  """Whether LAMB8bit and AdamW8bit move a parameter of 8,192 elements identically (3 steps)."""
  results = []
  for make in (bnb.optim.LAMB8bit, bnb.optim.AdamW8bit):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = make([p], lr=1e-2, weight_decay=0.01)
    for step in range(3):
      p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) + step).reshape(p.shape)
      opt.step()
    results.append(p.detach().clone())
  return bool(torch.equal(*results))


def main() -> None:
  import bitsandbytes as bnb
  import bitsandbytes.functional as F
  import torch

  arrays = {}
  maps = {True: F.create_dynamic_map(signed=True), False: F.create_dynamic_map(signed=False)}
  arrays["signed/code"] = maps[True].numpy()
  arrays["unsigned/code"] = maps[False].numpy()
  for name, (x, signed) in cases().items():
    index, state = F.quantize_blockwise(torch.from_numpy(x), code=maps[signed], blocksize=BLOCK)
    back = F.dequantize_blockwise(index, state)
    arrays |= {
      f"{name}/x": x,
      f"{name}/index": index.numpy(),
      f"{name}/absmax": state.absmax.numpy(),
      f"{name}/dequantized": back.numpy(),
    }
  GOLDENS.mkdir(exist_ok=True)
  np.savez_compressed(GOLDENS / "bitsandbytes_quantize.npz", **arrays)
  meta = {
    "bitsandbytes": bnb.__version__,
    "torch": torch.__version__,
    "numpy": np.__version__,
    "python": platform.python_version(),
    "machine": platform.machine(),
    "block_size": BLOCK,
    "cases": {name: {"shape": list(x.shape), "signed": s} for name, (x, s) in cases().items()},
    "lamb8bit_equals_adamw8bit": _lamb8bit_is_adamw8bit(torch, bnb),
  }
  (GOLDENS / "bitsandbytes_quantize.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
  main()
