"""The step on GPU kernels, shared by every GPU backend; a backend brings its `KernelSet`.

The step, from the plan (`optax_lamb.step._plan`), for the tree's leaves:

1. pass 1 over the adapted leaves, in buckets (`tables.buckets`): m', v' in
   place where the moments are stored unrounded, and per-chunk partial sums;
2. the slice sums of the whole tree: ||p||^2 and ||u||^2 per leaf (or stacked
   slice); then in XLA the ratio vector (`_ratios.ratio_vector`: one ``psum``
   per mapped axis name, the formula, ratio 1 off adaptation);
3. pass 2 in buckets, or, for large leaves in ``tx.update``, its jnp twin
   (`passes.pass2_reference`), which XLA fuses with the caller's
   ``optax.apply_updates``.

What each pass computes is written once (`passes`); a kernel set is how it runs:
its launches (pass bodies, block configuration, compiler parameters) and the
leaves it declines. Under ``jax.jit`` over sharded arrays the step runs on each
device's shards (`optax_lamb.backends.per_device`). Leaves without layer
adaptation skip pass 1: pass 2 does them in one pass from g, m, v. Where the
moments are stored narrower than float32, pass 1 only reads and pass 2
recomputes them from g and the old moments, so the update uses the unrounded
moments, as the XLA path and optax do.

A backend is a frozen dataclass subclassing `GpuBackend` with a ``name``, an
``interpret`` field, and `GpuBackend.kernels`, the tuning hook: the kernel set
(and its block configuration) for a step's plan.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.backends import fields, per_device
from optax_lamb.backends.gpu import arrays, passes, tables
from optax_lamb.backends.gpu.tables import LaunchShape, Table
from optax_lamb.core import _options, _ratios
from optax_lamb.core._options import LambOptions, ScalarLayout
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.step._plan import LeafArrays, LeafPlan, StepPlan, StepResult

DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


class BlockConfig(LaunchShape, Protocol):
  """A kernel set's block configuration, as the driver reads it."""

  @property
  def xla_pass2_min_size(self) -> int: ...


class KernelSet(Protocol):
  """One GPU backend's kernels: the launches of the three passes over a bucket (`tables.Table`).

  Operands are flat: per leaf of the table a dict of named 1-D arrays (an 8-bit
  moment as a `QuantizedMoment` of two), `passes.PASS1_INPUTS` for pass 1 and
  `passes.input_names` for pass 2; `scalars` is `tables.scalar_operands`'s vector.
  """

  @property
  def sizes(self) -> BlockConfig: ...

  def leaf_reason(self, leaf: LeafPlan, x: LeafArrays) -> str | None:
    """Why the kernels cannot take this leaf as stored (8-bit moments, alignment), or None."""
    ...

  def moments_and_norms(
    self,
    scalars: jax.Array,
    leaves: list[dict],
    *,
    table: Table,
    options: LambOptions,
    scalar_layout: ScalarLayout,
  ) -> tuple[list[dict], jax.Array]:
    """Pass 1: (per leaf {m, v} where `passes.writes_moments`, else {}; partials [6, programs])."""
    ...

  def slice_sums(self, starts: list[int], counts: list[int], partials: jax.Array) -> tuple:
    """Per ratio slot, the sums of each row of `partials` over the slot's (start, count)."""
    ...

  def updates(
    self,
    scalars: jax.Array,
    ratios: jax.Array,
    leaves: list[dict],
    *,
    table: Table,
    options: LambOptions,
    scalar_layout: ScalarLayout,
    apply: bool,
  ) -> list[dict]:
    """Pass 2: per leaf {out, m, v} ({out} where pass 1 wrote the moments)."""
    ...


