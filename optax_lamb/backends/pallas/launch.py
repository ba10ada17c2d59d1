"""The ``pallas_call`` of each kernel: operands, block specs, in-place aliases, Triton parameters.

Each leaf is its own 1-D operand (nothing is packed into flat buffers), seen
whole by every program, which reads its chunk with masked loads. Outputs that
overwrite an input (m', v', and p under ``update_and_apply``) are aliased to
it, so a donated step updates them in place.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from optax_lamb.backends.pallas import kernels
from optax_lamb.backends.pallas.chunks import programs

# The Pallas Triton backend is deprecated from jax 0.11 but still works (docs/KERNELS.md).
_TRITON_DEPRECATION = r"(?is).*triton.*"


def _whole(n: int) -> pl.BlockSpec:
  """The whole 1-D operand in every program; the kernel indexes it with masked loads."""
  return pl.BlockSpec((n,), lambda i: (0,))


def _one_per_program() -> pl.BlockSpec:
  return pl.BlockSpec((pl.squeezed,), lambda i: (i,))


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


def _call(kernel, operands, *, block_sizes, interpret, **kwargs):
  """pl.pallas_call(kernel, ...)(*operands) on Triton, without its DeprecationWarning."""
  # Explicit Triton parameters: with None, jax 0.9-0.11 would pick Mosaic GPU (docs/KERNELS.md).
  params = plt.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kwargs)(*operands)


_STATIC = ("table", "block_sizes", "constants", "clip", "interpret")


def _bucket_kernel(kernel, *, table, block_sizes, constants, clip, **static):
  """`kernel` with the static arguments of one launch over a bucket of leaves."""
  return functools.partial(
    kernel, table=table, block=block_sizes.block, constants=constants, clip=clip, **static
  )


@functools.partial(jax.jit, static_argnames=_STATIC)
def moments_and_norms(scalars, ps, gs, ms, vs, *, table, block_sizes, constants, clip, interpret):
  """Pass 1 over one bucket: (m's and v's of the `pass1_outputs` leaves, p partials, u partials)."""
  for name, xs in (("g", gs), ("m", ms), ("v", vs)):
    for j, (x, p) in enumerate(zip(xs, ps, strict=True)):
      if x.shape != p.shape or x.ndim != 1:
        raise ValueError(f"leaf {j}: {name}.shape={x.shape} must equal p.shape={p.shape} (1-D)")
  n, writers = len(table), kernels.pass1_outputs(table)
  count = programs(table)
  partial = _out_struct((count,), jnp.float32, ps[0])
  out = _call(
    _bucket_kernel(
      kernels.moments_and_norms_kernel,
      table=table,
      block_sizes=block_sizes,
      constants=constants,
      clip=clip,
    ),
    (scalars, *ps, *gs, *ms, *vs),
    block_sizes=block_sizes,
    interpret=interpret,
    grid=(count,),
    in_specs=[_whole(kernels.NUM_SCALARS)] + [_whole(p.shape[0]) for p in ps] * 4,
    out_specs=[_whole(ps[j].shape[0]) for j in writers for _ in "mv"] + [_one_per_program()] * 2,
    out_shape=[_out_struct(x[j].shape, x[j].dtype, x[j]) for j in writers for x in (ms, vs)]
    + [partial, partial],
    # operand 0 is the scalars, then p, g, m, v of each leaf: m_j is 1 + 2n + j, v_j 1 + 3n + j
    input_output_aliases={
      1 + k * n + j: 2 * w + (k - 2) for w, j in enumerate(writers) for k in (2, 3)
    },
    name="lamb_moments_and_norms",
  )
  new = out[: 2 * len(writers)]
  return new[0::2], new[1::2], out[-2], out[-1]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def slice_sums(starts, counts, p_part, u_part, *, block_sizes, interpret):
  """(||p||^2, ||u||^2) per ratio slot from the concatenated partial sums of pass 1."""
  slots = starts.shape[0]
  out = _out_struct((slots,), jnp.float32, p_part)
  return _call(
    functools.partial(kernels.slice_sums_kernel, size=block_sizes.sum_block),
    (starts, counts, p_part, u_part),
    block_sizes=block_sizes,
    interpret=interpret,
    grid=(slots,),
    in_specs=[_whole(slots)] * 2 + [_whole(p_part.shape[0])] * 2,
    out_specs=[_one_per_program()] * 2,
    out_shape=[out, out],
    name="lamb_slice_sums",
  )


def slot_table(starts: list[int], counts: list[int]) -> tuple[jax.Array, jax.Array]:
  """The slice-sum kernel's (starts, counts) operands: constants of the step."""
  return jnp.asarray(np.asarray(starts, np.int32)), jnp.asarray(np.asarray(counts, np.int32))


@functools.partial(jax.jit, static_argnames=(*_STATIC, "apply"))
def updates(scalars, ratios, operands, *, table, block_sizes, constants, clip, apply, interpret):
  """Pass 2 over one bucket: per leaf the updates (or new params with `apply`), and m', v'.

  `operands`: per leaf, {name: flat array} for the names of `kernels.pass2_operands`.
  Returns per leaf {name: flat array} for its output names.
  """
  in_names, out_names = kernels.pass2_operands(table)
  flat_in = [operands[j][name] for j, names in enumerate(in_names) for name in names]
  like = {"out": "p", "m": "m", "v": "v"}
  flat_out = [operands[j][like[name]] for j, names in enumerate(out_names) for name in names]
  # In place: new params over p (with `apply`), m', v' over m, v. Operands 0, 1: scalars, ratios.
  position = {(j, name): 2 + i for i, (j, name) in enumerate(_pairs(in_names))}
  aliases = {}
  for i, (j, name) in enumerate(_pairs(out_names)):
    if name != "out" or apply:
      aliases[position[(j, like[name])]] = i
  result = _call(
    _bucket_kernel(
      kernels.update_kernel,
      table=table,
      block_sizes=block_sizes,
      constants=constants,
      clip=clip,
      apply=apply,
    ),
    (scalars, ratios, *flat_in),
    block_sizes=block_sizes,
    interpret=interpret,
    grid=(programs(table),),
    in_specs=[_whole(kernels.NUM_SCALARS), _whole(ratios.shape[0])]
    + [_whole(x.shape[0]) for x in flat_in],
    out_specs=[_whole(x.shape[0]) for x in flat_out],
    out_shape=[_out_struct(x.shape, x.dtype, x) for x in flat_out],
    input_output_aliases=aliases,
    name="lamb_apply" if apply else "lamb_updates",
  )
  out = [{} for _ in table]
  for x, (j, name) in zip(result, _pairs(out_names), strict=True):
    out[j][name] = x
  return out


def _pairs(names_per_leaf) -> list[tuple[int, str]]:
  return [(j, name) for j, names in enumerate(names_per_leaf) for name in names]
