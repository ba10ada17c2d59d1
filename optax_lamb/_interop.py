"""Where optax_lamb leans on other libraries' private names or registries, each with why and the
versions it was checked on (jax 0.10.0-0.10.2 and 0.11.2, optax 0.2.5-0.2.8, flax 0.12).

Nothing else in the package imports a private name of jax, optax or flax.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax

# optax.tree_map_params calls init with this placeholder to find the state's param-shaped parts
# (optax/tree_utils/_state_utils.py, private). A missing name: nothing is a placeholder.
try:
  from optax.tree_utils._state_utils import _ParamsPlaceholder
except ImportError:  # pragma: no cover
  _ParamsPlaceholder = ()

# The tracer of jax.jit's tracing (jax/_src/interpreters/partial_eval.py); any other tracer
# belongs to a transformation (vmap, jvp) that custom_partitioning cannot take.
_JitTracer: type
try:
  from jax.interpreters.partial_eval import DynamicJaxprTracer as _JitTracer
except ImportError:  # pragma: no cover
  _JitTracer = jax.core.Tracer

# jax 0.11 warns at each lowering of a Pallas Triton kernel; this exact message, nothing else.
TRITON_DEPRECATION = (
  r"The Pallas Triton backend is deprecated and will be removed in a future JAX version\."
)


def is_params_placeholder(x: Any) -> bool:
  """Whether `x` is optax.tree_map_params' stand-in for the params."""
  return isinstance(x, _ParamsPlaceholder)


def is_jit_tracer(x: Any) -> bool:
  """Whether `x` is traced by jax.jit (not by vmap, jvp or another transformation)."""
  return isinstance(x, _JitTracer)


def shape_dtype_like(shape: tuple[int, ...], dtype: Any, like: Any) -> jax.ShapeDtypeStruct:
  """ShapeDtypeStruct with `like`'s manual-axis type, for a pallas_call inside shard_map.

  jax 0.10 names the field ``manual_axis_type``; later versions may call it ``vma``.
  """
  aval = jax.typeof(like)
  fields = inspect.signature(jax.ShapeDtypeStruct).parameters
  for field in ("manual_axis_type", "vma"):
    value = getattr(aval, field, None)
    if field in fields and value is not None:
      return jax.ShapeDtypeStruct(shape, dtype, **{field: value})
  return jax.ShapeDtypeStruct(shape, dtype)


def register_layout_with_flax(layout_type: type) -> None:
  """Teach flax.serialization (if installed) the static trust-ratio layout: nothing is saved,
  the target's layout is kept on restore.

  flax.serialization serializes unknown types as they are, and msgpack then fails on
  the layout object; orbax and jax's own tree functions need nothing (a static node).
  """
  if importlib.util.find_spec("flax") is None:
    return
  try:
    from flax import serialization
  except Exception:  # a broken flax install must not break this package
    return
  serialization.register_serialization_state(
    layout_type, lambda _: {}, lambda target, _: target, override=True
  )


def register_quantized_moment_with_flax(moment_type: type) -> None:
  """Make flax.serialization refuse, with a ValueError naming the path, a checkpoint that holds a
  plain array where the target has an 8-bit moment (`moment_type`: a float32 moment restored into
  an 8-bit optimizer's state).

  flax restores every NamedTuple with one handler (its private ``_NamedTuple`` key in
  ``_STATE_DICT_REGISTRY``, flax 0.12), which reads the checkpoint's value as a dict and failed
  with "AttributeError: 'numpy.ndarray' object has no attribute 'keys'". The handler is wrapped:
  that case raises, every other restore is flax's own. Without those names nothing changes.
  """
  if importlib.util.find_spec("flax") is None:
    return
  try:
    from flax import serialization
  except Exception:  # a broken flax install must not break this package
    return
  key = getattr(serialization, "_NamedTuple", None)
  handlers = getattr(serialization, "_STATE_DICT_REGISTRY", {}).get(key)
  restore = handlers and handlers[1]
  if handlers is None or (isinstance(restore, _RefusingRestore) and restore.moment is moment_type):
    return  # registered once per type
  refusing = _RefusingRestore(moment_type, handlers[1], serialization.current_path)
  serialization.register_serialization_state(key, handlers[0], refusing, override=True)


@dataclasses.dataclass(frozen=True)
class _RefusingRestore:
  """flax's NamedTuple restore (`fallback`), refusing a plain array where the target is a
  `moment` (`register_quantized_moment_with_flax`)."""

  moment: type
  fallback: Callable[[Any, Any], Any]
  current_path: Callable[[], str]

  def __call__(self, target: Any, state: Any) -> Any:
    if isinstance(target, self.moment) and not isinstance(state, Mapping):
      moment: Any = target
      codes, scales = (jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype) for x in moment)
      dtype = getattr(state, "dtype", type(state).__name__)
      found = f"an array of shape {jax.numpy.shape(state)} and dtype {dtype}"
      where = self.current_path().removeprefix("./")
      raise ValueError(
        f"flax.serialization: the checkpoint holds {found} at {where} where the target state "
        f"has an 8-bit moment (QuantizedMoment: codes {codes.dtype} of shape {codes.shape}, "
        f"scales {scales.dtype} of shape {scales.shape}). The checkpoint was saved by an "
        "optimizer with other mu_dtype/nu_dtype: restore it into that optimizer's init(params)."
      )
    return self.fallback(target, state)


def check_host_memory(who: str) -> None:
  """Raise where the default backend's devices have no pinned host memory to offload to."""
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  if "pinned_host" not in kinds:
    raise ValueError(
      f"{who} needs host memory (memory kind 'pinned_host'), which the {jax.default_backend()!r} "
      f"backend's devices do not have (they have {sorted(kinds)})"
    )


def to_memory(x: jax.Array, space: str) -> jax.Array:
  """`x` in host (pinned) or device memory, on its devices: ``jax.memory.Space`` (jax 0.10-0.11),
  inside or outside ``jax.jit``."""
  return jax.device_put(x, jax.memory.Space.Host if space == "host" else jax.memory.Space.Device)


def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` run on the host's cores, its outputs left in host memory: ``compute_on2`` (jax 0.10,
  0.11; ``compute_on`` as a context manager was removed after 0.10)."""
  from jax.experimental.compute_on import compute_on2

  return compute_on2(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)


def full_like_in_memory(x: jax.Array, value: float) -> jax.Array:
  """An array like `x` filled with `value`, in `x`'s memory space: inside ``compute_on`` a new
  constant is device memory (jax 0.10), and operations refuse to mix the two."""
  fill = jax.numpy.full_like(x, value)
  space = getattr(jax.typeof(x), "memory_space", None)
  if space is None or space == jax.memory.Space.Device:
    return fill
  return jax.device_put(fill, space)
