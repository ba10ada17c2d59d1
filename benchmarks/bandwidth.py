"""The device's memory bandwidth, measured as the step is (several passes inside one call)."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from benchmarks.timing import timed


class Bandwidth:
  """Memory bandwidth from an in-place jitted scale of a large float32 array (read + write).

  The scale runs `repeats` times in one call, as the device figure's steps do: on a GPU one call's
  dispatch and sync (about 0.3 ms on an H100) is longer than the scale of 256 MiB itself.
  """

  def __init__(self, elements: int, repeats: int = 1):
    self.x = jnp.full((elements,), 1.5, jnp.float32)
    self.bytes = 2 * self.x.nbytes  # of one scale
    self.repeats = repeats

    def scale(x):
      def body(i, x):
        x, _ = jax.lax.optimization_barrier((x, i))  # one pass per repeat, even if unrolled
        return x * 1.0000001

      return jax.lax.fori_loop(0, repeats, body, x)

    self.fn = jax.jit(scale, donate_argnums=0).lower(self.x).compile()
    self.times: list[float] = []  # seconds per scale

  def run(self, record: bool = True) -> None:
    self.x, wall, _ = timed(self.fn, self.x)
    if record:
      self.times.append(wall / self.repeats)

  def gbps(self) -> float:
    return self.bytes / statistics.median(self.times) / 1e9

  def report_fields(self) -> dict:
    """The bandwidth's entries of the step benchmark's JSON report."""
    return {
      "bandwidth_gbps": self.gbps(),
      "bandwidth_bytes": self.bytes,
      "bandwidth_repeats": self.repeats,
      "bandwidth_times_ms": [round(1e3 * t, 4) for t in self.times],
    }
