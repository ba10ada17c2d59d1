"""The Triton kernels of the Pallas path, each beside the jnp reference it must equal.

Three kernels (see docs/KERNELS.md for the design and its bytes per parameter):

* `moments_and_norms_kernel` (pass 1, one program per chunk of an adapted
  leaf): m', v' from g, m, v (written in place where the moments are float32)
  and the chunk's partial sums of ||p||^2 and ||u||^2;
* `slice_sums_kernel` (one program per ratio slot): adds up the partial sums
  of one leaf or stacked slice, in a fixed order (deterministic: no atomics);
* `update_kernel` (pass 2, one program per chunk): u again, from p, m', v'
  (or from g, m, v where pass 1 could not store the moments unrounded), times
  the trust ratio and -lr: the updates, or the new params written over p.

The per-element math is written once, in `moments`, `direction` and
`updates_or_params` (which call `optax_lamb._math`): the kernels apply it to
one chunk, the references and the XLA pass 2 of the driver to a whole leaf.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from optax_lamb import _math
from optax_lamb.backends.pallas.chunks import LeafChunks

NUM_SCALARS = 16  # the runtime-scalar vector, padded to a power of two for Triton


class StepScalars(NamedTuple):
  """The step's scalars: float32 arrays, or Python numbers (compile-time constants)."""

  bc1: Any
  bc2: Any
  weight_decay: Any
  step_size: Any
  clip_factor: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any

  def runtime(self) -> jax.Array:
    """The vector of runtime scalars that the kernels read (Python numbers left as 0)."""
    values = [jnp.zeros((), jnp.float32) if _is_number(x) else x for x in self]
    values = [jnp.asarray(x, jnp.float32) for x in values]
    return jnp.stack(values + [jnp.zeros((), jnp.float32)] * (NUM_SCALARS - len(values)))

  def constants(self) -> tuple:
    """The Python numbers (static arguments of the kernels), None where a runtime scalar."""
    return tuple(x if _is_number(x) else None for x in self)

  @classmethod
  def load(cls, ref, constants: tuple) -> StepScalars:
    """Inside a kernel: each scalar from its constant, else from the runtime vector."""
    return cls(*(ref[i] if c is None else c for i, c in enumerate(constants)))


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


# ------------------------------------------------------------------ the math, written once


def moments(g, m, v, s: StepScalars, *, clip: bool):
  """(m', v') in float32 from the (clipped) gradient and the stored moments."""
  if clip:
    g = (g * s.clip_factor).astype(g.dtype)
  return _math.update_moments(g, m, v, s.b1, s.b2)


def direction(m, v, p, s: StepScalars, *, decay: bool):
  """u = Adam direction (+ wd p), in float32, from float32 moments."""
  u = _math.adam_direction(m, v, s.bc1, s.bc2, s.eps, s.eps_root)
  return _math.add_decay(u, p, s.weight_decay) if decay else u


def updates_or_params(u, p, ratio, s: StepScalars, *, apply: bool):
  """-lr r u in p's dtype, or p - lr r u with `apply`; `ratio` None: not adapted."""
  if ratio is not None:
    u = (u.astype(jnp.float32) * ratio).astype(u.dtype)
  u = _math.scale_by_step_size(u, s.step_size, p.dtype)
  return (p + u).astype(p.dtype) if apply else u


# ----------------------------------------------------------------------- kernel helpers


def _chunk(pid, c: LeafChunks, block: int):
  """(slice index, flat offset of the chunk, mask of its valid elements) of program `pid`."""
  local = pid - c.first
  if c.leaf.slices == 1:
    s, k = jnp.int32(0), local
  else:
    s = jax.lax.div(local, jnp.int32(c.chunks))  # local >= 0: a plain truncating division
    k = local - s * c.chunks
  start = k * block
  mask = start + jnp.arange(block, dtype=jnp.int32) < c.leaf.length
  return s, s * c.leaf.length + start, mask


