"""One case of the step benchmark: every implementation compiled and timed on one tree.

Implementations run interleaved, round by round, so they share the machine's load; the first
`warmup` rounds are not recorded; each figure is the median over the recorded rounds. An
implementation that fails, compiling or running, is recorded with its error and the others go on.
"""

from __future__ import annotations

import concurrent.futures
import gc
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import optax

from benchmarks import hlo, timing, trees
from benchmarks.bandwidth import Bandwidth
from benchmarks.implementations import IMPLEMENTATIONS


class Settings(NamedTuple):
  """How every case of a run is timed."""

  impls: list[str]
  runs: int  # recorded rounds
  warmup: int  # rounds run first, not recorded
  inner_steps: int  # K, steps per call of the device figure
  e2e_steps: int  # N, calls per run of the end-to-end figures
  compile_threads: int = 1  # executables compiled at once (XLA compiles without the GIL)


class _Compiled(NamedTuple):
  state_key: tuple  # which of the case's states this implementation advances
  loop: Callable  # the device figure's executable: K steps per call
  e2e: Callable  # the jitted step, one call per step


def _state_layout(tree) -> tuple:
  """What must match for two implementations to share one state: structure, shapes, dtypes."""
  leaves, treedef = jax.tree.flatten(tree)
  return str(treedef), tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


class _Arrays:
  """A case's params and grads, and one state per (family, state layout) of its implementations."""

  def __init__(self, shapes: dict):
    self.shapes = shapes
    self.params = trees.random_params(shapes)
    self.grads = trees.random_grads(shapes)
    self.states: dict[tuple, object] = {}
    self._inits: dict[tuple, Callable] = {}  # to rebuild a state a failed call left deleted

  def state_key(self, family: str, tx: optax.GradientTransformation) -> tuple:
    """The key of the state `tx` advances; made by `tx.init` for the first of its family."""
    key = (family, _state_layout(jax.eval_shape(tx.init, self.params)))
    if key not in self.states:
      self.states[key], self._inits[key] = tx.init(self.params), tx.init
    return key

  def arguments(self, key: tuple) -> tuple:
    return self.params, self.states[key], self.grads

  def keep_states(self, keys: set[tuple]) -> None:
    """Free the states no implementation advances (made for ones that then failed to compile)."""
    for key in set(self.states) - keys:
      trees.delete(self.states.pop(key))

  def advance(self, compiled: _Compiled, settings: Settings) -> tuple[float, ...]:
    """One timed run of `compiled`'s figures; the params and its state advance."""
    key = compiled.state_key
    steps = (settings.inner_steps, settings.e2e_steps)
    (self.params, self.states[key]), figures = timing.measure(
      compiled.loop, compiled.e2e, steps, *self.arguments(key)
    )
    return figures

  def rebuild_deleted(self) -> None:
    """A call that failed may have consumed its donated buffers: rebuild those for the others."""
    if not trees.alive(self.params):
      self.params = trees.random_params(self.shapes)
    for key, state in self.states.items():
      if not trees.alive(state):
        self.states[key] = self._inits[key](self.params)

  def free(self) -> None:
    for tree in (self.params, self.grads, *self.states.values()):
      trees.delete(tree)
    self.states.clear()
    self._inits.clear()


class _Prepared(NamedTuple):
  state_key: tuple
  step: Callable  # (params, state, grads) -> (params, state)


def _prepare(impl: str, arrays: _Arrays) -> _Prepared:
  """`impl`'s step and the state it advances (made here, one thread at a time)."""
  family, make_tx, make_step = IMPLEMENTATIONS[impl]
  tx = make_tx()
  return _Prepared(arrays.state_key(family, tx), make_step(tx))


def _timed(compile_: Callable, *args):
  start = time.perf_counter()
  return compile_(*args), round(time.perf_counter() - start, 3)


def _compile(prepared: _Prepared, arrays: _Arrays, settings: Settings, pool) -> Callable:
  """Starts compiling both executables of one implementation on `pool`; the returned function
  waits for them and gives the `_Compiled` and the facts of its e2e step for the report."""
  args = arrays.arguments(prepared.state_key)
  e2e = timing.donating_jit(prepared.step)
  # Compiled through `e2e` itself, so its first call reuses this executable: the e2e figure goes
  # through jit's own dispatch, as a user's call does.
  e2e_job = pool.submit(_timed, timing.compile_quietly, e2e, args)
  loop_job = pool.submit(
    _timed, timing.compile_device_loop, prepared.step, settings.inner_steps, args
  )

  def result() -> tuple[_Compiled, dict]:
    (e2e_compiled, compile_s), (loop, loop_compile_s) = e2e_job.result(), loop_job.result()
    facts = {
      "memory": hlo.memory(e2e_compiled),
      "state_buffers": len(jax.tree.leaves(args[1])),
      "input_buffers": len(jax.tree.leaves(args)),
      "kernels": hlo.count_kernels(e2e_compiled.as_text()),
      "compile_s": compile_s,
      "loop_compile_s": loop_compile_s,
    }
    return _Compiled(prepared.state_key, loop, e2e), facts

  return result


