"""A backend's step on each device's own shards under ``jax.jit``, for ops XLA cannot partition.

A ``pallas_call`` is opaque to XLA's partitioner: under ``jax.jit`` over
sharded arrays it would gather every sharded leaf onto each device and give
back unsharded moments. `step` runs such a backend's step (its `local_step`)
per device instead:

* inside ``shard_map``/``pmap`` (every mesh axis manual), with no mesh in
  sight (one device) or on a one-device Auto mesh: as it is, on the arrays
  it is given;
* on a mesh of ``AxisType.Explicit`` axes the shardings are in the arrays'
  types at trace time: a ``jax.shard_map`` built from them wraps the step;
* on a mesh of ``AxisType.Auto`` axes the shardings are the compiler's to
  choose after tracing: ``jax.experimental.custom_partitioning`` lets its
  partitioner call back with the shardings it chose, and the same per-device
  step is built from them then.

Per device, each leaf is computed on the shard its param has (its gradient
and moments are resharded to it where theirs differ): a replicated leaf
whole, a sharded one on its shard. Each leaf's squared norms are ``psum``'d
over exactly the mesh axes that shard its non-stacked axes (the leaf's
`LeafPlan.axis_name` in the per-device plan); where a leaf's stacked axes are
sharded, each device holds whole layers, and their trust ratios (a few floats
per device) are ``all_gather``'d into the replicated ratio vector. So the
compiled step moves no param-sized array between devices, and the moments
and updates keep the params' shardings. The global clipping norm is computed
before the step, in XLA, which reduces it per device and all-reduces a scalar.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_lamb import _interop
from optax_lamb.core._options import RatioLayout, ScalarLayout, StepScalars
from optax_lamb.step._plan import LeafArrays, StepPlan, StepResult

LocalStep = Callable[..., StepResult]  # (plan, leaves, *, apply) -> result

AS_IS, EXPLICIT, AUTO = "as is", "explicit", "auto"


def _mesh(leaves: list[LeafArrays]) -> Any:
  """The mesh the step runs over: the context's (``jax.set_mesh``), else the params' types'."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    for x in leaves:
      mesh = getattr(jax.typeof(x.p).sharding, "mesh", mesh)
      if not mesh.empty:
        break
  return mesh


def _transformed(x) -> bool:
  """Whether `x` is traced by a transformation other than jit (vmap, jvp, ...)."""
  return isinstance(x, jax.core.Tracer) and not _interop.is_jit_tracer(x)


def mode(leaves: list[LeafArrays]) -> tuple[str, str | None]:
  """(how the step runs: AS_IS, EXPLICIT or AUTO; why it cannot run per device, or None)."""
  mesh = _mesh(leaves)
  types = set(mesh.axis_types)
  if mesh.empty or types == {AxisType.Manual}:
    return AS_IS, None  # no mesh, or inside shard_map/pmap: the arrays are the local shards
  if types == {AxisType.Explicit}:
    return EXPLICIT, None  # on a one-device mesh too: the same code path as on several
  if math.prod(mesh.axis_sizes) == 1:
    return AS_IS, None
  if types == {AxisType.Auto}:
    if any(_transformed(a) for x in leaves for a in x):
      return AS_IS, (
        "vmap or differentiation of the step on a mesh of Auto axes (the kernels run per device "
        "there through custom_partitioning, which has no batching or differentiation rule)"
      )
    return AUTO, None
  kinds = ", ".join(f"{n}: {t.name}" for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True))
  return AS_IS, (
    f"a mesh with mixed axis types ({kinds}): the kernels run per device on all-Explicit, "
    "all-Auto or all-Manual (shard_map) meshes"
  )


def unsupported_reason(plan: StepPlan, leaves: list[LeafArrays]) -> str | None:
  """Why the step cannot run per device here (then it runs on XLA), or None."""
  del plan
  return mode(leaves)[1]


