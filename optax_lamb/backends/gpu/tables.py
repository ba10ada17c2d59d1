"""The launches of a step: chunk tables, the ratio slots' ranges of partial sums, the scalars.

A leaf is processed as flat 1-D chunks of ``block`` elements; a leaf with
stacked axes as S slices of L elements, each slice its own run of
``cdiv(L, block)`` chunks (a chunk never spans two slices). A launch takes a
bucket of up to ``max_leaves_per_call`` leaves, one program per chunk; its
chunk table (Python ints, fixed at trace time) tells each program its leaf.
These are the same for every kernel set (`optax_lamb.backends.gpu.driver`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb.core._options import ScalarLayout, StepScalars

# Element offsets inside the kernels are int32 (byte addresses are 64-bit).
INT32_LIMIT = 2**31 - 1

if TYPE_CHECKING:  # annotations only: the tables sit below the plan in the imports
  from optax_lamb.step._plan import LeafPlan


class LaunchShape(Protocol):
  """What the tables need of a kernel set's block configuration."""

  @property
  def block(self) -> int: ...

  @property
  def max_leaves_per_call(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class LeafChunks:
  """A leaf's place in one launch: its plan, its chunks per slice and its first program."""

  leaf: LeafPlan
  chunks: int  # cdiv(L, block) programs per slice
  first: int  # first program id of this leaf in its launch

  @property
  def programs(self) -> int:
    return self.leaf.slices * self.chunks


Table = tuple[LeafChunks, ...]


def buckets(leaves: list[LeafPlan], sizes: LaunchShape) -> list[Table]:
  """The chunk tables of the launches over `leaves` (in order, empty leaves left out)."""
  out, table, first = [], [], 0
  for leaf in leaves:
    if leaf.size == 0:
      continue
    if leaf.size > INT32_LIMIT - sizes.block:
      raise ValueError(
        f"leaf {leaf.index} has {leaf.size} elements; the kernels' int32 element offsets "
        f"need < 2**31 - block={sizes.block}"
      )
    chunks = -(-leaf.length // sizes.block)
    table.append(LeafChunks(leaf, chunks, first))
    first += leaf.slices * chunks
    if len(table) == sizes.max_leaves_per_call:
      out.append(tuple(table))
      table, first = [], 0
  if table:
    out.append(tuple(table))
  return out


def programs(table: Table) -> int:
  return sum(c.programs for c in table)


def slot_ranges(tables: list[Table], slot_count: int) -> tuple[list[int], list[int]]:
  """(start, count) of each ratio slot's partial sums in the launches' concatenated partials.

  Slots of leaves in no table (not adapted, or empty) get count 0.
  """
  starts, counts, base = [0] * slot_count, [0] * slot_count, 0
  for table in tables:
    for c in table:
      for s in range(c.leaf.slices):
        starts[c.leaf.ratio_offset + s] = base + c.first + s * c.chunks
        counts[c.leaf.ratio_offset + s] = c.chunks
    base += programs(table)
  return starts, counts


def slot_operands(starts: list[int], counts: list[int]) -> tuple[jax.Array, jax.Array]:
  """A slice-sums kernel's (starts, counts) operands: constants of the step."""
  return jnp.asarray(np.asarray(starts, np.int32)), jnp.asarray(np.asarray(counts, np.int32))


def scalar_operands(scalars: StepScalars) -> tuple[jax.Array, ScalarLayout]:
  """(the float32 vector of the runtime scalars, their layout: a static argument of the kernels)."""
  layout, values = ScalarLayout.of(scalars)
  return layout.vector(values), layout


def load_scalars(ref, layout: ScalarLayout) -> StepScalars:
  """Inside a kernel: the step's scalars, the runtime ones read from the vector by name."""
  return layout.join({name: ref[layout.index(name)] for name in layout.runtime})
