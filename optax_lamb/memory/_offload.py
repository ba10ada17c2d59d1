"""Optimizer state in host memory (ZeRO-Offload's design), around any transformation."""

from __future__ import annotations

from typing import Any, Literal

import jax
import optax

from optax_lamb import _interop
from optax_lamb.core import _moment_storage
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.faults import _check_args, _checks

Compute = Literal["device", "host"]


def _to(tree: Any, space: Literal["host", "device"]) -> Any:
  """Every array of `tree` in host (pinned) or device memory, on the devices it is sharded over."""
  return jax.tree.map(lambda x: _interop.to_memory(x, space), tree)


def _beside(state: Any, params: Any) -> Any:
  """`state` on the devices `params` are sharded over: a subtree shaped like `params` (the
  moments) takes their shardings leaf by leaf, any other leaf (a step count) is replicated over
  their mesh. `init` makes its scalars on the default device, which ``jax.jit`` would refuse
  beside params sharded over several devices. Abstract values pass through."""
  param_def: Any
  param_leaves, param_def = jax.tree.flatten(params)
  shardings = [getattr(p, "sharding", None) for p in param_leaves]
  meshes = [s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)]
  if not meshes or not all(isinstance(p, jax.Array) for p in param_leaves):
    return state
  replicated = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())

  def like_params(x: Any) -> bool:  # the moments: a quantized leaf counts as one
    return param_def.num_leaves > 1 and jax.tree.structure(_checks.moment_leaves(x)) == param_def

  def put(x: Any, s: Any, p: Any) -> Any:
    if s is None:
      return x
    if isinstance(x, QuantizedMoment):  # the codes like the param, the scales split alike
      scales = _moment_storage.scales_sharding(p, x.scales.shape)
      return QuantizedMoment(
        jax.device_put(x.codes, s), x.scales if scales is None else jax.device_put(x.scales, scales)
      )
    return jax.device_put(x, s) if x.shape == p.shape else x

  def place(subtree: Any) -> Any:
    if like_params(subtree):
      leaves = param_def.flatten_up_to(subtree)
      return jax.tree.unflatten(param_def, list(map(put, leaves, shardings, param_leaves)))
    if isinstance(subtree, jax.Array) and subtree.sharding.device_set != replicated.device_set:
      return jax.device_put(subtree, replicated)
    return subtree

  return jax.tree.map(place, state, is_leaf=like_params)


def offload(
  inner: optax.GradientTransformation, *, compute: Compute = "device"
) -> optax.GradientTransformationExtraArgs:
  r"""Keep `inner`'s state in host memory (``pinned_host``) between steps.

  Large-batch LAMB keeps two moments beside the params: 8 bytes a parameter in
  float32, twice the params. Offloaded, the accelerator holds none of them between
  steps, while the forward and backward passes hold their activations. Two ways to
  run the update (both give `inner`'s values exactly):

  * ``compute="device"`` (MaxText's ``optimizer_memory_host_offload``): inside the
    jitted step the state is copied to the device, updated there and copied back;
    XLA schedules the copies. Per step the link carries the state twice (16 bytes a
    parameter for float32 moments); the device holds the state only during the
    update.
  * ``compute="host"`` (ZeRO-Offload with its CPU Adam): the update runs on the
    host's cores (``jax.experimental.compute_on``); the gradients and params go to
    the host and the updates come back: 12 bytes a parameter in float32, and the
    device never holds the state. The host's speed decides the step's: on a CPU
    this is the fused XLA step (``implementation="xla"``).

  Put ``optax.MultiSteps`` inside the offload (``offload(optax.MultiSteps(lamb, k))``,
  which offloads the gradient accumulator too): ``MultiSteps`` merges its inner state
  with ``jnp.where``, which leaves host-memory scalars in device memory.

  Restore a checkpoint into the shardings `init` gives (orbax: a target of
  ``jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)`` for each leaf of
  ``tx.init(params)``, whose shardings carry the ``pinned_host`` memory kind). Needs a backend with host memory (GPU, TPU, and the
  CPU, where host and device memory are the same memory: tests check placement
  and values there, speed needs an accelerator).

  Args:
    inner: the transformation whose state to offload (``optax_lamb.lamb``, a
      ``compat`` constructor, ``optax.adamw``, ...).
    compute: ``"device"`` or ``"host"``: where the update runs.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is `inner`'s, in
    host memory.

  Example:
    >>> import jax, jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.offload(optax_lamb.lamb(1e-3))
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = tx.init(params)
    >>> print(jax.tree.leaves(state)[1].sharding.memory_kind)
    pinned_host
  """
  _check_args.check_transformation("inner", inner)
  _check_args.check_choice("compute", compute, ("device", "host"))
  inner = optax.with_extra_args_support(inner)
  _interop.check_host_memory("optax_lamb.offload")

  def init_fn(params: Any) -> Any:
    return _to(_beside(inner.init(params), params), "host")

  def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
    if compute == "device":
      new_updates, new_state = inner.update(updates, _to(state, "device"), params, **extra)
      return new_updates, _to(new_state, "host")

    def on_host(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
      # In the host computation's own memory space, where its constants are made: operations
      # (jnp.where) refuse to mix spaces. The outputs go back to pinned host memory.
      grads, state, params = _to((grads, state, params), "device")
      return inner.update(grads, state, params, **extra)

    run = _interop.on_host(on_host)
    new_updates, new_state = run(_to(updates, "host"), state, _to(params, "host"))
    return _to(new_updates, "device"), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