def step(
  local_step: LocalStep, plan: StepPlan, leaves: list[LeafArrays], *, apply: bool
) -> StepResult:
  """`local_step(plan, leaves, apply=...)`, on each device's shards where the leaves are sharded."""
  how, reason = mode(leaves)
  if reason is not None:  # `unsupported_reason` sends such steps to XLA
    raise ValueError(reason)
  if how == AS_IS:
    return local_step(plan, leaves, apply=apply)
  scalar_layout, arrays = ScalarLayout.of(plan.scalars)  # runtime scalars passed replicated
  if how == EXPLICIT:
    mesh = _mesh(leaves)
    specs = [
      _padded(jax.typeof(x.p).sharding.spec, len(leaf.shape))
      for leaf, x in zip(plan.leaves, leaves, strict=True)
    ]
    leaves = [
      _reshard_like_param(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)
    ]
    per_device = _per_device(local_step, plan, scalar_layout, specs, mesh.shape, apply)
    return jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(P(), [LeafArrays[P](s, s, s, s) for s in specs]),
      out_specs=_result_specs(specs),
      check_vma=False,  # a bucket mixes leaves of several shardings; the ratios are made replicated
    )(arrays, leaves)
  return _auto(local_step, plan, scalar_layout, len(arrays), apply)(arrays, leaves)


