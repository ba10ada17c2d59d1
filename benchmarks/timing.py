"""Timing a step: device-only (K steps in one jitted call) and end to end (one call per step).

Both compile the step with params and state donated, arguments ordered (params, state, grads), as a
training loop calls it. Each function returns what the timed calls produced, so the caller carries
the advanced params and state on (the donated inputs are gone).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import jax

# The figures of one run, in the order `measure` returns them: device wall and CPU seconds per
# step, end-to-end wall and CPU seconds per step, and end to end with a block after each call.
FIGURES = ("times", "cpu", "e2e", "e2e_cpu", "e2e_sync")


def donating_jit(step: Callable) -> Callable:
  """`step` jitted with its params and state (the first two arguments) donated."""
  return jax.jit(step, donate_argnums=(0, 1))


def compile_quietly(jitted: Callable, args: tuple):
  """The executable of `jitted` for `args`, without the warnings of donated buffers left unused."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # donated buffers XLA cannot reuse (none for these steps)
    return jitted.lower(*args).compile()


def device_loop(step: Callable, steps: int) -> Callable:
  """`steps` steps in one call: (params, state) carried by a fori_loop, grads fixed."""

  def loop(params, state, grads):
    def body(i, carry):
      # The barrier ties the carry and grads to the loop index: XLA can neither hoist work on
      # grads alone (g^2, a cast) out of the loop nor, if it unrolls the loop, fuse one step's last
      # pass with the next one's first. Either would make a step look cheaper than a call of it.
      (params, state), g, _ = jax.lax.optimization_barrier((carry, grads, i))
      return step(params, state, g)

    return jax.lax.fori_loop(0, steps, body, (params, state))

  return loop


def compile_device_loop(step: Callable, steps: int, args: tuple):
  """The executable of `device_loop(step, steps)` for `args` = (params, state, grads)."""
  return compile_quietly(donating_jit(device_loop(step, steps)), args)


def timed(fn: Callable, *args):
  """`fn(*args)` run to completion: its output, wall seconds and process CPU seconds."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - wall, time.process_time() - cpu


def timed_calls(fn: Callable, params, state, grads, calls: int, sync: bool):
  """`calls` steps, one call each, as a training loop makes them; wall and CPU seconds per step."""
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(calls):
    params, state = fn(params, state, grads)
    if sync:
      jax.block_until_ready((params, state))
  jax.block_until_ready((params, state))
  return (params, state), (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def measure(loop: Callable, e2e: Callable, steps: tuple[int, int], params, state, grads):
  """One run of every figure: the device loop once, then e2e calls without and with a sync.

  `steps` is (steps per call of `loop`, calls per e2e figure). Returns the advanced (params, state)
  and the figures in FIGURES order, seconds per step.
  """
  inner_steps, e2e_steps = steps
  (params, state), wall, cpu = timed(loop, params, state, grads)
  (params, state), e2e_wall, e2e_cpu = timed_calls(e2e, params, state, grads, e2e_steps, sync=False)
  (params, state), sync_wall, _ = timed_calls(e2e, params, state, grads, e2e_steps, sync=True)
  return (params, state), (wall / inner_steps, cpu / inner_steps, e2e_wall, e2e_cpu, sync_wall)
