"""The one place that picks the backend of a lamb step, and says why a case falls back.

The backends form an ordered table (tokamax's idea): each says where ``auto``
should not take it (`auto_reason`) and which steps it cannot compute
(`unsupported_reason`); the first that can take the step computes it.

* ``"auto"``: the Pallas kernels where they are the fastest validated path (a
  GPU backend, one device or the local shards inside ``shard_map``/``pmap``, a
  jax whose Pallas has its Triton backend, leaves the kernels take), else XLA;
  the choice is logged (INFO, logger ``optax_lamb``) when the step is traced.
  Under ``jax.jit`` on several GPUs ``auto`` stays on XLA: the kernels run
  per device there, but their speed on several GPUs is not measured yet.
* ``"pallas"`` or a configured backend object: that backend (the kernels run in
  interpret mode without a GPU, with a warning), falling back to XLA with a
  warning where it cannot compute the step. Under ``jax.jit`` over sharded
  arrays the kernels run on each device's shards
  (`optax_lamb.backends.per_device`: ``shard_map`` on a mesh of Explicit axes,
  ``custom_partitioning`` on one of Auto axes).
* ``"xla"``: the fused XLA path; XLA partitions it under ``jax.jit``.
  ``"reference"`` (the chain of stages) is chosen when the transformation is
  built (`optax_lamb._lamb`), never here.

The fallbacks of the kernels, each with its reason (`PallasBackend.auto_reason`
and ``unsupported_reason``):

* ``auto`` only: not a GPU backend; several devices outside ``shard_map``/``pmap``;
* a jax without Pallas Triton, or whose Pallas fails to import;
* params or moments other than float32, bfloat16, float16; gradients that are
  not float32 after the cast (float64 under ``jax_enable_x64``);
* a leaf of 2**31 - ``block`` elements or more (int32 offsets);
* a mesh whose axes mix types (Explicit with Auto, or partly Manual);
* ``vmap`` or differentiation of the step on a mesh of Auto axes
  (``custom_partitioning`` has no batching or differentiation rule).

Warnings point at the caller's line, however many wrappers sit in between.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import warnings
from typing import Any, Protocol

import jax
import numpy as np

from optax_lamb import _plan
from optax_lamb.backends.xla import XlaBackend

IMPLEMENTATIONS = ("auto", "xla", "pallas", "reference")
_LOG = logging.getLogger("optax_lamb")


class Backend(Protocol):
  """What the dispatcher needs of a backend (`optax_lamb.backends`)."""

  name: str

  def auto_reason(self) -> str | None: ...

  def unsupported_reason(self, plan: _plan.StepPlan, leaves: list) -> str | None: ...

  def step(self, plan: _plan.StepPlan, leaves: list, *, apply: bool) -> _plan.StepResult: ...


def is_backend(x: Any) -> bool:
  return all(callable(getattr(x, f, None)) for f in ("auto_reason", "unsupported_reason", "step"))


def check_implementation(implementation: Any) -> None:
  if isinstance(implementation, str) and implementation in IMPLEMENTATIONS:
    return
  if not isinstance(implementation, str) and is_backend(implementation):
    return
  raise ValueError(
    f"implementation must be one of {IMPLEMENTATIONS} or a backend object "
    f"(optax_lamb.backends), got implementation={implementation!r}"
  )


@dataclasses.dataclass(frozen=True)
class _Unavailable:
  """A backend that cannot be imported on this jax: every step falls back, saying why."""

  name: str
  reason: str

  def auto_reason(self) -> str:
    return self.reason

  def unsupported_reason(self, plan, leaves) -> str:
    return self.reason

  def step(self, plan, leaves, *, apply):
    raise NotImplementedError(self.reason)


@functools.cache
def default_pallas() -> Backend:
  """The Pallas backend with its default launch sizes, or why it cannot be imported."""
  try:
    from optax_lamb.backends.pallas import PallasBackend
  except Exception as e:  # a future jax without Pallas Triton, a broken install
    reason = f"Pallas Triton is not available on jax {jax.__version__} ({type(e).__name__}: {e})"
    return _Unavailable("pallas", reason)
  return PallasBackend()


XLA = XlaBackend()


def _table(implementation: Any) -> list[Backend]:
  """The backends to try, in order: the requested one first, XLA last."""
  if implementation in ("auto", "pallas"):
    return [default_pallas(), XLA]
  if implementation == "xla":
    return [XLA]
  return [implementation, XLA]


def choose(implementation: Any, plan: _plan.StepPlan, leaves: list) -> Backend:
  """The backend that computes this step; reports a fallback (see the module docstring)."""
  auto = implementation == "auto"
  reasons = []
  for backend in _table(implementation):
    reason = (backend.auto_reason() if auto else None) or backend.unsupported_reason(plan, leaves)
    if reason is None:
      break
    reasons.append(f"{backend.name}: {reason}")
  if auto:
    _LOG.info(
      "optax_lamb.lamb: the %s path (%s)", backend.name, "; ".join(reasons) or "first choice"
    )
  elif reasons:
    warn_at_caller(
      f"optax_lamb.lamb(implementation={getattr(implementation, 'name', implementation)!r}): "
      f"{'; '.join(reasons)}; it runs on the {backend.name} path."
    )
  elif getattr(backend, "runs_interpreted", lambda: False)() and jax.default_backend() != "gpu":
    warn_at_caller(
      "optax_lamb.lamb(implementation='pallas') on a backend without a GPU runs its kernels in "
      "Pallas interpret mode, which is slow; use implementation='xla' there."
    )
  return backend


def step(config, implementation, grads: Any, state: tuple, params: Any, *, apply: bool):
  """One lamb step: (updates, new state), or (new params, new state) with `apply`.

  `grads` are validated and in the compute dtype (the prologue's work).
  """
  plan = _plan.plan_step(config, grads, state, params)
  leaves = _plan.leaf_arrays(plan, grads, params)
  backend = choose(implementation, plan, leaves)
  if backend is XLA:
    result = XLA.step(plan, leaves, apply=apply)
  else:
    result = _with_xla_derivatives(backend, plan, leaves, apply)
  return jax.tree.unflatten(plan.treedef, result.out), _plan.next_state(plan, result)


def _with_xla_derivatives(backend: Backend, plan, leaves: list, apply: bool) -> _plan.StepResult:
  """`backend`'s step, whose derivatives (jvp, vjp, grad) are the XLA step's.

  A kernel has no differentiation rule of its own (a ``pallas_call`` with aliased
  buffers cannot even be linearised); the XLA step computes the same function,
  so its JVP serves. Without differentiation only the backend's step runs.
  """
  flat, treedef = jax.tree.flatten((plan, leaves))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in flat]

  def step_of(chosen: Backend):
    def run(*arrays):
      it = iter(arrays)
      plan, leaves = treedef.unflatten(
        [next(it) if a else x for x, a in zip(flat, is_array, strict=True)]
      )
      return chosen.step(plan, leaves, apply=apply)

    return run

  stepped = jax.custom_jvp(step_of(backend))
  stepped.defjvp(lambda primals, tangents: jax.jvp(step_of(XLA), primals, tangents))
  return stepped(*(x for x, a in zip(flat, is_array, strict=True) if a))


def _library_dirs() -> tuple[str, ...]:
  """Folders whose frames are not the caller's: this package and the libraries that call it."""
  dirs = []
  for name in ("optax_lamb", "optax", "jax", "jaxlib", "flax", "chex"):
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None):
      dirs.append(os.path.dirname(module.__file__) + os.sep)
  return tuple(dirs)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
  """`warnings.warn` attributed to the first frame outside optax_lamb, optax, jax and flax."""
  dirs, level, frame = _library_dirs(), 2, sys._getframe(1)  # level 2: our caller
  while frame is not None and frame.f_code.co_filename.startswith(dirs):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
