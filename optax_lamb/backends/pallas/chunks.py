"""Launch configuration of the Pallas kernels, and the static chunk table of each launch.

A leaf is processed as flat 1-D chunks of ``block`` elements; a leaf with
stacked axes as S slices of L elements, each slice its own run of
``cdiv(L, block)`` chunks (a chunk never spans two slices). A launch takes a
bucket of up to ``max_leaves_per_call`` leaves, one program per chunk; the
table (Python ints and bools, fixed at trace time) tells each program its leaf.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax

# Element offsets inside the kernels are int32 (byte addresses are 64-bit in Triton).
INT32_LIMIT = 2**31 - 1


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
  """

  block: int = 4096
  max_leaves_per_call: int = 32
  num_warps: int = 8
  num_stages: int = 1
  sum_block: int = 1024
  xla_pass2_min_size: int = 1 << 16

  def __post_init__(self):
    for name in ("block", "num_warps", "sum_block"):
      if not _is_power_of_two(getattr(self, name)):
        raise ValueError(f"{name}={getattr(self, name)} must be a power of two (Triton shapes)")
    for name, low in (("max_leaves_per_call", 1), ("num_stages", 1), ("xla_pass2_min_size", 0)):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= low):
        raise ValueError(f"{name}={value!r} must be an int >= {low}")

  @classmethod
  def get_default(cls) -> BlockSizes:
    """The sizes in effect: those set by :func:`options`, else the class defaults."""
    return _OPTIONS["block_sizes"] or cls()


_OPTIONS: dict[str, Any] = {"block_sizes": None, "interpret": None}


@contextlib.contextmanager
def options(*, block_sizes: BlockSizes | None = None, interpret: bool | None = None):
  """Override the block sizes and interpret mode for steps traced inside this context.

  For tests and tuning: the values are read when a step is traced, so jit the
  step inside the context. ``interpret=None`` means "interpret unless on a GPU".
  """
  saved = dict(_OPTIONS)
  _OPTIONS.update(block_sizes=block_sizes, interpret=interpret)
  try:
    yield
  finally:
    _OPTIONS.update(saved)


def interpret() -> bool:
  """Whether the kernels run in Pallas interpret mode (set by `options`, else: no GPU)."""
  if _OPTIONS["interpret"] is not None:
    return _OPTIONS["interpret"]
  return jax.default_backend() != "gpu"


@dataclasses.dataclass(frozen=True)
class LeafKernelPlan:
  """What the kernels do with one leaf (static)."""

  index: int  # position in the tree's leaves
  slices: int  # S, product of the stacked axes
  length: int  # L, elements per slice
  adapt: bool  # pass 1 computes its norms; pass 2 applies its ratios
  decay: bool
  from_grads: bool  # pass 2 recomputes the moments from g and the old m, v, and writes them
  ratio_offset: int  # its first entry in the ratio vector

  @property
  def size(self) -> int:
    return self.slices * self.length


@dataclasses.dataclass(frozen=True)
class LeafChunks:
  """A leaf's place in one launch: its plan, chunks per slice and first program."""

  leaf: LeafKernelPlan
  chunks: int  # cdiv(L, block) programs per slice
  first: int  # first program id of this leaf in its launch

  @property
  def programs(self) -> int:
    return self.leaf.slices * self.chunks


def buckets(leaves: list[LeafKernelPlan], block_sizes: BlockSizes) -> list[tuple[LeafChunks, ...]]:
  """The chunk tables of the launches over `leaves` (in order, empty leaves left out)."""
  out, table, first = [], [], 0
  for leaf in leaves:
    if leaf.size == 0:
      continue
    if leaf.size > INT32_LIMIT - block_sizes.block:
      raise ValueError(
        f"leaf {leaf.index} has {leaf.size} elements; the kernels' int32 element offsets "
        f"need < 2**31 - block={block_sizes.block}"
      )
    chunks = -(-leaf.length // block_sizes.block)
    table.append(LeafChunks(leaf, chunks, first))
    first += leaf.slices * chunks
    if len(table) == block_sizes.max_leaves_per_call:
      out.append(tuple(table))
      table, first = [], 0
  if table:
    out.append(tuple(table))
  return out


def programs(table: tuple[LeafChunks, ...]) -> int:
  return sum(c.programs for c in table)


def slice_ranges(tables: list[tuple[LeafChunks, ...]], ratio_count: int) -> tuple[list, list]:
  """(start, count) of each ratio slot's partial sums in the launches' concatenated partials.

  Slots of leaves in no table (not adapted, or empty) get count 0.
  """
  starts, counts, base = [0] * ratio_count, [0] * ratio_count, 0
  for table in tables:
    for c in table:
      for s in range(c.leaf.slices):
        starts[c.leaf.ratio_offset + s] = base + c.first + s * c.chunks
        counts[c.leaf.ratio_offset + s] = c.chunks
    base += programs(table)
  return starts, counts


def leaf_plans(shapes, axes, adapts, decays, narrow, ratio_offsets) -> list[LeafKernelPlan]:
  """The kernels' per-leaf plan; `narrow`: the leaf's moments are stored narrower than float32."""
  plans = []
  for i, (shape, k, adapt, decay, narrow_i, offset) in enumerate(
    zip(shapes, axes, adapts, decays, narrow, ratio_offsets, strict=True)
  ):
    # Without adaptation there is no norm to wait for: one pass from g does the whole leaf.
    from_grads = bool(narrow_i) or not adapt
    plans.append(
      LeafKernelPlan(
        i, math.prod(shape[:k]), math.prod(shape[k:]), adapt, decay, from_grads, offset
      )
    )
  return plans