def _error(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"


class _CaseLog(NamedTuple):
  name: str
  results: dict  # impl -> its entry of the report
  log: Callable[[str], None]

  def failed(self, impl: str, e: BaseException) -> None:
    self.results[impl] = {"error": _error(e)}
    self.log(f"  {self.name} {impl}: {_error(e)}")


def _compile_all(arrays: _Arrays, settings: Settings, out: _CaseLog) -> dict[str, _Compiled]:
  """Every implementation's executables; with `compile_threads` > 1 compiled concurrently (each
  one's compile seconds are then its own wall time beside the others')."""
  compiled, results = {}, {}
  with concurrent.futures.ThreadPoolExecutor(settings.compile_threads) as pool:
    for impl in settings.impls:
      try:  # one implementation failing must not end the run
        results[impl] = _compile(_prepare(impl, arrays), arrays, settings, pool)
      except Exception as e:
        out.failed(impl, e)
    for impl, result in results.items():
      try:
        compiled[impl], out.results[impl] = result()
      except Exception as e:
        out.failed(impl, e)
        continue
      r = out.results[impl]
      out.log(
        f"  {out.name} {impl}: compiled, step {r['compile_s']:.1f} s, loop {r['loop_compile_s']:.1f} s"
      )
  arrays.keep_states({c.state_key for c in compiled.values()})
  return compiled


def _time_rounds(
  arrays: _Arrays, compiled: dict, settings: Settings, bandwidth: Bandwidth, out: _CaseLog
) -> dict[str, dict[str, list[float]]]:
  """Seconds per step of every recorded round: impl -> figure -> one entry a round."""
  times = {impl: {f: [] for f in timing.FIGURES} for impl in compiled}
  for round_ in range(settings.warmup + settings.runs):
    for impl in list(compiled):
      try:
        figures = arrays.advance(compiled[impl], settings)
      except Exception as e:
        out.failed(impl, e)
        del compiled[impl], times[impl]
        arrays.rebuild_deleted()
        continue
      if round_ >= settings.warmup:
        for f, x in zip(timing.FIGURES, figures, strict=True):
          times[impl][f].append(x)
    bandwidth.run(record=round_ >= settings.warmup)
  return times


def _figures_ms(t: dict[str, list[float]]) -> dict:
  """An implementation's timed entries of the report, from its seconds per step by figure."""
  ms = lambda xs: 1e3 * statistics.median(xs)
  listed = lambda xs: [round(1e3 * x, 4) for x in xs]
  return dict(
    device_ms=ms(t["times"]),
    # Older runs' name for the step time (one blocked call per step then), kept comparable.
    median_ms=ms(t["times"]),
    min_ms=1e3 * min(t["times"]),
    cpu_median_ms=ms(t["cpu"]),
    times_ms=listed(t["times"]),
    e2e_ms=ms(t["e2e"]),
    e2e_cpu_ms=ms(t["e2e_cpu"]),
    e2e_times_ms=listed(t["e2e"]),
    e2e_sync_ms=ms(t["e2e_sync"]),
    e2e_sync_times_ms=listed(t["e2e_sync"]),
  )


def run_case(
  name: str, shapes: dict, settings: Settings, bandwidth: Bandwidth, log: Callable[[str], None]
) -> dict:
  """Time every implementation on one tree, interleaved round by round: the case's report entry."""
  n_params, n_leaves = trees.param_count(shapes), len(trees.leaf_shapes(shapes))
  result = {"params": n_params, "leaves": n_leaves, "results": {}}
  out = _CaseLog(name, result["results"], log)
  arrays = _Arrays(shapes)
  compiled = _compile_all(arrays, settings, out)
  times = _time_rounds(arrays, compiled, settings, bandwidth, out)
  # Free this case's arrays and executables before the next case allocates its own.
  arrays.free()
  del arrays, compiled
  jax.clear_caches()
  gc.collect()
  for impl, t in times.items():
    result["results"][impl].update(_figures_ms(t))
  log(f"  {name}: {n_params / 1e6:.1f}M params, {n_leaves} leaves, timed")
  return result
