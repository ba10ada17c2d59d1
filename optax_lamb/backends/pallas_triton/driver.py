"""The Pallas Triton backend: one lamb step on the kernels, and where they run.

The step, from the plan (`optax_lamb.step._plan`), for the tree's leaves:

1. `pass1` over the adapted leaves, in buckets: m', v' in place where the
   moments are stored unrounded, and per-chunk partial sums;
2. one `slice_sums` launch for the whole tree: ||p||^2 and ||u||^2 per leaf
   (or stacked slice); then in XLA the ratio vector (`_ratios.ratio_vector`:
   one ``psum`` per mapped axis name, the formula, ratio 1 off adaptation);
3. `pass2` in buckets, or, for large leaves in ``tx.update``, its jnp twin,
   which XLA fuses with the caller's ``optax.apply_updates``.

Under ``jax.jit`` over sharded arrays this runs on each device's shards
(`optax_lamb.backends.per_device`). Leaves without layer adaptation skip pass 1: pass 2 does them in one pass from
g, m, v. Where the moments are stored narrower than float32, pass 1 only reads
and pass 2 recomputes them from g and the old moments, so the update uses the
unrounded moments, as the XLA path and optax do.

8-bit block-wise quantized moments (``mu_dtype=jnp.int8, nu_dtype=jnp.uint8``)
are such moments: both passes read the codes and the scales of a chunk's blocks
and dequantize them in registers; pass 2 requantizes the new moments with
`optax_lamb.core._quantize`'s functions and writes codes, scales and the update (or
p) in the same pass (`operands`). The kernels take them where every
quantization block lies whole in one chunk: a leaf whose last axis is a multiple
of 256 and not stacked, with ``BlockSizes.block`` a multiple of 256. A step with
another quantized leaf (a partial last block, such as a last axis of 300), or
with 8-bit moments on a mesh outside ``shard_map``, is declined
(`unsupported_reason` names the leaf's shape) and runs on the XLA path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.backends import fields, per_device
from optax_lamb.backends.pallas_triton import common, operands, pass1, pass2, slice_sums
from optax_lamb.backends.pallas_triton.common import BlockSizes
from optax_lamb.core import _options, _ratios
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.step._plan import LeafArrays, LeafPlan, StepPlan, StepResult

_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


@dataclasses.dataclass(frozen=True)
class PallasTritonBackend(fields.Checked):
  """The Pallas Triton kernels, with their launch configuration.

  Attributes:
    block_sizes: the launch sizes (`BlockSizes`).
    interpret: run the kernels in Pallas interpret mode; None: exactly when
      the default backend is not a GPU.

  Example:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend
    >>> backend = PallasTritonBackend(block_sizes=BlockSizes(block=1024))
    >>> tx = optax_lamb.lamb(1e-3, implementation=backend)
    >>> params = {"w": jnp.ones((3, 3))}
    >>> state = tx.init(params)
    >>> with warnings.catch_warnings():  # without a GPU: interpret mode, with a warning
    ...   warnings.simplefilter("ignore")
    ...   updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> print([round(x, 4) for x in optax.apply_updates(params, updates)["w"][0].tolist()])
    [0.999, 0.999, 0.999]
  """

  name = "pallas_triton"
  differentiable = False  # a pallas_call with aliased buffers: the XLA step's derivatives
  block_sizes: BlockSizes = BlockSizes()
  interpret: bool | None = None

  def runs_interpreted(self) -> bool:
    if self.interpret is not None:
      return self.interpret
    return jax.default_backend() != "gpu"

  def auto_reason(self) -> str | None:
    """Why `implementation="auto"` does not take the kernels here (None: it does)."""
    if jax.default_backend() != "gpu":
      return f"backend {jax.default_backend()!r}: the kernels are for GPUs"
    devices = jax.device_count()
    if devices == 1:
      return None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and set(getattr(mesh, "manual_axes", ())) == set(mesh.axis_names):
      return None  # inside shard_map/pmap: each device runs the kernels on its own shards
    return (
      f"{devices} devices outside shard_map: under jax.jit the kernels run on each device's "
      "shards (implementation='pallas'), but their speed there is not measured on GPUs yet"
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
    quantized = False
    for leaf, x in zip(plan.leaves, leaves, strict=True):
      if isinstance(x.m, QuantizedMoment) or isinstance(x.v, QuantizedMoment):
        quantized = True
        reason = operands.unsupported_reason(leaf, self.block_sizes.block)
        if reason is not None:
          return reason
      if leaf.size == 0:
        continue
      dtypes = {"param": x.p.dtype, "mu": _dtype(x.m), "nu": _dtype(x.v)}
      for name, dtype in dtypes.items():
        if jnp.dtype(dtype) not in _DTYPES:
          return f"{name} dtype {jnp.dtype(dtype)} (the kernels take float32, bfloat16, float16)"
      if jnp.dtype(x.g.dtype) != jnp.float32:
        return f"gradient dtype {jnp.dtype(x.g.dtype)} (the kernels take float32 gradients)"
      if leaf.size > common.INT32_LIMIT - self.block_sizes.block:
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
    launch = dict(block_sizes=self.block_sizes, interpret=self.runs_interpreted())
    scalars, scalar_layout = common.scalar_operands(plan.scalars)
    static = dict(options=plan.options, scalar_layout=scalar_layout, **launch)
    mu, nu = [x.m for x in leaves], [x.v for x in leaves]

    # Pass 1 over the adapted leaves; the moments it writes replace mu, nu.
    tables = common.buckets([leaf for leaf in plan.leaves if leaf.adapt], self.block_sizes)
    parts = []  # per launch, its partial sums [6, program]
    for table in tables:
      flat = [flat_arrays(leaves[c.leaf.index], operands.flat) for c in table]
      written, launch_parts = pass1.moments_and_norms(scalars, flat, table=table, **static)
      for c, moments in zip(table, written, strict=True):
        if moments:
          mu[c.leaf.index] = moments["m"].reshape(c.leaf.shape)
          nu[c.leaf.index] = moments["v"].reshape(c.leaf.shape)
      parts.append(launch_parts)
    ratios = self._ratio_vector(plan, tables, parts, launch)
    out = self._pass2(plan, leaves, mu, nu, scalars, ratios, static, apply=apply)
    return StepResult(out, mu, nu, ratios)

  def _pass2(
    self,
    plan: StepPlan,
    leaves: list[LeafArrays],
    mu: list,
    nu: list,
    scalars,
    ratios,
    static: dict,
    *,
    apply: bool,
  ) -> list:
    """The updates (or new params) of every leaf; `mu`, `nu` get the moments pass 2 writes.

    From the new moments, or from g and the old ones (`pass2.from_grads`); in
    ``tx.update``, large leaves take pass 2's jnp twin (XLA fuses it with the
    caller's ``optax.apply_updates``), the others the kernel, a bucket a launch.
    """

    def inputs(leaf: LeafPlan, reshape=lambda a: a) -> dict:
      x = leaves[leaf.index]
      arrays = {"g": x.g, "m": x.m, "v": x.v, "p": x.p}
      if not pass2.from_grads(leaf):
        arrays.update(m=mu[leaf.index], v=nu[leaf.index])
      return {name: reshape(arrays[name]) for name in pass2.input_names(leaf)}

    out = [
      x.p if apply else jnp.zeros(leaf.shape, x.p.dtype)
      for leaf, x in zip(plan.leaves, leaves, strict=True)
    ]

    def take(leaf: LeafPlan, result: dict) -> None:
      i, shaped = leaf.index, lambda a: operands.reshape(a, leaf.shape)
      out[i] = result["out"].reshape(leaf.shape)
      if "m" in result:
        mu[i], nu[i] = shaped(result["m"]), shaped(result["v"])

    in_xla = lambda leaf: not apply and leaf.size >= self.block_sizes.xla_pass2_min_size
    for leaf in plan.leaves:
      if leaf.size and in_xla(leaf):
        o, s = plan.options, plan.scalars
        take(leaf, pass2.reference(o, s, leaf, inputs(leaf), ratios, apply=False))
    for table in common.buckets([x for x in plan.leaves if not in_xla(x)], self.block_sizes):
      flat = [inputs(c.leaf, operands.flat) for c in table]
      results = pass2.updates(scalars, ratios, flat, table=table, apply=apply, **static)
      for c, result in zip(table, results, strict=True):
        take(c.leaf, result)
    return out

  def _ratio_vector(self, plan: StepPlan, tables, parts, launch) -> jax.Array:
    """The ratio vector: the adapted slots' trust ratios from their partial sums, 1 elsewhere.

    Pass 1 sums the squares at every `_ratios.SCALES` in the same pass (a rescaling
    branch here crashed XLA:CPU's compiler on an interpreted-kernel test, jax 0.10.2).
    """
    slots = plan.layout.size
    if not tables:
      return jnp.ones((slots,), jnp.float32)
    starts, counts = slice_sums.slot_ranges(tables, slots)
    sums = slice_sums.slice_sums(
      *slice_sums.slot_operands(starts, counts),
      jnp.concatenate(parts, axis=1),
      **launch,
    )
    names = plan.slot_names
    p_plain, p_down, p_up, u_plain, u_down, u_up = (_psum_slots(x, names) for x in sums)
    chosen = (
      _ratios.chosen_scaled(p_plain, p_down, p_up),
      _ratios.chosen_scaled(u_plain, u_down, u_up),
    )
    by_slot = _ratios.SlotSums(p_plain, u_plain, chosen)
    return _ratios.ratio_vector(by_slot, plan.scalars, plan.adapted_slots)


def _psum_slots(x: jax.Array, slot_names: list) -> jax.Array:
  """`_ratios.psum_by_name` over the entries of one vector, each entry with its own axis names."""
  names = list(dict.fromkeys(slot_names))
  if len(names) <= 1:
    return _options.psum_if(x, names[0] if names else None)
  groups = [np.array([i for i, n in enumerate(slot_names) if n == name]) for name in names]
  summed = _ratios.psum_by_name([x[g] for g in groups], names)
  return jnp.concatenate(summed)[np.argsort(np.concatenate(groups))]


def _dtype(x) -> jnp.dtype:
  """An operand's dtype; for a quantized moment its scales' (float32; `operands` reads its codes)."""
  return jnp.dtype((x.scales if isinstance(x, QuantizedMoment) else x).dtype)


def flat_arrays(x: LeafArrays, flat) -> dict:
  """Pass 1's named inputs of one leaf, flattened."""
  return {"g": flat(x.g), "m": flat(x.m), "p": flat(x.p), "v": flat(x.v)}
