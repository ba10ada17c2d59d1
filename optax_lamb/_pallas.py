"""The Pallas (Triton) path of lamb: two kernels per bucket of leaves, design B of KERNEL.md.

Per bucket of up to ``max_leaves_per_call`` leaves (each leaf its own operand,
flattened to 1-D; no packing into flat buffers):

* pass 1 (``moments_kernel``) reads p, g, m, v, writes m', v' in place
  (``input_output_aliases``) and, per chunk of ``block`` elements, the partial
  sums of ||p||^2 and ||u||^2, u = Adam direction (+ wd p);
* in XLA, the partials are summed per leaf (per stacked slice) by a reshape
  and a sum (deterministic: no scatter, no float atomics), psum'd over
  ``axis_name`` in one collective for the whole tree, and turned into ratios
  by ``_math.trust_ratio``;
* pass 2 (``apply_kernel``) reads p, m', v', recomputes u with the same
  expressions in the same order (so the same float32 values as pass 1) and
  writes either the updates -lr r u or, for ``update_and_apply``, the new
  params p - lr r u in place of p.

Chunks never span stacked slices: a leaf with S slices of L elements has
S * cdiv(L, block) programs. The chunk table of a bucket is static (Python
ints); a program finds its leaf with a chain of ``pl.when`` on its program id.
Every load and store is a masked ``pallas.triton.load/store`` of ``block``
(a power of two) elements. Runtime values (bias corrections, weight decay,
learning rate, clip factor, ratios) are array inputs, so schedules never
recompile the kernels.

Index arithmetic is int32 in element units: a leaf may exceed 2^31 bytes but
must have fewer than 2^31 - block elements (larger leaves fall back to XLA).
Byte addresses are formed by Triton's 64-bit pointer arithmetic.

Status: verified in interpret mode on the CPU, and lowered to Triton IR for
CUDA without a GPU (tests/test_pallas.py); not yet compiled by Triton, run or
timed on a GPU.

Every formula comes from `_math`; the state is the stage chain's state. The
pure-jnp reference that the tests compare with, and the fallback for what the
kernels do not cover, is the XLA path, `_xla.update`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from optax_lamb import _clipping, _math, _tree, _xla
from optax_lamb._trust_ratio import ScaleByTrustRatioState

# Positions of the runtime scalars in the `scalars` input (length 16: a power of two). b1, b2,
# eps and eps_root are compile-time constants when they are Python numbers (as in the XLA path)
# and runtime scalars otherwise (optax.inject_hyperparams passes arrays).
BC1, BC2, WEIGHT_DECAY, STEP_SIZE, CLIP_FACTOR, B1, B2, EPS, EPS_ROOT = range(9)
NUM_SCALARS = 16
_CONSTANTS = {"b1": B1, "b2": B2, "eps": EPS, "eps_root": EPS_ROOT}
# The lamb options the kernels implement; any other option that is set falls back to XLA.
_HANDLED_OPTIONS = frozenset(
  (
    "learning_rate",
    "b1",
    "b2",
    "eps",
    "eps_root",
    "weight_decay",
    "mask",
    "bias_correction",
    "trust_ratio_mask",
    "min_trust_ratio",
    "max_trust_ratio",
    "max_grad_norm",
    "stacked_axes",
    "axis_name",
  )
)
_INT32_LIMIT = 2**31 - 1
_PARAM_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The Pallas Triton backend is deprecated from jax 0.11 but still works (KERNEL.md).
_TRITON_DEPRECATION = r"(?is).*triton.*"


def _is_power_of_two(n: int) -> bool:
  return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Launch configuration of the two kernels.

  Attributes:
    block: elements per program (one chunk), a power of two.
    max_leaves_per_call: leaves per ``pallas_call`` (bounds the kernel's
      parameter space: pass 1 takes 6 pointers per leaf).
    num_warps: Triton warps per program.
    num_stages: Triton pipeline stages.
  """

  block: int = 4096
  max_leaves_per_call: int = 32
  num_warps: int = 8
  num_stages: int = 1

  def __post_init__(self):
    if not _is_power_of_two(self.block):
      raise ValueError(f"block={self.block} must be a power of two (Triton tensor sizes)")
    if not _is_power_of_two(self.num_warps):
      raise ValueError(f"num_warps={self.num_warps} must be a power of two")
    if not (isinstance(self.max_leaves_per_call, int) and self.max_leaves_per_call >= 1):
      raise ValueError(f"max_leaves_per_call={self.max_leaves_per_call} must be an int >= 1")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
      raise ValueError(f"num_stages={self.num_stages} must be an int >= 1")

  @classmethod
  def get_default(cls) -> BlockSizes:
    """The sizes in effect: those set by :func:`options`, else the class defaults.

    The defaults are educated guesses (apex chunks at 64K elements with <= 110
    tensors per launch); they have not been tuned on a GPU.
    """
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


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
  if key not in _WARNED:
    _WARNED.add(key)
    warnings.warn(message, stacklevel=4)


