"""The implementations of a lamb step by name, and the one place that picks the one that runs.

Each backend is registered here by name where it can be imported, and answers
through the `Backend` protocol where ``auto`` should not take it
(`Backend.auto_reason`) and which steps it cannot compute
(`Backend.unsupported_reason`); the first that can take the step computes it.
Adding a backend (say ``"pallas_mosaic_gpu"``) is one module under
``optax_lamb/backends/`` and one line of `_LOADERS` (docs/architecture.md).

* ``"auto"``: the first of `AUTO_ORDER` that takes the step: the Pallas Triton
  kernels on one GPU (or the local shards inside ``shard_map``/``pmap``) where
  the jax has them and the leaves fit; where this jax has no Pallas Triton, the
  Mosaic GPU kernels on a GPU of compute capability 9.0 or newer; else XLA. The
  choice is logged (INFO, logger ``optax_lamb``) when the step is traced.
* ``"pallas_triton"`` (alias ``"pallas"``), ``"pallas_mosaic_gpu"`` or a
  configured backend object: that backend (the kernels run in interpret mode
  without a GPU, with a warning), falling back to XLA with a warning where it
  cannot compute the step.
* ``"xla"``: the fused XLA path; XLA partitions it under ``jax.jit``.
* ``"reference"``: `optax_lamb.step._reference.ReferenceBackend`, the stages' plain math per
  leaf in the same planned step (never taken by ``auto``).

Warnings point at the caller's line, however many wrappers sit in between.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import jax
import numpy as np

from optax_lamb.step._plan import LeafArrays, StepPlan, StepResult

ImplementationName: TypeAlias = Literal[
  "auto", "xla", "reference", "pallas_triton", "pallas_mosaic_gpu", "pallas"
]
Implementation: TypeAlias = "ImplementationName | Backend"
ALIASES = {"pallas": "pallas_triton"}  # the Triton kernels' name before a second GPU backend
AUTO_ORDER = ("pallas_triton", "pallas_mosaic_gpu", "xla")  # Mosaic GPU where Triton is missing
GPU_BACKENDS = ("pallas_triton", "pallas_mosaic_gpu")  # auto_reason: not on other backends
# Why `auto` takes a backend where it can, for the log line: what was measured, where.
AUTO_BASIS = {
  "pallas_triton": (
    "one GPU: faster than the XLA path and optax.lamb on an H200, device-only and end to end, "
    "BERT-base and -large in float32 (benchmarks/results/nvidia-h200-e99601a.json); other GPUs, "
    "trees and moment dtypes follow it"
  ),
}
_LOG = logging.getLogger("optax_lamb")


@runtime_checkable
class Backend(Protocol):
  """What the registry needs of a backend (`optax_lamb.backends`)."""

  @property
  def name(self) -> str: ...

  @property
  def differentiable(self) -> bool:
    """Whether jax differentiates its step (else it takes the XLA step's derivatives)."""
    ...

  def auto_reason(self) -> str | None: ...

  def unsupported_reason(self, plan: StepPlan, leaves: list[LeafArrays]) -> str | None: ...

  def runs_interpreted(self) -> bool: ...

  def step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class Unavailable:
  """A backend that cannot be imported on this jax: every step falls back, saying why."""

  name: str
  reason: str
  differentiable: bool = False

  def auto_reason(self) -> str:
    return self.reason

  def unsupported_reason(self, plan: StepPlan, leaves: list[LeafArrays]) -> str:
    return self.reason

  def runs_interpreted(self) -> bool:
    return False

  def step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult:
    raise NotImplementedError(self.reason)


def _import(module: str, attribute: str) -> Callable[[], Backend]:
  return lambda: getattr(importlib.import_module(module), attribute)()


# name -> (what it is, a function making the backend with its default configuration)
_LOADERS: dict[str, tuple[str, Callable[[], Backend]]] = {
  "reference": ("the reference", _import("optax_lamb.step._reference", "ReferenceBackend")),
  "xla": ("XLA", _import("optax_lamb.backends.xla", "XlaBackend")),
  "pallas_triton": (
    "Pallas Triton",
    _import("optax_lamb.backends.pallas_triton", "PallasTritonBackend"),
  ),
  "pallas_mosaic_gpu": (
    "Pallas Mosaic GPU",
    _import("optax_lamb.backends.pallas_mosaic_gpu", "PallasMosaicGpuBackend"),
  ),
}
NAMES: tuple[str, ...] = ("auto", *_LOADERS, *ALIASES)


def backend(name: str) -> Backend:
  """The registered backend `name` (or its alias) with its defaults, or why it cannot be
  imported here."""
  return _backend(ALIASES.get(name, name))


@functools.cache
def _backend(name: str) -> Backend:
  title, load = _LOADERS[name]
  try:
    return load()
  except Exception as e:  # a future jax without Pallas Triton, a broken install
    reason = f"{title} is not available on jax {jax.__version__} ({type(e).__name__}: {e})"
    return Unavailable(name, reason)


def check_implementation(implementation: Any) -> None:
  if isinstance(implementation, str) and implementation in NAMES:
    return
  if not isinstance(implementation, str) and isinstance(implementation, Backend):
    return
  raise ValueError(
    f"implementation must be one of {NAMES} or a backend object "
    f"(optax_lamb.backends), got implementation={implementation!r}"
  )


def _candidates(implementation: Implementation) -> list[Backend]:
  """The backends to try, in order: the requested one first, XLA last."""
  if implementation == "auto":
    return [_for_auto(name) for name in AUTO_ORDER]
  chosen = backend(implementation) if isinstance(implementation, str) else implementation
  return [chosen] if chosen.name == "xla" else [chosen, backend("xla")]


def _for_auto(name: str) -> Backend:
  """The backend `name` for `auto`; without a GPU, a GPU backend is not imported (its import
  registers lowering rules), and says why `auto` passes it by."""
  if name in GPU_BACKENDS and jax.default_backend() != "gpu":
    return Unavailable(name, f"backend {jax.default_backend()!r}: the kernels are for GPUs")
  return backend(name)


def choose(implementation: Implementation, plan: StepPlan, leaves: list[LeafArrays]) -> Backend:
  """The backend that computes this step; reports a fallback (see the module docstring)."""
  auto = implementation == "auto"
  asked = getattr(implementation, "name", implementation)
  reasons, chosen = [], None
  for candidate in _candidates(implementation):
    reason = (candidate.auto_reason() if auto else None) or candidate.unsupported_reason(
      plan, leaves
    )
    if reason is None:
      chosen = candidate
      break
    reasons.append(f"{candidate.name}: {reason}")
  assert chosen is not None  # XLA takes every step
  if auto:
    _LOG.info(
      "optax_lamb.lamb: the %s path (%s)",
      chosen.name,
      "; ".join(reasons) or AUTO_BASIS.get(chosen.name, "first choice"),
    )
  elif reasons:
    warn_at_caller(
      f"optax_lamb.lamb(implementation={asked!r}): {'; '.join(reasons)}; it runs on the "
      f"{chosen.name} path."
    )
  elif chosen.runs_interpreted() and jax.default_backend() != "gpu":
    warn_at_caller(
      f"optax_lamb.lamb(implementation={asked!r}) on a backend without a GPU runs its "
      "kernels in Pallas interpret mode, which is slow; use implementation='xla' there."
    )
  return chosen


def step(
  implementation: Implementation, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool
) -> StepResult:
  """The step on the backend `choose` picks; a backend jax cannot differentiate takes the XLA
  step's derivatives."""
  chosen = choose(implementation, plan, leaves)
  if chosen.differentiable:
    return chosen.step(plan, leaves, apply=apply)
  return _with_xla_derivatives(chosen, plan, leaves, apply)


def _with_xla_derivatives(chosen: Backend, plan: StepPlan, leaves: list, apply: bool) -> StepResult:
  """`chosen`'s step, whose derivatives (jvp, vjp, grad) are the XLA step's.

  A kernel has no differentiation rule of its own (a ``pallas_call`` with aliased
  buffers cannot even be linearised); the XLA step computes the same function,
  so its JVP serves. Without differentiation only the backend's step runs.
  """
  treedef: Any
  flat, treedef = jax.tree.flatten((plan, leaves))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in flat]

  def step_of(b: Backend) -> Callable[..., StepResult]:
    def run(*arrays: jax.Array) -> StepResult:
      it = iter(arrays)
      p, xs = treedef.unflatten([next(it) if a else x for x, a in zip(flat, is_array, strict=True)])
      return b.step(p, xs, apply=apply)

    return run

  stepped = jax.custom_jvp(step_of(chosen))
  stepped.defjvp(lambda primals, tangents: jax.jvp(step_of(backend("xla")), primals, tangents))
  return stepped(*(x for x, a in zip(flat, is_array, strict=True) if a))


def _library_dirs() -> tuple[str, ...]:
  """Folders whose frames are not the caller's: this package and the libraries that call it."""
  dirs = []
  for name in ("optax_lamb", "optax", "jax", "jaxlib", "flax", "chex"):
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path:
      dirs.append(os.path.dirname(path) + os.sep)
  return tuple(dirs)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
  """`warnings.warn` attributed to the first frame outside optax_lamb, optax, jax and flax."""
  dirs, level = _library_dirs(), 2  # level 2: our caller
  frame: FrameType | None = sys._getframe(1)
  while frame is not None and frame.f_code.co_filename.startswith(dirs):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
