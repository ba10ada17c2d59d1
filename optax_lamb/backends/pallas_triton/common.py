"""What the three Triton kernel passes share: launch sizes, a program's chunk, masked loads, the call.

The chunk tables and the step's scalars are the GPU driver's
(`optax_lamb.backends.gpu.tables`): one program per chunk of ``block`` elements,
a bucket of up to ``max_leaves_per_call`` leaves per launch.

Operands are named: a launch passes a list (one entry per leaf of its bucket)
of ``{name: flat array}``, flattened by `jax.tree` in one fixed order that the
kernel unflattens back, so the kernel and its ``pallas_call`` never count
positions.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from optax_lamb import _interop
from optax_lamb.backends.gpu import tables
from optax_lamb.backends.gpu.tables import LeafChunks, Table


def _is_power_of_two(n: Any) -> bool:
  return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Launch configuration.

  Attributes:
    block: elements per program (one chunk), a power of two.
    max_leaves_per_call: leaves per ``pallas_call`` (bounds the kernel's parameter
      space: a leaf brings up to 7 pointers).
    num_warps: Triton warps per program.
    num_stages: Triton pipeline stages.
    sum_block: partial sums added per loop iteration when the per-chunk partial
      sums are reduced to one per leaf (or stacked slice), a power of two.
    xla_pass2_min_size: in ``tx.update`` (not ``update_and_apply``), leaves of at
      least this many elements take pass 2 as an XLA elementwise computation,
      which XLA fuses with the caller's ``optax.apply_updates`` (one pass that
      reads p, m, v and writes p); smaller leaves take the pass-2 kernel, which
      handles a whole bucket of leaves in one launch.

  Example:
    >>> import dataclasses
    >>> from optax_lamb.backends.pallas_triton import BlockSizes
    >>> sizes = dataclasses.replace(BlockSizes(), block=1024, num_warps=4)
    >>> print(sizes.block, sizes.num_warps, sizes.max_leaves_per_call)
    1024 4 32
  """

  block: int = 4096
  max_leaves_per_call: int = 32
  num_warps: int = 8
  num_stages: int = 1
  sum_block: int = 1024
  xla_pass2_min_size: int = 1 << 16

  def __post_init__(self) -> None:
    for field in dataclasses.fields(self):  # a Python int each (a bool is refused, not read as 1)
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
          f"BlockSizes: {field.name}={value!r} must be an int, not a {type(value).__name__}"
        )
    for name in ("block", "num_warps", "sum_block"):
      if not _is_power_of_two(getattr(self, name)):
        raise ValueError(
          f"BlockSizes: {name}={getattr(self, name)} must be a power of two (Triton shapes)"
        )
    for name, low in (("max_leaves_per_call", 1), ("num_stages", 1), ("xla_pass2_min_size", 0)):
      if getattr(self, name) < low:
        raise ValueError(f"BlockSizes: {name}={getattr(self, name)!r} must be an int >= {low}")


# ------------------------------------------------------------------------ kernel helpers


class Chunk(NamedTuple):
  """Program `pid`'s chunk of its leaf (`chunk`)."""

  slice: jax.Array  # the stacked slice index
  start: jax.Array  # the chunk's flat offset in the leaf
  mask: jax.Array  # its valid elements
  within: jax.Array  # its offset in the slice
  length: int  # L, elements per slice


def chunk(pid, c: LeafChunks, block: int) -> Chunk:
  """Where program `pid`'s chunk lies: its slice, flat offset and valid elements."""
  local = pid - c.first
  if c.leaf.slices == 1:
    s, k = jnp.int32(0), local
  else:
    s = jax.lax.div(local, jnp.int32(c.chunks))  # local >= 0: a plain truncating division
    k = local - s * c.chunks
  start = k * block
  mask = start + jnp.arange(block, dtype=jnp.int32) < c.leaf.length
  return Chunk(s, s * c.leaf.length + start, mask, start, c.leaf.length)


def for_each_leaf(table: Table, body) -> None:
  """Run body(pid, j, chunks) in the programs of leaf j: a chain of pl.when on the program id."""
  pid = pl.program_id(0)  # read once, outside the branches (interpret mode needs it there)
  for j, c in enumerate(table):
    pl.when((pid >= c.first) & (pid < c.first + c.programs))(functools.partial(body, pid, j, c))


def load(ref, start, mask, size) -> jax.Array:
  return plt.load(ref.at[pl.ds(start, size)], mask=mask, other=0)


