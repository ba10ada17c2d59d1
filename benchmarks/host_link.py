"""The host-device link's bandwidth, measured as the offloaded step uses it: copies between device
memory and pinned_host memory inside one jitted call (`optax_lamb.offload`'s copies)."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from benchmarks.timing import timed


def _copies(x: jax.Array, repeats: int, to_host: bool) -> jax.Array:
  """`repeats` copies of `x` to the other memory and back, one pass each way per repeat."""
  there = jax.memory.Space.Host if to_host else jax.memory.Space.Device
  back = jax.memory.Space.Device if to_host else jax.memory.Space.Host

  def body(i, x):
    x, _ = jax.lax.optimization_barrier((x, i))
    y, _ = jax.lax.optimization_barrier((jax.device_put(x, there), i))  # no round trip elided
    return jax.device_put(y, back)

  return jax.lax.fori_loop(0, repeats, body, x)


def measure(elements: int, repeats: int, runs: int = 5) -> dict:
  """GB/s of a round trip device -> pinned_host -> device (both directions counted), median of
  `runs` calls of `repeats` round trips each; None where the backend has no pinned_host memory."""
  x = jnp.full((elements,), 1.5, jnp.float32)
  try:
    fn = jax.jit(lambda x: _copies(x, repeats, to_host=True)).lower(x).compile()
  except Exception as e:  # noqa: BLE001 - a backend without host memory: say so in the report
    return {"host_link_gbps": None, "host_link_error": f"{type(e).__name__}: {e}"[:300]}
  times = []
  for _ in range(runs + 1):
    _, wall, _ = timed(fn, x)
    times.append(wall / repeats)
  times = times[1:]  # the first call warms up
  return {
    "host_link_gbps": 2 * x.nbytes / statistics.median(times) / 1e9,
    "host_link_bytes": 2 * x.nbytes,
    "host_link_times_ms": [round(1e3 * t, 4) for t in times],
  }