def _for_each_leaf(table: tuple[LeafChunks, ...], body) -> None:
  """Run body(pid, j, chunks) in the programs of leaf j: a chain of pl.when on the program id."""
  pid = pl.program_id(0)  # read once, outside the branches (interpret mode needs it there)
  for j, c in enumerate(table):
    pl.when((pid >= c.first) & (pid < c.first + c.programs))(functools.partial(body, pid, j, c))


def _load(ref, start, mask, size):
  return plt.load(ref.at[pl.ds(start, size)], mask=mask, other=0)


def _store(ref, start, mask, size, value):
  plt.store(ref.at[pl.ds(start, size)], value.astype(ref.dtype), mask=mask)


def _masked_sq_sum(x, mask):
  # Masked lanes hold other=0 inputs, and u may be 0/0 there when eps = 0: zero them first.
  return _math.sq_norm(jnp.where(mask, x.astype(jnp.float32), 0.0))


# ------------------------------------------------------------------------------ pass 1


def pass1_outputs(table: tuple[LeafChunks, ...]) -> list[int]:
  """Positions in `table` of the leaves whose m', v' pass 1 writes (in place)."""
  return [j for j, c in enumerate(table) if not c.leaf.from_grads]


def moments_and_norms_kernel(scalars_ref, *refs, table, block, constants, clip):
  """Pass 1 over adapted leaves: m', v' (in place where float32) and per-chunk partial sums.

  refs: p, g, m, v of every leaf; then m', v' of the leaves in `pass1_outputs`;
  then the partial sums of ||p||^2 and ||u||^2 (one scalar per program).
  """
  n = len(table)
  ps, gs, ms, vs = (refs[i * n : (i + 1) * n] for i in range(4))
  writers = pass1_outputs(table)
  outs = refs[4 * n : 4 * n + 2 * len(writers)]
  m_outs = dict(zip(writers, outs[0::2], strict=True))
  v_outs = dict(zip(writers, outs[1::2], strict=True))
  p_part_ref, u_part_ref = refs[4 * n + 2 * len(writers) :]
  s = StepScalars.load(scalars_ref, constants)

  def body(pid, j, c):
    _, start, mask = _chunk(pid, c, block)
    g, m, v, p = (_load(r[j], start, mask, block) for r in (gs, ms, vs, ps))
    m, v = moments(g, m, v, s, clip=clip)
    # Every input of this chunk is read above, before its alias is written.
    if j in m_outs:
      _store(m_outs[j], start, mask, block, m)
      _store(v_outs[j], start, mask, block, v)
    u = direction(m, v, p, s, decay=c.leaf.decay)
    p_part_ref[...] = _masked_sq_sum(p, mask)
    u_part_ref[...] = _masked_sq_sum(u, mask)

  _for_each_leaf(table, body)


def moments_and_norms_reference(s: StepScalars, p, g, m, v, c: LeafChunks, block: int, clip):
  """What pass 1 computes for one flat leaf: (m', v', p partial sums, u partial sums)."""
  m_new, v_new = moments(g, m, v, s, clip=clip)
  u = direction(m_new, v_new, p, s, decay=c.leaf.decay)

  def partials(x):
    x = x.astype(jnp.float32).reshape(c.leaf.slices, c.leaf.length)
    x = jnp.pad(x, ((0, 0), (0, c.chunks * block - c.leaf.length)))
    return jnp.sum(jnp.square(x).reshape(c.programs, block), axis=1)

  return m_new.astype(m.dtype), v_new.astype(v.dtype), partials(p), partials(u)


# ------------------------------------------------------------------- per-slice sums