def _interpret() -> bool:
  if _OPTIONS["interpret"] is not None:
    return _OPTIONS["interpret"]
  if jax.default_backend() == "gpu":
    return False
  _warn_once(
    "interpret",
    "optax_lamb.lamb(implementation='pallas') on a backend without a GPU runs its kernels in "
    "Pallas interpret mode, which is slow; use implementation='xla' there.",
  )
  return True


# ----------------------------------------------------------------------------- chunk table


@dataclasses.dataclass(frozen=True)
class LeafChunks:
  """Static chunk table entry of one non-empty leaf in a bucket (Python ints and bools)."""

  slices: int  # S, product of the stacked axes
  length: int  # L, elements per slice
  chunks: int  # cdiv(L, block) programs per slice
  first: int  # first program id of this leaf in its bucket
  ratio_offset: int  # index of its first ratio in the bucket's ratio vector
  adapt: bool
  decay: bool

  @property
  def programs(self) -> int:
    return self.slices * self.chunks


def leaf_chunks(
  shapes: list[tuple[int, ...]],
  axes: list[int],
  adapts: list[bool],
  decays: list[bool],
  block_sizes: BlockSizes,
) -> list[tuple[tuple[int, ...], tuple[LeafChunks, ...]]]:
  """Buckets of (leaf indices, chunk table); empty leaves appear in no bucket."""
  buckets, indices, table, first, ratio_offset = [], [], [], 0, 0
  for i, (shape, k, adapt, decay) in enumerate(zip(shapes, axes, adapts, decays, strict=True)):
    slices, length = math.prod(shape[:k]), math.prod(shape[k:])
    if slices * length == 0:
      continue
    if slices * length > _INT32_LIMIT - block_sizes.block:
      raise ValueError(
        f"leaf {i} with shape={shape} has {slices * length} elements; the kernel's int32 "
        f"element offsets need < 2**31 - block={block_sizes.block}"
      )
    chunks = -(-length // block_sizes.block)
    table.append(LeafChunks(slices, length, chunks, first, ratio_offset, bool(adapt), bool(decay)))
    indices.append(i)
    first += slices * chunks
    ratio_offset += slices if adapt else 0
    if len(indices) == block_sizes.max_leaves_per_call:
      buckets.append((tuple(indices), tuple(table)))
      indices, table, first, ratio_offset = [], [], 0, 0
  if indices:
    buckets.append((tuple(indices), tuple(table)))
  return buckets


def _chunk_position(pid, leaf: LeafChunks, block: int):
  """(slice index, flat offset of the chunk, mask of its valid elements) of program `pid`."""
  local = pid - leaf.first
  if leaf.slices == 1:
    s, c = jnp.int32(0), local
  else:
    s = jax.lax.div(local, jnp.int32(leaf.chunks))  # local >= 0: a plain truncating division
    c = local - s * leaf.chunks
  start = c * block
  mask = start + jnp.arange(block, dtype=jnp.int32) < leaf.length
  return s, s * leaf.length + start, mask


def _for_each_leaf(table: tuple[LeafChunks, ...], body) -> None:
  """Run body(pid, j, leaf) in the programs of leaf j: a chain of pl.when on the program id."""
  # Read once, outside the branches (interpret mode lowers program_id only at the top level).
  pid = pl.program_id(0)
  for j, leaf in enumerate(table):
    in_leaf = (pid >= leaf.first) & (pid < leaf.first + leaf.programs)
    pl.when(in_leaf)(functools.partial(body, pid, j, leaf))


def _load(ref, start, mask, block):
  return plt.load(ref.at[pl.ds(start, block)], mask=mask, other=0)


def _store(ref, start, mask, block, value):
  plt.store(ref.at[pl.ds(start, block)], value.astype(ref.dtype), mask=mask)


def _constant(value, scalars, name):
  """A static hyper-parameter, or its runtime scalar when it was not a Python number (None)."""
  return scalars[_CONSTANTS[name]] if value is None else value


def _direction(g_dtype, m, v, p, scalars, *, eps, eps_root, decay, weak_wd):
  """u as the XLA path computes it: Adam direction in g's dtype, plus wd p (`_math`)."""
  eps, eps_root = _constant(eps, scalars, "eps"), _constant(eps_root, scalars, "eps_root")
  u = _math.adam_direction(m, v, scalars[BC1], scalars[BC2], eps, eps_root).astype(g_dtype)
  if not decay:
    return u
  wd = scalars[WEIGHT_DECAY]
  # A Python-float weight decay is weakly typed in the XLA path: it takes p's dtype there.
  return _math.add_decay(u, p, wd.astype(p.dtype) if weak_wd else wd)


def _scalars(ref):
  """The runtime scalars, each a scalar load."""
  return [ref[i] for i in range(NUM_SCALARS)]


# --------------------------------------------------------------------------------- kernels


def moments_kernel(
  scalars_ref,
  *refs,
  table: tuple[LeafChunks, ...],
  block: int,
  b1: float | None,
  b2: float | None,
  eps: float | None,
  eps_root: float | None,
  clip: bool,
  weak_wd: bool,
):
  """Pass 1: m', v' in place and per-chunk partial sums of ||p||^2 and ||u||^2.

  refs: p, g, m, v (one ref per leaf each), then the outputs m', v' (aliased
  onto m, v) and the two partial-sum outputs (one scalar per program).
  """
  n = len(table)
  ps, gs, ms, vs, m_outs, v_outs = (refs[i * n : (i + 1) * n] for i in range(6))
  p_part_ref, u_part_ref = refs[6 * n :]
  scalars = _scalars(scalars_ref)

  def body(pid, j, leaf):
    _, start, mask = _chunk_position(pid, leaf, block)
    g = _load(gs[j], start, mask, block)
    m = _load(ms[j], start, mask, block)
    v = _load(vs[j], start, mask, block)
    if clip:
      g = (g * scalars[CLIP_FACTOR]).astype(g.dtype)
    m, v = _math.update_moments(g, m, v, _constant(b1, scalars, "b1"), _constant(b2, scalars, "b2"))
    # Every input of this chunk is read above, before its alias is written.
    _store(m_outs[j], start, mask, block, m)
    _store(v_outs[j], start, mask, block, v)
    if leaf.adapt:  # p is read only where the norms need it
      p = _load(ps[j], start, mask, block)
      u = _direction(
        g.dtype, m, v, p, scalars, eps=eps, eps_root=eps_root, decay=leaf.decay, weak_wd=weak_wd
      )
      # Masked lanes hold other=0 inputs, and u may be 0/0 there when eps = 0: zero them first.
      p_part_ref[...] = _math.sq_norm(jnp.where(mask, p.astype(jnp.float32), 0.0))
      u_part_ref[...] = _math.sq_norm(jnp.where(mask, u.astype(jnp.float32), 0.0))
    else:
      p_part_ref[...] = jnp.zeros((), jnp.float32)
      u_part_ref[...] = jnp.zeros((), jnp.float32)

  _for_each_leaf(table, body)


def apply_kernel(
  scalars_ref,
  ratios_ref,
  *refs,
  table: tuple[LeafChunks, ...],
  block: int,
  eps: float | None,
  eps_root: float | None,
  g_dtypes: tuple[Any, ...],
  weak_wd: bool,
  weak_lr: bool,
  apply: bool,
):
  """Pass 2: recompute u from p, m', v' and write -lr r u, or p - lr r u (aliased onto p).

  refs: p, m', v' (one ref per leaf each), then one output per leaf.
  """
  n = len(table)
  ps, ms, vs, outs = (refs[i * n : (i + 1) * n] for i in range(4))
  scalars = _scalars(scalars_ref)

  def body(pid, j, leaf):
    s, start, mask = _chunk_position(pid, leaf, block)
    p = _load(ps[j], start, mask, block)
    m = _load(ms[j], start, mask, block)
    v = _load(vs[j], start, mask, block)
    u = _direction(
      g_dtypes[j], m, v, p, scalars, eps=eps, eps_root=eps_root, decay=leaf.decay, weak_wd=weak_wd
    )
    if leaf.adapt:
      # _math.scale_by_ratio for a scalar ratio (no reshape inside the kernel).
      ratio = ratios_ref[leaf.ratio_offset + s]
      u = (u.astype(jnp.float32) * ratio).astype(u.dtype)
    # optax.scale_by_learning_rate (a float or schedule value takes u's dtype), then lamb's cast.
    step = scalars[STEP_SIZE]
    u = ((step.astype(u.dtype) if weak_lr else step) * u).astype(p.dtype)
    # The XLA path's pass 2: p + u in the param dtype.
    _store(outs[j], start, mask, block, (p + u).astype(p.dtype) if apply else u)

  _for_each_leaf(table, body)


# ------------------------------------------------------------------------------- wrappers


def _full(n: int) -> pl.BlockSpec:
  """The whole 1-D operand in every program; the kernel indexes it with masked loads."""
  return pl.BlockSpec((n,), lambda i: (0,))


def _out_struct(shape, dtype, like):
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


def _compiler_params(block_sizes: BlockSizes):
  # Explicit Triton params: with None, jax 0.9-0.11 would pick Mosaic GPU (KERNEL.md).
  return plt.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages)


