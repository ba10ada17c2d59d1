"""The one place that picks how a lamb step is computed, and says why a case falls back.

``implementation="auto"`` takes the Pallas kernels where they are the fastest
validated path: a GPU backend, a jax whose Pallas has its Triton backend, one
device or the local shards inside ``shard_map``/``pmap``, and leaves the kernels
support (`backends.pallas.unsupported_reason`). Everywhere else it takes the
XLA path. ``"pallas"`` asks for the kernels (in interpret mode without a GPU)
and falls back to XLA, with a warning, only where they cannot run the step.
``"xla"`` and ``"reference"`` (the plain chain of stages) are taken as asked.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, NamedTuple

import jax
import optax

from optax_lamb import _plan
from optax_lamb.backends import xla

IMPLEMENTATIONS = ("auto", "xla", "pallas", "reference")
_LOG = logging.getLogger("optax_lamb")


class Choice(NamedTuple):
  """The backend that computes a step, and why it is not the kernels (None if it is)."""

  backend: str  # "pallas", "xla" or "reference"
  reason: str | None


@functools.cache
def pallas_import_error() -> str | None:
  """Why the Pallas backend cannot be imported on this jax (None if it can)."""
  try:
    from optax_lamb.backends import pallas  # noqa: F401
  except Exception as e:  # a future jax without Pallas Triton, a broken install
    return f"Pallas Triton is not available on jax {jax.__version__} ({type(e).__name__}: {e})"
  return None


def _sharding_reason() -> str | None:
  """Why kernels could gather sharded leaves here: several devices, not all axes manual."""
  devices = jax.device_count()
  if devices == 1:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  if not mesh.empty and manual == set(mesh.axis_names):
    return None  # inside shard_map/pmap: each device runs the kernels on its own shards
  return (
    f"{devices} devices outside shard_map: under jit sharding a pallas_call would gather "
    "sharded leaves (run the step inside jax.shard_map to use the kernels)"
  )


def choose(implementation: str, grads: list, mu: list, nu: list, params: list) -> Choice:
  """The backend for one step over these leaves (lists), and the reason for a fallback."""
  if implementation in ("xla", "reference"):
    return Choice(implementation, None)
  if implementation == "auto":
    if jax.default_backend() != "gpu":
      return Choice("xla", f"backend {jax.default_backend()!r}: the kernels are for GPUs")
    reason = pallas_import_error() or _sharding_reason()
  else:
    reason = pallas_import_error()
  if reason is None:
    from optax_lamb.backends import pallas

    reason = pallas.unsupported_reason(grads, mu, nu, params)
  return Choice("xla", reason) if reason else Choice("pallas", None)


_REPORTED: set[tuple[str, str]] = set()


def _report(implementation: str, choice: Choice) -> None:
  """Say once per reason why a step falls back: a warning when the kernels were asked for."""
  key = (implementation, choice.reason or choice.backend)
  if key in _REPORTED:
    return
  _REPORTED.add(key)
  if implementation == "pallas" and choice.reason:
    message = f"optax_lamb.lamb(implementation='pallas'): {choice.reason}; it runs on the XLA path."
    warnings.warn(message, stacklevel=6)
  elif implementation == "pallas" and jax.default_backend() != "gpu":
    from optax_lamb.backends.pallas import chunks

    if chunks.interpret():
      warnings.warn(
        "optax_lamb.lamb(implementation='pallas') on a backend without a GPU runs its kernels in "
        "Pallas interpret mode, which is slow; use implementation='xla' there.",
        stacklevel=6,
      )
  elif implementation == "auto":
    _LOG.info("optax_lamb.lamb: the %s path (%s)", choice.backend, choice.reason or "kernels")


def step(
  config: _plan.LambConfig,
  stages: optax.GradientTransformation,
  implementation: str,
  grads: Any,
  state: tuple,
  params: Any,
  *,
  apply: bool = False,
) -> tuple[Any, tuple]:
  """One lamb step: (updates, new state), or (new params, new state) with `apply`.

  `grads` are validated and float32 (the prologue's work); `stages` is the
  reference chain, whose state every backend shares.
  """
  if implementation == "reference":
    updates, state = stages.update(grads, state, params)
    updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
    return (optax.apply_updates(params, updates) if apply else updates), state
  plan = _plan.plan_step(config, grads, state, params)
  adam = state[1]
  leaves = [plan.treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, params)]
  choice = choose(implementation, *leaves)
  _report(implementation, choice)
  if choice.backend == "pallas":
    from optax_lamb.backends import pallas

    backend_step = pallas.step
  else:
    backend_step = xla.step
  out, mu, nu, ratios = backend_step(plan, *leaves, apply=apply)
  return jax.tree.unflatten(plan.treedef, out), _plan.next_state(plan, mu, nu, ratios)