def slice_sums_kernel(starts_ref, counts_ref, p_part_ref, u_part_ref, p_sq_ref, u_sq_ref, *, size):
  """Slot i: the sums of its `counts[i]` partials from `starts[i]`, `size` at a time."""
  slot = pl.program_id(0)
  start, count = starts_ref[slot], counts_ref[slot]
  lanes = jnp.arange(size, dtype=jnp.int32)

  def add(i, acc):
    offset = i * size
    mask = offset + lanes < count
    return (
      acc[0] + _load(p_part_ref, start + offset, mask, size),
      acc[1] + _load(u_part_ref, start + offset, mask, size),
    )

  zeros = jnp.zeros((size,), jnp.float32)
  acc_p, acc_u = jax.lax.fori_loop(0, (count + size - 1) // size, add, (zeros, zeros))
  p_sq_ref[...] = jnp.sum(acc_p)
  u_sq_ref[...] = jnp.sum(acc_u)


def slice_sums_reference(starts, counts, p_part, u_part):
  """(||p||^2, ||u||^2) per slot, from the partial sums."""
  sums = lambda part: jnp.stack(
    [jnp.sum(part[a : a + n]) for a, n in zip(starts, counts, strict=True)]
  )
  return sums(p_part), sums(u_part)


# ------------------------------------------------------------------------------ pass 2


def pass2_operands(table: tuple[LeafChunks, ...]) -> tuple[list, list]:
  """Per leaf of the launch, the names of its inputs and of its outputs, in operand order."""
  inputs = [("p", "m", "v", "g") if c.leaf.from_grads else ("p", "m", "v") for c in table]
  outputs = [("out", "m", "v") if c.leaf.from_grads else ("out",) for c in table]
  return inputs, outputs


def _by_leaf(refs, names_per_leaf):
  """Split a flat run of refs into one {name: ref} per leaf."""
  out, i = [], 0
  for names in names_per_leaf:
    out.append(dict(zip(names, refs[i : i + len(names)], strict=True)))
    i += len(names)
  return out, i


def update_kernel(scalars_ref, ratios_ref, *refs, table, block, constants, clip, apply):
  """Pass 2: -lr r u, or p - lr r u written over p; m', v' too for `from_grads` leaves."""
  in_names, out_names = pass2_operands(table)
  ins, used = _by_leaf(refs, in_names)
  outs, _ = _by_leaf(refs[used:], out_names)
  s = StepScalars.load(scalars_ref, constants)

  def body(pid, j, c):
    slice_index, start, mask = _chunk(pid, c, block)
    x = {name: _load(ref, start, mask, block) for name, ref in ins[j].items()}
    if c.leaf.from_grads:
      m, v = moments(x["g"], x["m"], x["v"], s, clip=clip)
      _store(outs[j]["m"], start, mask, block, m)
      _store(outs[j]["v"], start, mask, block, v)
    else:
      m, v = x["m"], x["v"]
    u = direction(m, v, x["p"], s, decay=c.leaf.decay)
    ratio = ratios_ref[c.leaf.ratio_offset + slice_index] if c.leaf.adapt else None
    _store(outs[j]["out"], start, mask, block, updates_or_params(u, x["p"], ratio, s, apply=apply))

  _for_each_leaf(table, body)


def update_reference(s: StepScalars, leaf, p, m, v, g, ratios, *, clip: bool, apply: bool):
  """Pass 2 for one leaf of any shape (flat, or as stacked), in jnp: (out, m', v').

  Also the driver's XLA pass 2: written per leaf, XLA fuses it with the caller's
  ``optax.apply_updates``. `m`, `v` are the new float32 moments, or the old ones
  and `g` when `leaf.from_grads`; `ratios` is the step's whole ratio vector.
  """
  shape = jnp.shape(p)
  # One row per stacked slice (a bitcast in XLA), so each row takes its slice's ratio.
  p, m, v, g = (
    None if x is None else jnp.reshape(x, (leaf.slices, leaf.length)) for x in (p, m, v, g)
  )
  if leaf.from_grads:
    m_new, v_new = moments(g, m, v, s, clip=clip)
    m_out, v_out = m_new.astype(m.dtype), v_new.astype(v.dtype)
  else:
    m_new, v_new = m_out, v_out = m, v
  u = direction(m_new, v_new, p, s, decay=leaf.decay)
  ratio = None
  if leaf.adapt:
    ratio = ratios[leaf.ratio_offset : leaf.ratio_offset + leaf.slices, None]
  out = updates_or_params(u, p, ratio, s, apply=apply)
  return tuple(jnp.reshape(x, shape) for x in (out, m_out, v_out))