def _call(kernel, *args, **kwargs):
  """pl.pallas_call(kernel, **kwargs)(*args), without the Triton backend's DeprecationWarning."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
    return pl.pallas_call(kernel, **kwargs)(*args)


@functools.partial(
  jax.jit,
  static_argnames=(
    "table",
    "block_sizes",
    "b1",
    "b2",
    "eps",
    "eps_root",
    "clip",
    "weak_wd",
    "interpret",
  ),
)
def moments_and_norms(
  scalars, ps, gs, ms, vs, *, table, block_sizes, b1, b2, eps, eps_root, clip, weak_wd, interpret
):
  """Pass 1 over one bucket of flat leaves: (m's, v's, ||p||^2 partials, ||u||^2 partials)."""
  n = len(table)
  for name, xs in (("g", gs), ("m", ms), ("v", vs)):
    for j, (x, p) in enumerate(zip(xs, ps, strict=True)):
      if x.shape != p.shape or x.ndim != 1:
        raise ValueError(f"leaf {j}: {name}.shape={x.shape} must equal p.shape={p.shape} (1-D)")
  programs = sum(leaf.programs for leaf in table)
  sizes = [p.shape[0] for p in ps]
  part = pl.BlockSpec((pl.squeezed,), lambda i: (i,))  # one scalar per program
  kernel = functools.partial(
    moments_kernel,
    table=table,
    block=block_sizes.block,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    clip=clip,
    weak_wd=weak_wd,
  )
  out = _call(
    kernel,
    scalars,
    *ps,
    *gs,
    *ms,
    *vs,
    grid=(programs,),
    in_specs=[_full(NUM_SCALARS)] + [_full(s) for s in sizes] * 4,
    out_specs=[_full(s) for s in sizes] * 2 + [part, part],
    out_shape=[_out_struct(m.shape, m.dtype, m) for m in ms]
    + [_out_struct(v.shape, v.dtype, v) for v in vs]
    + [_out_struct((programs,), jnp.float32, ps[0])] * 2,
    input_output_aliases={
      **{1 + 2 * n + j: j for j in range(n)},
      **{1 + 3 * n + j: n + j for j in range(n)},
    },
    interpret=interpret,
    compiler_params=_compiler_params(block_sizes),
    name="lamb_moments",
  )
  return out[:n], out[n : 2 * n], out[2 * n], out[2 * n + 1]


@functools.partial(
  jax.jit,
  static_argnames=(
    "table",
    "block_sizes",
    "eps",
    "eps_root",
    "g_dtypes",
    "weak_wd",
    "weak_lr",
    "apply",
    "interpret",
  ),
)
def apply_updates(
  scalars,
  ratios,
  ps,
  ms,
  vs,
  *,
  table,
  block_sizes,
  eps,
  eps_root,
  g_dtypes,
  weak_wd,
  weak_lr,
  apply,
  interpret,
):
  """Pass 2 over one bucket of flat leaves: the updates, or the new params with ``apply``."""
  n = len(table)
  sizes = [p.shape[0] for p in ps]
  kernel = functools.partial(
    apply_kernel,
    table=table,
    block=block_sizes.block,
    eps=eps,
    eps_root=eps_root,
    g_dtypes=g_dtypes,
    weak_wd=weak_wd,
    weak_lr=weak_lr,
    apply=apply,
  )
  return _call(
    kernel,
    scalars,
    ratios,
    *ps,
    *ms,
    *vs,
    grid=(sum(leaf.programs for leaf in table),),
    in_specs=[_full(NUM_SCALARS), _full(ratios.shape[0])] + [_full(s) for s in sizes] * 3,
    out_specs=[_full(s) for s in sizes],
    out_shape=[_out_struct(p.shape, p.dtype, p) for p in ps],
    input_output_aliases={2 + j: j for j in range(n)} if apply else {},
    interpret=interpret,
    compiler_params=_compiler_params(block_sizes),
    name="lamb_apply" if apply else "lamb_updates",
  )


# ---------------------------------------------------------------------------- lamb update


def _static_number(x) -> float | None:
  """x if it is a Python number (a compile-time constant of the kernels), else None."""
  return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _is_weak(x) -> bool:
  """Whether x takes the dtype of the array it multiplies (Python scalars, weak tracers)."""
  return jnp.result_type(x, jnp.bfloat16) == jnp.bfloat16


def unsupported_reason(config: _xla.LambConfig, grads, mu, nu, params, block_sizes) -> str | None:
  """Why this call cannot run on the kernels (then it runs on the XLA path), or None."""
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.name not in _HANDLED_OPTIONS and value is not None and value is not False:
      return f"option {field.name}={value!r} is not implemented by the kernels"
  if not _tree.is_axis_name(config.axis_name):
    return "a per-leaf axis_name (the kernels psum every leaf's norms over one set of axes)"
  for g, m, v, p in zip(*(jax.tree.leaves(t) for t in (grads, mu, nu, params)), strict=True):
    if math.prod(jnp.shape(p)) == 0:
      continue
    if jnp.dtype(m.dtype) != jnp.float32 or jnp.dtype(v.dtype) != jnp.float32:
      return (
        f"moments stored as mu={jnp.dtype(m.dtype)}, nu={jnp.dtype(v.dtype)} (the kernel "
        "needs float32 moments)"
      )
    if jnp.dtype(p.dtype) not in _PARAM_DTYPES or jnp.dtype(g.dtype) not in _PARAM_DTYPES:
      return f"param dtype {jnp.dtype(p.dtype)} / grad dtype {jnp.dtype(g.dtype)}"
    if math.prod(jnp.shape(p)) > _INT32_LIMIT - block_sizes.block:
      return f"a leaf of shape {jnp.shape(p)} has 2**31 or more elements"
  return None


def update(
  config: _xla.LambConfig,
  grads: Any,
  state: tuple,
  params: Any,
  *,
  apply: bool = False,
) -> tuple[Any, tuple]:
  """One lamb step on the Pallas kernels; the same contract and state as `_xla.update`."""
  clip_state, adam_state, decay_state, _, lr_state = state
  _tree.check_same_structure(grads, "updates", adam_state.mu, "the optimizer state (mu)")
  block_sizes = BlockSizes.get_default()
  reason = unsupported_reason(config, grads, adam_state.mu, adam_state.nu, params, block_sizes)
  if reason is not None:
    _warn_once(
      reason,
      f"optax_lamb.lamb(implementation='pallas'): {reason}; this step runs on the XLA path.",
    )
    return _xla.update(config, grads, state, params, apply=apply)
  c = config
  interpret = _interpret()
  treedef = jax.tree.structure(params)

  count = optax.safe_increment(adam_state.count)
  bc1, bc2 = _math.bias_corrections(count, c.b1, c.b2, c.bias_correction)
  wd, decay_state = _xla._schedule_value(c.weight_decay, decay_state)
  if callable(c.learning_rate):
    step_size = -1 * c.learning_rate(_xla._schedule_count(lr_state))
    lr_state = _xla._advance_schedule(lr_state)
    weak_lr = True  # the XLA path casts a schedule's value to u's dtype
  else:
    step_size = -1 * c.learning_rate
    weak_lr = _is_weak(step_size)
  weak_wd = _is_weak(wd)
  clip = c.max_grad_norm is not None
  if clip:
    factor = _math.clip_factor(_clipping.global_sq_norm(grads, c.axis_name), c.max_grad_norm)
  else:
    factor = jnp.ones((), jnp.float32)
  # Python numbers stay compile-time constants (None here); arrays go in as runtime scalars.
  static = {k: _static_number(getattr(c, k)) for k in _CONSTANTS}
  constants = [
    jnp.zeros((), jnp.float32) if static[k] is not None else getattr(c, k) for k in _CONSTANTS
  ]
  runtime = (bc1, bc2, wd, step_size, factor, *constants)
  scalars = jnp.stack(
    [jnp.asarray(x, jnp.float32) for x in runtime]
    + [jnp.zeros((), jnp.float32)] * (NUM_SCALARS - len(runtime))
  )

  gs = treedef.flatten_up_to(grads)
  ms = treedef.flatten_up_to(adam_state.mu)
  vs = treedef.flatten_up_to(adam_state.nu)
  ps = treedef.flatten_up_to(params)
  decays = treedef.flatten_up_to(_tree.resolve_per_leaf(c.mask, grads, True))
  adapts = treedef.flatten_up_to(_tree.resolve_per_leaf(c.trust_ratio_mask, params, True))
  axes = treedef.flatten_up_to(_tree.resolve_stacked_axes(c.stacked_axes, params))
  shapes = [tuple(jnp.shape(p)) for p in ps]
  flat = lambda x: jnp.reshape(x, (-1,))

  # Empty leaves (and every output until a bucket fills it in): nothing to compute.
  out = [jnp.zeros(s, p.dtype) if not apply else p for s, p in zip(shapes, ps, strict=True)]
  mu = [m.astype(m.dtype) for m in ms]
  nu = [v.astype(v.dtype) for v in vs]
  ratios = [jnp.ones(s[:k], jnp.float32) for s, k in zip(shapes, axes, strict=True)]

  buckets = leaf_chunks(shapes, axes, adapts, decays, block_sizes)
  bucket = lambda xs, indices: [flat(xs[i]) for i in indices]

  # Pass 1 of every bucket, then the per-slice norms of all adapted leaves in one vector.
  moments, p_sums, u_sums = [], [], []
  for indices, table in buckets:
    m_new, v_new, p_part, u_part = moments_and_norms(
      scalars,
      bucket(ps, indices),
      bucket(gs, indices),
      bucket(ms, indices),
      bucket(vs, indices),
      table=table,
      block_sizes=block_sizes,
      b1=static["b1"],
      b2=static["b2"],
      eps=static["eps"],
      eps_root=static["eps_root"],
      clip=clip,
      weak_wd=weak_wd,
      interpret=interpret,
    )
    moments.append((m_new, v_new))
    for leaf in table:
      if leaf.adapt:
        # Per-slice sums: a slice's chunks are consecutive programs (no scatter, deterministic).
        chunks = slice(leaf.first, leaf.first + leaf.programs)
        p_sums.append(jnp.sum(p_part[chunks].reshape(leaf.slices, leaf.chunks), axis=1))
        u_sums.append(jnp.sum(u_part[chunks].reshape(leaf.slices, leaf.chunks), axis=1))
  if p_sums:
    # One psum for the whole tree (not one per leaf); trust_ratio is elementwise.
    all_ratios = _math.trust_ratio(
      _math.psum_if(jnp.concatenate(p_sums), c.axis_name),
      _math.psum_if(jnp.concatenate(u_sums), c.axis_name),
      min_ratio=c.min_trust_ratio,
      max_ratio=c.max_trust_ratio,
    ).astype(jnp.float32)
  offset = 0

  # Pass 2 of every bucket, with its leaves' ratios.
  for (indices, table), (m_new, v_new) in zip(buckets, moments, strict=True):
    bucket_ratios = []
    for i, leaf in zip(indices, table, strict=True):
      if leaf.adapt:
        ratio = all_ratios[offset : offset + leaf.slices]
        offset += leaf.slices
        ratios[i] = ratio.reshape(shapes[i][: axes[i]])
        bucket_ratios.append(ratio)
    ratio_vector = jnp.concatenate(bucket_ratios or [jnp.ones((1,), jnp.float32)])
    new = apply_updates(
      scalars,
      ratio_vector,
      bucket(ps, indices),
      m_new,
      v_new,
      table=table,
      block_sizes=block_sizes,
      eps=static["eps"],
      eps_root=static["eps_root"],
      g_dtypes=tuple(jnp.dtype(gs[i].dtype) for i in indices),
      weak_wd=weak_wd,
      weak_lr=weak_lr,
      apply=apply,
      interpret=interpret,
    )
    for j, i in enumerate(indices):
      out[i] = new[j].reshape(shapes[i])
      mu[i] = m_new[j].reshape(shapes[i])
      nu[i] = v_new[j].reshape(shapes[i])

  unflatten = functools.partial(jax.tree.unflatten, treedef)
  new_state = (
    clip_state,
    optax.ScaleByAdamState(count=count, mu=unflatten(mu), nu=unflatten(nu)),
    decay_state,
    ScaleByTrustRatioState(ratios=unflatten(ratios)),
    lr_state,
  )
  return unflatten(out), new_state
