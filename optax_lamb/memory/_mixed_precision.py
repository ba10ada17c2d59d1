"""Float32 master weights for low-precision (bfloat16/float16) parameters."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _nnx
from optax_lamb.faults import _check_args, _checks


class MasterWeightsState(NamedTuple):
  """Full-precision copies of the parameters, and the wrapped optimizer's state.

  Attributes:
    master: a pytree like the params: float32 copies of the low-precision leaves (the
      others as they are); read it with :func:`optax_lamb.master_weights`.
    inner_state: the state of the wrapped transformation, which updates ``master``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax_lamb.with_master_weights(optax.sgd(1e-3))
    >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> print(type(state).__name__, state.master["w"].dtype)
    MasterWeightsState float32
  """

  master: Any
  inner_state: Any


def _master_dtype(dtype, master_dtype) -> jnp.dtype:
  return jnp.promote_types(dtype, master_dtype)


def with_master_weights(
  inner: optax.GradientTransformation, *, dtype: Any = jnp.float32
) -> optax.GradientTransformationExtraArgs:
  r"""Run `inner` on float32 master copies of low-precision parameters.

  The state keeps :math:`P = \mathrm{float32}(p)` at ``init``; each update
  casts the gradients to float32, runs `inner` on :math:`P` (so every LAMB
  formula, the trust-ratio norms included, sees float32 values and a small
  step is never lost to bfloat16 rounding), advances :math:`P \leftarrow P + u`
  and returns, in the params' dtype,

  .. math::
    \Delta = \mathrm{lowp}\big(\mathrm{lowp}(P) - p\big) \quad \text{(difference taken in float32)}

  so that ``optax.apply_updates(params, updates)`` gives ``lowp(P)``, the
  rounded master. This is bit-exact whenever ``lowp(P) - p`` is representable
  in the low dtype, which holds (Sterbenz) whenever the new value lies within a
  factor 2 of the old one with the same sign; an element that moves much closer
  to zero in one step may land within one unit in the last place of ``lowp(P)``.
  The error never accumulates: each update is taken against the params given,
  and the master is the truth. Read it with :func:`master_weights`; for
  bit-exact low-precision params use ``jax.tree.map(lambda m, p: m.astype(p.dtype),
  master_weights(state), params)``.

  Params that already are float32 (or wider) are copied as they are. The master
  is re-read only at ``init``: re-initialize after editing the params outside
  the optimizer.

  Args:
    inner: the transformation to run on the master weights.
    dtype: the master dtype (float32).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with :class:`MasterWeightsState`;
    its updates have the params' dtypes.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> grads = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> for tx in (optax.sgd(1e-3), optax_lamb.with_master_weights(optax.sgd(1e-3))):
    ...   p, state = params, tx.init(params)
    ...   for _ in range(3):  # three steps of 0.001
    ...     updates, state = tx.update(grads, state, p)
    ...     p = optax.apply_updates(p, updates)
    ...   print(p["w"].dtype, [round(x, 4) for x in p["w"].astype(jnp.float32).tolist()])
    bfloat16 [1.0, 1.0, 1.0]
    bfloat16 [0.9961, 0.9961, 0.9961]
    >>> print([round(x, 4) for x in optax_lamb.master_weights(state)["w"].tolist()])
    [0.997, 0.997, 0.997]
  """
  _check_args.check_transformation("inner", inner)
  dtype = _check_args.check_float_dtype("dtype", dtype, optional=False)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params) -> Any:
    master = master_copy(params, dtype)
    return MasterWeightsState(master=master, inner_state=inner.init(master))

  def update_fn(updates, state, params=None, **extra_args) -> tuple[Any, Any]:
    if params is None:
      raise ValueError("with_master_weights needs params: call update(grads, state, params)")
    grads = in_master_dtype(updates, state.master)
    steps, inner_state = inner.update(grads, state.inner_state, state.master, **extra_args)
    master, updates = advanced(state.master, steps, params)
    return updates, MasterWeightsState(master, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def master_copy(params: Any, dtype: Any = jnp.float32) -> Any:
  """The master weights of `params`: a copy in `dtype` (or wider), even for float32 params, so
  the master shares no buffer the caller may donate."""
  return jax.tree.map(
    lambda p: jnp.array(p, _master_dtype(jnp.result_type(p), dtype), copy=True), params
  )


def in_master_dtype(grads: Any, master: Any) -> Any:
  """The gradients cast to their masters' dtypes, which the inner step runs in."""
  return jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)


def advanced(master: Any, steps: Any, params: Any) -> tuple[Any, Any]:
  """(the master after the inner step's `steps`, the params' updates towards it, `delta`):
  what every master-weights step returns (`with_master_weights`, lamb's planned step)."""
  master = optax.apply_updates(master, steps)
  return master, jax.tree.map(delta, master, params)


def delta(m: jax.Array, p: jax.Array) -> jax.Array:
  """The update of a low-precision param `p` towards its master `m`: lowp(lowp(m) - p), the
  difference taken in the master's dtype."""
  target = m.astype(p.dtype).astype(m.dtype)
  return (target - p.astype(m.dtype)).astype(p.dtype)


def master_weights(opt_state: Any) -> Any:
  """The float32 master weights kept by ``lamb(master_weights=True)`` or :func:`with_master_weights`.

  Args:
    opt_state: an optimizer state holding a :class:`MasterWeightsState`.

  Returns:
    A pytree like the params, in float32 (or the params' dtype where wider).

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = optax_lamb.lamb(1e-3, master_weights=True).init(params)
    >>> master = optax_lamb.master_weights(state)
    >>> print(master["w"].dtype, master["w"].tolist())
    float32 [1.0, 1.0, 1.0]
  """
  found = _checks.find_states(
    opt_state,
    MasterWeightsState,
    "No master weights in this optimizer state: build it with "
    "optax_lamb.lamb(..., master_weights=True) or optax_lamb.with_master_weights(tx).",
  )
  return _nnx.plain_values(found[0].master)  # plain arrays from an nnx.Optimizer's state too