class GpuBackend(fields.Checked):
  """The `optax_lamb.step._registry.Backend` protocol on a kernel set; subclasses are frozen dataclasses
  with an ``interpret: bool | None`` field and a ``name``."""

  name: str
  differentiable = False  # a pallas_call with aliased buffers: the XLA step's derivatives
  interpret: bool | None

  def kernels(self, plan: StepPlan, *, interpret: bool) -> KernelSet:
    """The kernel set for this step, compiled or `interpret`ed (the tuning hook: its block sizes
    may follow the plan)."""
    raise NotImplementedError

  def device_reason(self) -> str | None:
    """Why this GPU cannot run the kernels compiled (say, too old an architecture), or None."""
    return None

  def runs_interpreted(self) -> bool:
    if self.interpret is not None:
      return self.interpret
    return jax.default_backend() != "gpu"

  def auto_reason(self) -> str | None:
    """Why `implementation="auto"` does not take the kernels here (None: it does)."""
    if jax.default_backend() != "gpu":
      return f"backend {jax.default_backend()!r}: the kernels are for GPUs"
    reason = self.device_reason()
    if reason is not None:
      return reason
    devices = jax.device_count()
    if devices == 1:
      return None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and set(getattr(mesh, "manual_axes", ())) == set(mesh.axis_names):
      return None  # inside shard_map/pmap: each device runs the kernels on its own shards
    return (
      f"{devices} devices outside shard_map: under jax.jit the kernels run on each device's "
      f"shards (implementation={self.name!r}), but their speed there is not measured on GPUs yet"
    )

  def unsupported_reason(self, plan: StepPlan, leaves: list[LeafArrays]) -> str | None:
    """Why the kernels cannot take these leaves (the step then runs on XLA), or None."""
    if plan.options.caution:
      return "caution needs each leaf's mean of [u g > 0] before u, a reduction the kernels lack"
    if plan.options.finite_guard:
      return (
        "ONNX Runtime's per-element rules for non-finite values (finite_guard) are not in the "
        "kernels"
      )
    kernels, quantized = self.kernels(plan, interpret=self.runs_interpreted()), False
    for leaf, x in zip(plan.leaves, leaves, strict=True):
      quantized |= isinstance(x.m, QuantizedMoment) or isinstance(x.v, QuantizedMoment)
      reason = kernels.leaf_reason(leaf, x)
      if reason is not None:
        return reason
      if leaf.size == 0:
        continue
      dtypes = {"param": x.p.dtype, "mu": arrays.dtype(x.m), "nu": arrays.dtype(x.v)}
      for name, dtype in dtypes.items():
        if jnp.dtype(dtype) not in DTYPES:
          return f"{name} dtype {jnp.dtype(dtype)} (the kernels take float32, bfloat16, float16)"
      if jnp.dtype(x.g.dtype) != jnp.float32:
        return f"gradient dtype {jnp.dtype(x.g.dtype)} (the kernels take float32 gradients)"
      if leaf.size > tables.INT32_LIMIT - kernels.sizes.block:
        return f"a leaf of shape {leaf.shape} has 2**31 or more elements (int32 offsets)"
    if quantized and per_device.mode(leaves)[0] != per_device.AS_IS:
      return (
        "8-bit quantized moments on a mesh outside shard_map (the per-device step does not "
        "shard codes and scales yet; inside shard_map the kernels take them)"
      )
    return per_device.unsupported_reason(plan, leaves)

  def step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult:
    """One lamb step on the kernels; the same contract as every backend's.

    Under ``jax.jit`` over sharded arrays the kernels run on each device's shards
    (`optax_lamb.backends.per_device`): a pallas_call is opaque to XLA's partitioner.
    """
    if per_device.mode(leaves)[0] == per_device.AS_IS:  # one device, or inside shard_map
      return self._step(plan, leaves, apply=apply)
    return per_device.step(self._step, plan, leaves, apply=apply)

  def _step(self, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool) -> StepResult:
    """The step on the arrays as given: one device's, or the local shards inside shard_map."""
    kernels = self.kernels(plan, interpret=self.runs_interpreted())
    scalars, scalar_layout = tables.scalar_operands(plan.scalars)
    static: dict[str, Any] = {"options": plan.options, "scalar_layout": scalar_layout}
    mu, nu = [x.m for x in leaves], [x.v for x in leaves]

    # Pass 1 over the adapted leaves; the moments it writes replace mu, nu.
    launches = tables.buckets([leaf for leaf in plan.leaves if leaf.adapt], kernels.sizes)
    parts = []  # per launch, its partial sums [6, program]
    for table in launches:
      flat = [passes.pass1_inputs(leaves[c.leaf.index], arrays.flat) for c in table]
      written, launch_parts = kernels.moments_and_norms(scalars, flat, table=table, **static)
      for c, moments in zip(table, written, strict=True):
        if moments:
          mu[c.leaf.index] = moments["m"].reshape(c.leaf.shape)
          nu[c.leaf.index] = moments["v"].reshape(c.leaf.shape)
      parts.append(launch_parts)
    ratios = _ratio_vector(kernels, plan, launches, parts)
    out = _pass2(kernels, plan, leaves, mu, nu, scalars, ratios, static, apply=apply)
    return StepResult(out, mu, nu, ratios)