def store(ref, start, mask, size, value) -> None:
  plt.store(ref.at[pl.ds(start, size)], value.astype(ref.dtype), mask=mask)


# -------------------------------------------------------------------- the pallas_call


def whole(x) -> pl.BlockSpec:
  """The whole 1-D operand `x` in every program; the kernel indexes it with masked loads."""
  return pl.BlockSpec((x.shape[0],), lambda i: (0,))


def one_per_program() -> pl.BlockSpec:
  return pl.BlockSpec((pl.squeezed,), lambda i: (i,))


def _aliases(inputs: Any, outputs: Any, offset: int, overwrites) -> dict[int, int]:
  """``input_output_aliases`` from named operands: each output -> the input it overwrites.

  `overwrites(path)` gives the key path in `inputs` of the input that the output at
  `path` of `outputs` is written over, or None; `offset` counts the operands before `inputs`.
  """
  flat_inputs = jax.tree_util.tree_flatten_with_path(inputs)[0]
  positions = {path: offset + i for i, (path, _) in enumerate(flat_inputs)}
  out = {}
  for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(outputs)[0]):
    in_path = overwrites(path)
    if in_path is not None:
      out[positions[in_path]] = i
  return out


def launch(
  kernel, leading, inputs, outputs, *, table: Table, overwrites, out_specs=None, **kwargs
) -> Any:
  """One ``pallas_call`` of `kernel` over a bucket, with named operands; returns `outputs`' tree.

  `leading`: operands passed whole before the leaves' (scalars, ratios); `inputs`:
  the leaves' named arrays; `outputs`: a pytree of ShapeDtypeStructs (specs
  `out_specs`, default each output whole). The kernel gets the refs of `leading`,
  then ``refs`` to rebuild with its `in_def` and `out_def` (keyword arguments).
  """
  flat_in, in_def = jax.tree.flatten(inputs)
  flat_out, out_def = jax.tree.flatten(outputs)
  out_specs = jax.tree.map(whole, outputs) if out_specs is None else out_specs
  block_sizes, interpret, name = (
    kwargs.pop("block_sizes"),
    kwargs.pop("interpret"),
    kwargs.pop("name"),
  )
  result = call(
    functools.partial(
      kernel, table=table, block=block_sizes.block, in_def=in_def, out_def=out_def, **kwargs
    ),
    (*leading, *flat_in),
    block_sizes=block_sizes,
    interpret=interpret,
    grid=(tables.programs(table),),
    in_specs=[whole(x) for x in (*leading, *flat_in)],
    out_specs=jax.tree.leaves(out_specs),
    out_shape=flat_out,
    input_output_aliases=_aliases(inputs, outputs, len(leading), overwrites),
    name=name,
  )
  return jax.tree.unflatten(out_def, result)


def call(kernel, operands, *, block_sizes: BlockSizes, interpret: bool, **kwargs) -> Any:
  """pl.pallas_call(kernel, ...)(*operands) on Triton, without its DeprecationWarning."""
  # Explicit Triton parameters: with None, jax 0.9-0.11 would pick Mosaic GPU (docs/KERNELS.md).
  params = plt.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages)
  with warnings.catch_warnings():
    warnings.filterwarnings(
      "ignore", message=_interop.TRITON_DEPRECATION, category=DeprecationWarning
    )
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kwargs)(*operands)


def _end_the_triton_dialect_search() -> None:
  """Make MLIR's Python bindings find a module for the Triton dialect ("tt").

  At every operation and value the Triton lowering builds, the bindings look for a Python
  module of the dialect under their search prefixes (``jaxlib.mlir.dialects``,
  ``jaxlib.mosaic.python``, ...), find none and do not remember that: lowering BERT-base's step
  for cuda made 83,000 failed imports, 8 of its 11 s (jax 0.10.2, benchmarks/NOTES.md). A prefix
  holding an (empty) ``tt`` module ends the search at the first operation. Only a speed-up:
  where the bindings differ, nothing changes.
  """
  try:
    from jaxlib.mlir._mlir_libs import _mlir

    prefix = f"{__package__}._mlir_dialects"
    if prefix not in _mlir.globals.dialect_search_modules:
      _mlir.globals.append_dialect_search_prefix(prefix)
  except Exception:  # another jaxlib's bindings: lower as before
    pass


_end_the_triton_dialect_search()
