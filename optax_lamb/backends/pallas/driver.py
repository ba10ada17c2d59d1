"""One lamb step on the Pallas kernels, and what they support.

The step, from the plan (`optax_lamb._plan`), for the tree's leaves:

1. pass 1 (`moments_and_norms`) over the adapted leaves, in buckets: m', v'
   in place where the moments are float32, and per-chunk partial sums;
2. one `slice_sums` launch for the whole tree: ||p||^2 and ||u||^2 per leaf
   (or stacked slice); then in XLA, one ``psum`` per mapped axis name and the
   trust ratios (`_math.trust_ratio`): the state's ratio vector;
3. pass 2: `update_kernel` in buckets, or, for large leaves in ``tx.update``,
   the same math as one XLA computation per leaf, which XLA fuses with the
   caller's ``optax.apply_updates``.

Leaves without layer adaptation skip pass 1: pass 2 does them in one pass from
g, m, v. Where the moments are stored narrower than float32, pass 1 only reads
and pass 2 recomputes them from g and the old moments, so the update uses the
unrounded moments, as the XLA path and optax do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb import _math
from optax_lamb._plan import StepPlan
from optax_lamb.backends.pallas import chunks, kernels, launch

_PARAM_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported_reason(grads: list, mu: list, nu: list, params: list) -> str | None:
  """Why the kernels cannot take these leaves (then the step runs on the XLA path), or None."""
  block = chunks.BlockSizes.get_default().block
  for g, m, v, p in zip(grads, mu, nu, params, strict=True):
    if math.prod(jnp.shape(p)) == 0:
      continue
    dtypes = {"param": p.dtype, "mu": m.dtype, "nu": v.dtype}
    for name, dtype in dtypes.items():
      if jnp.dtype(dtype) not in _PARAM_DTYPES:
        return f"{name} dtype {jnp.dtype(dtype)} (the kernels take float32, bfloat16, float16)"
    if jnp.dtype(g.dtype) != jnp.float32:
      return f"gradient dtype {jnp.dtype(g.dtype)} (the kernels take float32 gradients)"
    if math.prod(jnp.shape(p)) > chunks.INT32_LIMIT - block:
      return f"a leaf of shape {jnp.shape(p)} has 2**31 or more elements (int32 offsets)"
  return None


def _scalars(plan: StepPlan) -> kernels.StepScalars:
  """The step's scalars for the kernels: Python numbers kept, arrays as float32."""
  c = plan.config
  clip_factor = 1.0 if plan.clip_factor is None else plan.clip_factor
  values = (plan.bc1, plan.bc2, plan.weight_decay, plan.step_size, clip_factor)
  values += (c.b1, c.b2, c.eps, c.eps_root)
  return kernels.StepScalars(
    *(x if isinstance(x, (int, float)) else jnp.asarray(x, jnp.float32) for x in values)
  )


def _psum_slots(x: jax.Array, slot_names: list) -> jax.Array:
  """Sum each slot over its leaf's mapped axes: one psum per distinct axis name."""
  names = list(dict.fromkeys(slot_names))
  if len(names) == 1:
    return _math.psum_if(x, names[0])
  total = jnp.zeros_like(x)
  for name in names:
    part = jnp.where(np.array([n == name for n in slot_names]), x, 0.0)
    total = total + _math.psum_if(part, name)
  return total


def _ratios(plan, leaves, tables, p_parts, u_parts, sizes, interpret) -> jax.Array:
  """The ratio vector: per slot of the adapted leaves their trust ratio, 1 elsewhere."""
  slots = plan.layout.size
  if not tables:
    return jnp.ones((slots,), jnp.float32)
  starts, counts = chunks.slice_ranges(tables, slots)
  p_sq, u_sq = launch.slice_sums(
    *launch.slot_table(starts, counts),
    jnp.concatenate(p_parts),
    jnp.concatenate(u_parts),
    block_sizes=sizes,
    interpret=interpret,
  )
  adapted, names = np.zeros(slots, bool), [None] * slots
  for leaf, opts in zip(leaves, plan.leaves, strict=True):
    span = slice(leaf.ratio_offset, leaf.ratio_offset + leaf.slices)
    adapted[span] = leaf.adapt
    names[span] = [opts.axis_name] * leaf.slices
  ratio = _math.trust_ratio(
    _psum_slots(p_sq, names),
    _psum_slots(u_sq, names),
    min_ratio=plan.config.min_trust_ratio,
    max_ratio=plan.config.max_trust_ratio,
  )
  return jnp.where(adapted, ratio.astype(jnp.float32), 1.0)