def _pass2(
  kernels: KernelSet,
  plan: StepPlan,
  leaves: list[LeafArrays],
  mu: list,
  nu: list,
  scalars,
  ratios,
  static: dict[str, Any],
  *,
  apply: bool,
) -> list:
  """The updates (or new params) of every leaf; `mu`, `nu` get the moments pass 2 writes.

  From the new moments, or from g and the old ones (`passes.from_grads`); in
  ``tx.update``, large leaves take pass 2's jnp twin (XLA fuses it with the
  caller's ``optax.apply_updates``), the others the kernel, a bucket a launch.
  """

  def inputs(leaf: LeafPlan, reshape=lambda a: a) -> dict:
    x = leaves[leaf.index]
    named = {"g": x.g, "m": x.m, "v": x.v, "p": x.p}
    if not passes.from_grads(leaf):
      named.update(m=mu[leaf.index], v=nu[leaf.index])
    return {name: reshape(named[name]) for name in passes.input_names(leaf)}

  out = [
    x.p if apply else jnp.zeros(leaf.shape, x.p.dtype)
    for leaf, x in zip(plan.leaves, leaves, strict=True)
  ]

  def take(leaf: LeafPlan, result: dict) -> None:
    i, shaped = leaf.index, lambda a: arrays.reshape(a, leaf.shape)
    out[i] = result["out"].reshape(leaf.shape)
    if "m" in result:
      mu[i], nu[i] = shaped(result["m"]), shaped(result["v"])

  in_xla = lambda leaf: not apply and leaf.size >= kernels.sizes.xla_pass2_min_size
  o, s = plan.options, plan.scalars
  for leaf in plan.leaves:
    if leaf.size and in_xla(leaf):
      take(leaf, passes.pass2_reference(o, s, leaf, inputs(leaf), ratios, apply=False))
  for table in tables.buckets([x for x in plan.leaves if not in_xla(x)], kernels.sizes):
    flat = [inputs(c.leaf, arrays.flat) for c in table]
    results = kernels.updates(scalars, ratios, flat, table=table, apply=apply, **static)
    for c, result in zip(table, results, strict=True):
      take(c.leaf, result)
  return out


def _ratio_vector(kernels: KernelSet, plan: StepPlan, launches: list[Table], parts) -> jax.Array:
  """The ratio vector: the adapted slots' trust ratios from their partial sums, 1 elsewhere.

  Pass 1 sums the squares at every `_ratios.SCALES` in the same pass (a rescaling
  branch here crashed XLA:CPU's compiler on an interpreted-kernel test, jax 0.10.2).
  """
  slots = plan.layout.size
  if not launches:
    return jnp.ones((slots,), jnp.float32)
  starts, counts = tables.slot_ranges(launches, slots)
  sums = kernels.slice_sums(starts, counts, jnp.concatenate(parts, axis=1))
  names = plan.slot_names
  p_plain, p_down, p_up, u_plain, u_down, u_up = (_psum_slots(x, names) for x in sums)
  chosen = (
    _ratios.chosen_scaled(p_plain, p_down, p_up),
    _ratios.chosen_scaled(u_plain, u_down, u_up),
  )
  by_slot = _ratios.SlotSums(p_plain, u_plain, chosen)
  return _ratios.ratio_vector(by_slot, plan.scalars, plan.adapted_slots)


def _psum_slots(x: jax.Array, slot_names: list) -> jax.Array:
  """`_options.psum_by_name` over the entries of one vector, each entry with its own axis names."""
  names = list(dict.fromkeys(slot_names))
  if len(names) <= 1:
    return _options.psum_if(x, names[0] if names else None)
  groups = [np.array([i for i, n in enumerate(slot_names) if n == name]) for name in names]
  summed = _options.psum_by_name([x[g] for g in groups], names)
  return jnp.concatenate(summed)[np.argsort(np.concatenate(groups))]