# ----------------------------------------------------------------------------- per device


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one entry of a PartitionSpec (None, a name or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _padded(spec, ndim: int) -> P:
  entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return P(*entries[:ndim])


def _reshard_like_param(x: LeafArrays, sharding: NamedSharding) -> LeafArrays:
  """The leaf's arrays on the param's sharding (a no-op where they already have it)."""

  def like(a) -> jax.Array:
    if _padded(jax.typeof(a).sharding.spec, a.ndim) == sharding.spec:
      return a
    return jax.sharding.reshard(a, sharding)

  return LeafArrays(like(x.g), like(x.m), like(x.v), x.p)


def _local_plan(plan: StepPlan, specs: list[P], mesh_shape) -> tuple[StepPlan, list]:
  """The plan of one device's shards, and per leaf the mesh axes of each stacked axis.

  The per-device plan has the local shapes, the mesh axes that shard each leaf's
  non-stacked axes as its `axis_name` (its norms are psum'd over them), and the
  local ratio layout. It holds no state (`count`, `parts`): a backend's step reads
  the plan's hyper-parameters, leaves and layout only.
  """
  leaves, stacked_axes = [], []
  for leaf, spec in zip(plan.leaves, specs, strict=True):
    k = leaf.stacked_axes
    shape = tuple(
      n // math.prod(mesh_shape[a] for a in _axes(e)) for n, e in zip(leaf.shape, spec, strict=True)
    )
    norm_axes = tuple(a for e in tuple(spec)[k:] for a in _axes(e))
    stacked_axes.append(tuple(_axes(e) for e in tuple(spec)[:k]))
    leaves.append(leaf._replace(shape=shape, axis_name=norm_axes or None))
  layout = RatioLayout(plan.treedef, tuple(leaf.shape[: leaf.stacked_axes] for leaf in leaves))
  leaves = [leaf._replace(ratio_offset=layout.offsets[leaf.index]) for leaf in leaves]
  # No tracer of the caller's: the scalars come in as operands, the state is not needed.
  local = plan._replace(
    leaves=tuple(leaves), layout=layout, scalars=StepScalars(), count=None, parts=None
  )
  return local, stacked_axes


def _per_device(
  local_step: LocalStep, plan: StepPlan, scalar_layout: ScalarLayout, specs, mesh_shape, apply: bool
) -> Callable[..., StepResult]:
  """The function of one device's shards: the local step, then the whole replicated ratio vector."""
  local, stacked_axes = _local_plan(plan, specs, mesh_shape)

  def per_device(arrays, leaves) -> StepResult:
    result = local_step(local._replace(scalars=scalar_layout.join(arrays)), leaves, apply=apply)
    pieces = local.layout.pieces(result.ratios)
    for i, per_axis in enumerate(stacked_axes):
      for d, axes in enumerate(per_axis):
        if axes:  # this device holds whole layers: gather the other devices' layers' ratios
          pieces[i] = jax.lax.all_gather(pieces[i], axes, axis=d, tiled=True)
    return result._replace(ratios=plan.layout.join(pieces))

  return per_device


def _result_specs(specs: list[P]) -> StepResult:
  return StepResult(out=list(specs), mu=list(specs), nu=list(specs), ratios=P())


# ----------------------------------------------------------------------------- Auto mesh


def _auto(
  local_step: LocalStep, plan: StepPlan, scalar_layout: ScalarLayout, scalars: int, apply: bool
) -> Callable[..., StepResult]:
  """The step as a custom_partitioning op: its partitioner builds the per-device step."""
  stateless = plan._replace(scalars=StepScalars(), count=None, parts=None)

  def whole(
    arrays, leaves
  ) -> StepResult:  # the step on one device, or where no partitioning happens
    return local_step(stateless._replace(scalars=scalar_layout.join(arrays)), leaves, apply=apply)

  def shardings(mesh, arg_shapes) -> tuple:
    """(each leaf's spec: its param's; the operands' and the results' shardings)."""
    arrays_shapes, leaf_shapes = arg_shapes
    specs = [_even_spec(x.p, mesh) for x in leaf_shapes]
    named = lambda spec: NamedSharding(mesh, spec)
    operands = (
      {name: named(P()) for name in arrays_shapes},
      [LeafArrays(*(named(s),) * 4) for s in specs],
    )
    results = jax.tree.map(named, _result_specs(specs), is_leaf=lambda s: isinstance(s, P))
    return specs, operands, results

  def partition(mesh, arg_shapes, result_shape) -> tuple:
    del result_shape
    specs, operands, results = shardings(mesh, arg_shapes)
    per_device = _per_device(local_step, plan, scalar_layout, specs, mesh.shape, apply)
    return mesh, per_device, results, operands

  def infer_sharding_from_operands(
    mesh, arg_shapes, result_shape
  ) -> Any:  # GSPMD (Shardy: the rule)
    del result_shape
    return shardings(mesh, arg_shapes)[2]

  # Under jit, the step's constants (chunk tables) stay inside; custom_partitioning takes none.
  op = custom_partitioning(jax.jit(whole))
  op.def_partition(
    partition=partition,
    infer_sharding_from_operands=infer_sharding_from_operands,
    sharding_rule=_sharding_rule(plan, scalars),
  )
  return op


def _even_spec(shape, mesh) -> P:
  """The param's sharding as a PartitionSpec, without the mesh axes that would split unevenly."""
  sharding = shape.sharding
  ndim = len(shape.shape)
  if not isinstance(sharding, NamedSharding):  # no mesh to name the axes: compute on whole leaves
    return P(*(None,) * ndim)
  spec = _padded(sharding.spec, ndim)
  return P(
    *(
      e if n % math.prod(mesh.shape[a] for a in _axes(e)) == 0 else None
      for n, e in zip(shape.shape, spec, strict=True)
    )
  )


def _sharding_rule(plan: StepPlan, scalars: int) -> SdyShardingRule:
  """Each leaf's g, m, v, p and its out, m', v' share one factor per axis; the rest replicated."""
  factors: list[Any] = [
    tuple(f"l{leaf.index}d{d}" for d in range(len(leaf.shape))) for leaf in plan.leaves
  ]
  operands: list[Any] = [()] * scalars + [f for f in factors for _ in LeafArrays._fields]
  results: list[Any] = [*factors, *factors, *factors, ("ratio",)]
  return SdyShardingRule(tuple(operands), tuple(results), need_replication_factors=("ratio",))