def step(
  plan: StepPlan, grads: list, mu: list, nu: list, params: list, *, apply: bool
) -> tuple[list, list, list, jax.Array]:
  """One lamb step on flat lists of leaves; the same contract as `backends.xla.step`."""
  sizes, interpret = chunks.BlockSizes.get_default(), chunks.interpret()
  s = _scalars(plan)
  static = dict(constants=s.constants(), clip=plan.clip_factor is not None, interpret=interpret)
  shapes = [tuple(jnp.shape(p)) for p in params]
  narrow = [jnp.dtype(m.dtype) != jnp.float32 or jnp.dtype(v.dtype) != jnp.float32
            for m, v in zip(mu, nu, strict=True)]  # fmt: skip
  leaves = chunks.leaf_plans(
    shapes,
    [o.stacked_axes for o in plan.leaves],
    [o.adapt for o in plan.leaves],
    [o.decay for o in plan.leaves],
    narrow,
    [o.ratio_offset for o in plan.leaves],
  )
  flat = lambda x: jnp.reshape(x, (-1,))
  scalars = s.runtime()

  # Pass 1 over the adapted leaves; m', v' of the float32-moment leaves replace mu, nu.
  new_mu, new_nu = list(mu), list(nu)
  tables = chunks.buckets([leaf for leaf in leaves if leaf.adapt], sizes)
  p_parts, u_parts = [], []
  for table in tables:
    picked = [c.leaf.index for c in table]
    m_new, v_new, p_part, u_part = launch.moments_and_norms(
      scalars,
      *([flat(x[i]) for i in picked] for x in (params, grads, mu, nu)),
      table=table,
      block_sizes=sizes,
      **static,
    )
    for w, j in enumerate(kernels.pass1_outputs(table)):
      i = table[j].leaf.index
      new_mu[i], new_nu[i] = m_new[w].reshape(shapes[i]), v_new[w].reshape(shapes[i])
    p_parts.append(p_part)
    u_parts.append(u_part)
  ratios = _ratios(plan, leaves, tables, p_parts, u_parts, sizes, interpret)

  # Pass 2: the moments it reads are the new ones, or the old ones and g (`from_grads`).
  def pass2_inputs(leaf):
    i = leaf.index
    if leaf.from_grads:
      return {"p": params[i], "m": mu[i], "v": nu[i], "g": grads[i]}
    return {"p": params[i], "m": new_mu[i], "v": new_nu[i]}

  out = [p if apply else jnp.zeros(shape, p.dtype) for p, shape in zip(params, shapes, strict=True)]
  in_xla = lambda leaf: not apply and leaf.size >= sizes.xla_pass2_min_size
  for leaf in leaves:
    if leaf.size and in_xla(leaf):
      x = pass2_inputs(leaf)
      i = leaf.index
      out[i], new_mu[i], new_nu[i] = kernels.update_reference(
        s, leaf, x["p"], x["m"], x["v"], x.get("g"), ratios, clip=static["clip"], apply=False
      )
  for table in chunks.buckets([leaf for leaf in leaves if not in_xla(leaf)], sizes):
    operands = [{k: flat(x) for k, x in pass2_inputs(c.leaf).items()} for c in table]
    results = launch.updates(
      scalars, ratios, operands, table=table, block_sizes=sizes, apply=apply, **static
    )
    for c, result in zip(table, results, strict=True):
      i = c.leaf.index
      out[i] = result["out"].reshape(shapes[i])
      if c.leaf.from_grads:
        new_mu[i], new_nu[i] = result["m"].reshape(shapes[i]), result["v"].reshape(shapes[i])
  return out, new_mu, new_nu, ratios
