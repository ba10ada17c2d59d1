"""The Pallas Mosaic GPU backend: its kernel set on the shared GPU driver (`optax_lamb.backends.gpu`).

JAX 0.11 deprecates Pallas on Triton in favour of Mosaic GPU, which targets
Hopper and newer (compute capability 9.0: H100, H200). Each pass is one
``pallas_call`` per leaf with Mosaic GPU's compiler parameters: a grid of
(slices, chunks), each operand a ``BlockSpec`` window of ``block`` elements
that Mosaic GPU copies between global and shared memory with TMA, pipelined
``max_concurrent_steps`` deep. A TMA copy moves at most 256 elements along a
dimension, so operands are (slices, rows, 256): a slice whose length L is not
a multiple of 256 is zero-padded to whole rows (a copy of that leaf). TMA
zero-fills what a window reads past an array's end and drops what it writes
there, so there are no masked loads; the kernels mask the partial sums with an
iota of the element's position.

What a chunk computes is the driver's (`passes`); the slice sums are XLA's static-slice sums (a
fixed order, no atomics; a few floats a chunk). Declined (the step runs on XLA, saying why): 8-bit
moments (the Triton kernels take them), and what the driver declines for every GPU backend.

Without a GPU the kernels run in Pallas interpret mode (``interpret=True``); Mosaic GPU's own
interpreter (``InterpretGPUParams``, jax 0.10.2) takes only whole-array windows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from optax_lamb.backends.gpu import arrays, passes, tables
from optax_lamb.backends.gpu.driver import GpuBackend
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.step._plan import LeafArrays, LeafPlan, StepPlan

LANES = 128  # a warpgroup's threads: whole-array copies move a multiple of 128 bytes
TILE = 256  # elements along a TMA copy's dimension at most: operands are (slices, rows, TILE)
PARTS = 6  # pass 1's partial sums per chunk: ||p||^2, ||u||^2 at each `_ratios.SCALES`


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
  """Launch configuration of the Mosaic GPU kernels.

  Attributes:
    block: elements per program (one chunk), a power of two from 256 to 65,536.
    max_concurrent_steps: chunks whose copies are in flight at once (Mosaic GPU's pipelining).
    xla_pass2_min_size: in ``tx.update``, leaves of at least this many elements take pass 2 as
      an XLA elementwise computation that XLA fuses with the caller's ``optax.apply_updates``.

  Example:
    >>> from optax_lamb.backends.pallas_mosaic_gpu import MosaicBlockSizes
    >>> sizes = MosaicBlockSizes(block=8192, max_concurrent_steps=3)
    >>> print(sizes.block, sizes.max_concurrent_steps, sizes.max_leaves_per_call)
    8192 3 1
  """

  block: int = 4096
  max_concurrent_steps: int = 2
  xla_pass2_min_size: int = 1 << 16
  max_leaves_per_call: int = dataclasses.field(default=1, init=False)  # a launch per leaf

  def __post_init__(self) -> None:
    b = self.block
    if not (isinstance(b, int) and TILE <= b <= TILE * TILE and b & (b - 1) == 0):
      raise ValueError(f"block={b!r} must be a power of two in [{TILE}, {TILE * TILE}]")
    for name, low in (("max_concurrent_steps", 1), ("xla_pass2_min_size", 0)):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= low):
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


def _padded(x: jax.Array, rows: bool = False) -> jax.Array:
  """A small vector for SMEM: padded to 128 bytes, or to `rows` of `LANES` (256 a copy at most)."""
  size = LANES if rows else LANES // 4
  x = jnp.pad(x, (0, -x.shape[0] % size))
  return x.reshape(-1, LANES) if rows else x


def _tiles(x: jax.Array, leaf: LeafPlan) -> jax.Array:
  """A flat operand as the kernels take it: (slices, rows, `TILE`), each slice zero-padded to
  whole rows (a copy, only where its length is not a multiple of `TILE`)."""
  rows = x.reshape(leaf.slices, leaf.length)
  rows = jnp.pad(rows, ((0, 0), (0, -leaf.length % TILE)))
  return rows.reshape(leaf.slices, -1, TILE)


def _untiled(x: jax.Array, leaf: LeafPlan) -> jax.Array:
  return x.reshape(leaf.slices, -1)[:, : leaf.length].reshape(-1)


def _window(block: int) -> pl.BlockSpec:
  """Program (s, k)'s chunk: rows [k R, (k + 1) R) of slice s, R = block / `TILE`."""
  return pl.BlockSpec((pl.squeezed, block // TILE, TILE), lambda s, k: (s, k, 0))


def _strided(x: jax.Array, interpret: bool) -> jax.Array:
  """`x` in one register layout for every operand and the iota (Mosaic GPU infers none for an
  iota and would not mix a bfloat16 load's with a float32 one's); interpret mode has no layouts."""
  if interpret:
    return x
  vec_size = 2 if x.size % (2 * LANES) == 0 else 1  # two float32 a thread, where they divide
  return plgpu.layout_cast(x, plgpu.Layout.WG_STRIDED(x.shape, vec_size=vec_size))


def _in_leaf(chunk: jax.Array, leaf: LeafPlan, block: int, interpret: bool) -> jax.Array:
  """The elements of `chunk` (of its slice) that lie in the slice (its last rows may be padding
  or past the end)."""
  iota = lambda axis: _strided(
    jax.lax.broadcasted_iota(jnp.int32, (block // TILE, TILE), axis), interpret
  )
  return chunk * block + iota(0) * TILE + iota(1) < leaf.length


def _load(ref, interpret: bool) -> jax.Array:
  return _strided(ref[...], interpret)


def _pass1_kernel(scalars_ref, *refs, ids, leaf, block, options, scalar_layout, interpret) -> None:
  """m', v' (where pass 1 writes them) and the chunk's six partial sums in lanes 0-5."""
  ins = dict(zip(passes.PASS1_INPUTS, refs, strict=False))
  outs = refs[len(passes.PASS1_INPUTS) :]
  s = tables.load_scalars(scalars_ref, scalar_layout)
  x = {name: _load(ref, interpret) for name, ref in ins.items()}
  stores, sums = passes.pass1_chunk(options, s, leaf, x, _in_leaf(ids[1], leaf, block, interpret))
  for ref, name in zip(outs[:-1], stores, strict=True):  # the moments where pass 1 writes them
    ref[...] = stores[name].astype(ref.dtype)
  lane = _strided(jax.lax.broadcasted_iota(jnp.int32, (LANES,), 0), interpret)
  parts = jnp.zeros((LANES,), jnp.float32)
  for i, value in enumerate(sums):
    parts = jnp.where(lane == i, value, parts)
  outs[-1][...] = parts


def _pass2_kernel(
  scalars_ref, ratios_ref, *refs, ids, leaf, options, scalar_layout, apply, interpret, block
) -> None:
  """The chunk's update (or new params), and its new moments where computed from g."""
  del block  # the windows' size
  names = passes.input_names(leaf)
  ins, outs = dict(zip(names, refs, strict=False)), refs[len(names) :]
  s = tables.load_scalars(scalars_ref, scalar_layout)
  slice_ = ids[0]  # its ratio: of this leaf's, `LANES` a row
  ratio = ratios_ref[jax.lax.div(slice_, LANES), jax.lax.rem(slice_, LANES)] if leaf.adapt else None
  x = {name: _load(ref, interpret) for name, ref in ins.items()}
  result = passes.leaf_step(options, s, leaf, x, ratio, apply=apply, kernel=True)
  for ref, name in zip(outs, passes.outputs_like(leaf), strict=True):
    ref[...] = result[name].astype(ref.dtype)


def _call(
  kernel,
  whole: tuple,
  rows: list,
  outputs: list,
  out_specs: list,
  aliases: dict,
  *,
  name: str,
  leaf: LeafPlan,
  sizes: MosaicBlockSizes,
  interpret: bool,
  **static,
) -> list:
  """One ``pallas_call`` of `kernel` over a leaf's chunks: `whole` operands (small vectors, in
  SMEM), then the leaf's `rows` in windows; `static` and the launch's own go to the kernel."""
  smem = pl.BlockSpec(memory_space=plgpu.SMEM)
  static.update(leaf=leaf, block=sizes.block, interpret=interpret)
  return pl.pallas_call(
    functools.partial(_program, functools.partial(kernel, **static), interpret=interpret),
    grid=(leaf.slices, -(-leaf.length // sizes.block)),
    in_specs=[smem] * len(whole) + [_window(sizes.block)] * len(rows),
    out_specs=out_specs,
    out_shape=outputs,
    input_output_aliases=aliases,
    compiler_params=plgpu.CompilerParams(max_concurrent_steps=sizes.max_concurrent_steps),
    interpret=interpret,
    name=name,
  )(*whole, *rows)


def _program(body, *refs, interpret: bool) -> None:
  """`body` on the refs with this program's ids (slice, chunk).

  Interpreted, the body runs under a ``pl.when`` that always holds. Pallas traces a kernel
  without shard_map's varying manual axes, and its interpreter evaluates the kernel's jaxpr one
  primitive at a time on the shards' values: inside ``jax.shard_map`` (check_vma) the first
  primitive that mixes a shard's value with a replicated one (a block times a step scalar) is
  refused (jax 0.10.2: "mul requires varying manual axes to match"). Under a ``cond`` the
  interpreter binds one primitive, whose rule takes the body's jaxpr as traced. The program ids
  are read outside it, as Pallas's interpreter needs. Compiled, the body runs as it is.
  """
  ids = (pl.program_id(0), pl.program_id(1))
  if interpret:
    pl.when(ids[1] >= 0)(lambda: body(*refs, ids=ids))
  else:
    body(*refs, ids=ids)


_STATIC = ("leaf", "options", "scalar_layout", "sizes", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def moments_and_norms(scalars, x: dict, **static) -> tuple[dict, jax.Array]:
  """Pass 1 over one leaf (`x`: flat {g, m, p, v}): ({m, v} or {}, partials [6, programs])."""
  leaf, block = static["leaf"], static["sizes"].block
  rows = [_tiles(x[name], leaf) for name in passes.PASS1_INPUTS]
  writes, chunks = passes.writes_moments(leaf), -(-leaf.length // block)
  moments = [arrays.out_like(rows[i]) for i in (1, 3)] if writes else []
  parts = arrays.out_struct((leaf.slices * chunks, LANES), jnp.float32, rows[2])
  part_spec = pl.BlockSpec((pl.squeezed, LANES), lambda s, k: (s * chunks + k, 0))
  specs = [_window(block)] * len(moments) + [part_spec]
  aliases = {2: 0, 4: 1} if writes else {}  # m', v' over m, v (after the scalars and g)
  name = "lamb_mosaic_moments_and_norms"
  *written, partials = _call(
    _pass1_kernel, (_padded(scalars),), rows, [*moments, parts], specs, aliases, name=name, **static
  )
  named = {n: _untiled(a, leaf) for n, a in zip("mv", written, strict=False)}
  return named, partials[:, :PARTS].T


@functools.partial(jax.jit, static_argnames=(*_STATIC, "apply"))
def updates(scalars, ratios, x: dict, **static) -> dict:
  """Pass 2 over one leaf (`x`: flat `passes.input_names`; `ratios`: its slices' trust ratios):
  {out} or {out, m, v}."""
  leaf, apply = static["leaf"], static["apply"]
  names, like = passes.input_names(leaf), passes.outputs_like(leaf)
  rows = [_tiles(x[name], leaf) for name in names]
  outputs = [arrays.out_like(rows[names.index(like[name])]) for name in like]
  aliases = {2 + names.index(like[n]): i for i, n in enumerate(like) if n != "out" or apply}
  specs = [_window(static["sizes"].block)] * len(outputs)
  name = "lamb_mosaic_apply" if apply else "lamb_mosaic_updates"
  whole = (_padded(scalars), _padded(ratios, rows=True))
  results = _call(_pass2_kernel, whole, rows, outputs, specs, aliases, name=name, **static)
  return {name: _untiled(a, leaf) for name, a in zip(like, results, strict=True)}


def _kernel_leaf(leaf: LeafPlan) -> LeafPlan:
  """`leaf` as its kernels see it: without its place in the tree (index, ratio slots, axis
  names), so that the leaves of one kind (BERT-large's 24 layers) share one traced and lowered
  kernel."""
  return leaf._replace(index=0, ratio_offset=0, axis_name=None)


@dataclasses.dataclass(frozen=True)
class MosaicKernels:
  """The Mosaic GPU kernel set (`optax_lamb.backends.gpu.driver.KernelSet`): a launch per leaf."""

  sizes: MosaicBlockSizes
  interpret: bool

  def leaf_reason(self, leaf: LeafPlan, x: LeafArrays) -> str | None:
    if isinstance(x.m, QuantizedMoment) or isinstance(x.v, QuantizedMoment):
      return (
        f"8-bit quantized moments (a leaf of shape {leaf.shape}): the Mosaic GPU kernels do not "
        "take them yet (implementation='pallas_triton' does)"
      )
    return None

  def moments_and_norms(self, scalars, leaves: list[dict], *, table, **static) -> tuple:
    ((c,), (x,)) = table, leaves
    leaf = _kernel_leaf(c.leaf)
    written, partials = moments_and_norms(scalars, x, leaf=leaf, **static, **self._launch())
    return [written], partials

  def slice_sums(self, starts: list[int], counts: list[int], partials: jax.Array) -> tuple:
    return passes.slice_sums_reference(starts, counts, partials)

  def updates(self, scalars, ratios, leaves: list[dict], *, table, **static) -> list[dict]:
    ((c,), (x,)) = table, leaves
    own = ratios[c.leaf.ratio_offset : c.leaf.ratio_offset + c.leaf.slices]
    return [updates(scalars, own, x, leaf=_kernel_leaf(c.leaf), **static, **self._launch())]

  def _launch(self) -> dict:
    return {"sizes": self.sizes, "interpret": self.interpret}


@dataclasses.dataclass(frozen=True)
class PallasMosaicGpuBackend(GpuBackend):
  """The Pallas Mosaic GPU kernels, with their launch configuration.

  Attributes:
    block_sizes: the launch sizes (`MosaicBlockSizes`).
    interpret: run the kernels in Pallas interpret mode; None: exactly when
      the default backend is not a GPU.

  Example:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> from optax_lamb.backends.pallas_mosaic_gpu import MosaicBlockSizes, PallasMosaicGpuBackend
    >>> backend = PallasMosaicGpuBackend(block_sizes=MosaicBlockSizes(block=1024))
    >>> tx = optax_lamb.lamb(1e-3, implementation=backend)
    >>> params = {"w": jnp.ones((3, 3))}
    >>> state = tx.init(params)
    >>> with warnings.catch_warnings():  # without a GPU: interpret mode, with a warning
    ...   warnings.simplefilter("ignore")
    ...   updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> print([round(x, 4) for x in optax.apply_updates(params, updates)["w"][0].tolist()])
    [0.999, 0.999, 0.999]
  """

  name = "pallas_mosaic_gpu"
  block_sizes: MosaicBlockSizes = MosaicBlockSizes()
  interpret: bool | None = None

  def kernels(self, plan: StepPlan, *, interpret: bool) -> MosaicKernels:
    """The same block sizes for every plan: no GPU has timed others yet."""
    return MosaicKernels(self.block_sizes, interpret)

  def device_reason(self) -> str | None:
    """Mosaic GPU compiles for compute capability 9.0 and newer (Hopper: H100, H200)."""
    device = jax.local_devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
      major = int(str(capability).split(".")[0])
    except ValueError:
      major = 0
    if major >= 9:
      return None
    return f"{device.device_kind} (compute capability {capability}): Mosaic GPU needs 9.0 or newer"


def _lower_sqrt_where_jax_does_not() -> None:
  """Give Mosaic GPU's lowering a rule for ``sqrt``: jax 0.10.2 has rsqrt, exp, log but no sqrt
  (`_leaf.adam_direction` takes one). The rule is the element-wise MLIR ``math.sqrt``, correctly
  rounded as XLA's; registered only where jax has none, for Mosaic GPU's lane semantics."""
  try:
    from jax import lax
    from jax._src.lib.mlir.dialects import math as mlir_math
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import lowering
  except ImportError:  # another jax's layout: its lowering decides
    return
  rules = lowering.mosaic_lowering_rules.get(gpu_core.LANExWG_SEMANTICS)
  if rules is None or lax.sqrt_p in rules:
    return

  def sqrt(ctx, x, accuracy=None) -> object:
    if accuracy is not None:
      raise NotImplementedError("sqrt with an accuracy")
    return lowering._ensure_fa(x, ctx.avals_in[0].dtype)._pointwise(mlir_math.sqrt)

  rules[lax.sqrt_p] = sqrt


_lower_sqrt_where_jax_does_not()
