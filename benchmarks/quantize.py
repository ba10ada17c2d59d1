"""8-bit block-wise moments (optax_lamb.core._quantize): state bytes, error and round-trip time.

  python -m benchmarks.quantize                  # 94M elements, as in benchmarks/NOTES.md
  python -m benchmarks.quantize --elements 1e6   # a quick look

Prints, for the signed map (first moment) and the unsigned one (second moment):
- state bytes per parameter of a leaf of --elements elements, last axis 3072, from the arrays;
- the median wall and CPU time of quantize, dequantize and both, one jitted call on fresh inputs;
- on simulated Adam moments (a noisy gradient per element, row scales spread over two
  decades, 200 EMA steps in float64): the relative RMS error of each moment, the relative
  error of the direction u = m / (sqrt(v) + eps) per element, and the change of ||u||;
and the state bytes per parameter of the BERT recipe's model (small leaves stay float32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import machine
from optax_lamb.core import _quantize as q

LAST_AXIS = 3072


def _f32(x: jax.Array) -> np.ndarray:
  return np.asarray(x, np.float64)


def roundtrip(x: np.ndarray, signed: bool) -> np.ndarray:
  return _f32(q.dequantize(*q.quantize(jnp.asarray(x, jnp.float32), signed), signed))


def simulated_moments(rng: np.random.Generator, shape: tuple[int, int]) -> tuple:
  """Adam's m and v (float64) after 200 steps of noisy gradients, b1 0.9, b2 0.999."""
  rows = 10.0 ** rng.uniform(-2, 0, size=(shape[0], 1))
  mean = rng.normal(size=shape) * 0.3 * rows
  m, v = np.zeros(shape), np.zeros(shape)
  for _ in range(200):
    g = mean + rows * rng.normal(size=shape)
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
  return m, v


def error_report(rng: np.random.Generator) -> dict[str, float]:
  m, v = simulated_moments(rng, (256, LAST_AXIS))
  m8, v8 = roundtrip(m, True), roundtrip(v, False)
  eps = 1e-6
  u, u8 = m / (np.sqrt(v) + eps), m8 / (np.sqrt(v8) + eps)
  rel = np.abs(u8 - u) / np.abs(u)
  gauss = rng.normal(size=(256, LAST_AXIS))
  return {
    "gaussian m: relative RMS error": np.linalg.norm(roundtrip(gauss, True) - gauss)
    / np.linalg.norm(gauss),
    "squared gaussian v: relative RMS error": np.linalg.norm(roundtrip(gauss**2, False) - gauss**2)
    / np.linalg.norm(gauss**2),
    "simulated m: relative RMS error": np.linalg.norm(m8 - m) / np.linalg.norm(m),
    "simulated v: relative RMS error": np.linalg.norm(v8 - v) / np.linalg.norm(v),
    "u per element: median relative error": float(np.median(rel)),
    "u per element: 99th percentile": float(np.quantile(rel, 0.99)),
    "||u||: relative change": abs(np.linalg.norm(u8) / np.linalg.norm(u) - 1),
  }


def _median_time(fn, inputs: list, runs: int) -> tuple[float, float]:
  """Median wall and process CPU seconds of one call (CPU time shows the share a loaded machine
  gave the process)."""
  jax.block_until_ready(fn(inputs[0]))  # compile and warm up
  wall, cpu = [], []
  for i in range(runs):
    x = inputs[(i + 1) % len(inputs)]
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(x))
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return statistics.median(wall), statistics.median(cpu)


def timing_report(elements: int, runs: int) -> dict[str, float]:
  shape = (-(-elements // LAST_AXIS), LAST_AXIS)
  keys = jax.random.split(jax.random.key(0), 2)
  normal = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32))
  inputs = [normal(k) for k in keys]
  report = {"elements": float(np.prod(shape))}
  state_bytes = 0.0
  for signed in (True, False):
    name = "signed" if signed else "unsigned"
    xs = inputs if signed else [x * x for x in inputs]
    quant = jax.jit(lambda x, s=signed: q.quantize(x, s))
    both = jax.jit(lambda x, s=signed: q.dequantize(*q.quantize(x, s), s))
    codes = [quant(x) for x in xs]
    dequant = jax.jit(lambda c, s=signed: q.dequantize(*c, s))
    state_bytes += sum(a.nbytes for a in codes[0]) / report["elements"]
    for label, fn, args in (("quantize", quant, xs), ("dequantize", dequant, codes),
                            ("quantize + dequantize", both, xs)):  # fmt: skip
      wall, cpu = _median_time(fn, args, runs)
      report[f"{name}: {label}, wall s"], report[f"{name}: {label}, CPU s"] = wall, cpu
    del codes
  report["state bytes per parameter, both moments"] = state_bytes
  return report


def recipe_state_bytes() -> float:
  """Bytes per parameter of both moments for the BERT recipe's model (float32 small leaves)."""
  from optax_lamb_recipes.model import BertConfig, init_params

  _, params = init_params(BertConfig())
  total = size = 0
  for leaf in jax.tree.leaves(params):
    size += leaf.size
    if q.quantizes(leaf.shape):
      total += 2 * (leaf.size + 4 * int(np.prod(q.scales_shape(leaf.shape))))
    else:
      total += 8 * leaf.size
  return total / size


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--elements", type=float, default=94e6)
  parser.add_argument("--runs", type=int, default=5)
  args = parser.parse_args()
  print(f"{machine.describe_device()}, jax {jax.__version__}, load average {os.getloadavg()}")
  for name, value in error_report(np.random.default_rng(0)).items():
    print(f"{name:45s} {value:.3g}")
  print(f"{'BERT recipe: state bytes per parameter':45s} {recipe_state_bytes():.3f}")
  for name, value in timing_report(int(args.elements), args.runs).items():
    print(f"{name:45s} {value:.4g}")


if __name__ == "__main__":
  main()
