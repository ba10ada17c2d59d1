"""Faults: unscaling loss-scaled gradients, and skipping steps whose gradients are not finite."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _checks, _math, _tree


class SkipNonFiniteState(NamedTuple):
  """Skip counters (int32) and the wrapped optimizer's state."""

  total: jax.Array
  consecutive: jax.Array
  inner_state: Any


class SkipCounts(NamedTuple):
  """Steps skipped for non-finite gradients: in all, and in a row up to the last update."""

  total: jax.Array
  consecutive: jax.Array


class UnscaleGradientsState(NamedTuple):
  """Number of updates seen, the argument of a ``grad_scale`` schedule."""

  count: jax.Array


def unscale(grads: Any, grad_scale: Any) -> Any:
  """Divide every gradient by `grad_scale` in float32 (at least).

  Low-precision gradients come back in float32: a loss-scaled float16 gradient
  holds values that underflow in float16 once unscaled.
  """
  scale = jnp.asarray(grad_scale)

  def leaf(g):
    dtype = _math.compute_dtype(g.dtype)
    return g.astype(dtype) / scale.astype(dtype)

  return jax.tree.map(leaf, grads)


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
  """True when no leaf of `tree` holds a NaN or an Inf; agreed over `axis_name` if given.

  `axis_name` may be per leaf (as in :func:`optax_lamb.lamb`): the count is summed
  over every axis any leaf is sharded on, so all devices take the same decision.
  """
  bad = sum(
    (jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in jax.tree.leaves(tree)),
    jnp.zeros((), jnp.int32),
  )
  names = set()
  for name in _tree.resolve_axis_names(axis_name, tree):
    names.update((name,) if isinstance(name, str) else (name or ()))
  return _math.psum_if(bad, tuple(sorted(names)) or None) == 0


def unscale_gradients(grad_scale: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Divide the gradients by a loss scale: :math:`g \leftarrow g / s`.

  Put it first in a chain so that clipping, finiteness checks and the moments
  see the true gradient. The scale comes from the factory argument (a float, an
  array, or a schedule ``count -> scale`` evaluated on the number of updates so
  far), or from the ``grad_scale=`` keyword of ``update`` for a dynamic loss
  scaler such as ``jmp.DynamicLossScale`` (pass its ``loss_scale``). Giving both
  is an error. With neither, gradients pass through unchanged. Low-precision
  gradients are returned in float32.

  Args:
    grad_scale: ``None``, a positive float, a scalar array, or a schedule.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; its state is
    :class:`UnscaleGradientsState` for a schedule, :class:`optax.EmptyState` otherwise.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax.chain(optax_lamb.unscale_gradients(), optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> updates, state = tx.update({"w": jnp.ones(2) * 1024.0}, state, grad_scale=1024.0)
  """
  check_grad_scale(grad_scale)
  is_schedule = callable(grad_scale)

  def init_fn(params):
    del params
    if is_schedule:
      return UnscaleGradientsState(count=jnp.zeros([], jnp.int32))
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params
    scale, state = resolve_grad_scale(grad_scale, state, extra_args.get("grad_scale"))
    if scale is not None:
      updates = unscale(updates, scale)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_grad_scale(grad_scale: Any) -> None:
  if grad_scale is not None and not callable(grad_scale):
    _checks.check_positive("grad_scale", grad_scale)


def resolve_grad_scale(built: Any, state: Any, given: Any) -> tuple[Any, Any]:
  """The scale to divide by this step (or None), and the next unscale state."""
  check_grad_scale(given)
  if given is not None and built is not None:
    raise ValueError(
      "grad_scale was given both when building the optimizer and to update(); give it "
      f"in one place only (got grad_scale={given!r} at update)."
    )
  if callable(built):
    return built(state.count), UnscaleGradientsState(count=optax.safe_increment(state.count))
  return (given if given is not None else built), state


def skip_nonfinite(
  inner: optax.GradientTransformation, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
  """Skip every step whose gradients hold a NaN or an Inf.

  On such a step the updates are zero and the wrapped state is returned as it
  was (moments, step count, trust ratios, master weights), so the parameters do
  not change; :class:`SkipNonFiniteState` counts the skipped steps, in total and
  in a row (read them with :func:`skip_counts`). The branch is a
  :func:`jax.lax.cond`, so it jits, and ``optax.MultiSteps`` around it skips an
  accumulated step that one bad micro-batch poisoned.

  Unlike :func:`optax.apply_if_finite` there is no limit after which NaNs are
  let through: watch ``skip_counts(state).consecutive`` and stop the run (or
  lower the loss scale) yourself.

  Args:
    inner: the transformation to protect.
    axis_name: mapped axis name(s) the gradients are sharded over (``shard_map``),
      so that every device agrees on skipping.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with :class:`SkipNonFiniteState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zero = jnp.zeros([], jnp.int32)
    return SkipNonFiniteState(total=zero, consecutive=zero, inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    finite = all_finite(updates, axis_name)
    arrays = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array)}
    others = {k: v for k, v in extra_args.items() if not isinstance(v, jax.Array)}

    def apply(updates, inner_state, params, arrays):
      return inner.update(updates, inner_state, params, **arrays, **others)

    def skip(updates, inner_state, params, arrays):
      out, _ = jax.eval_shape(apply, updates, inner_state, params, arrays)
      return optax.tree.zeros_like(out), inner_state

    new_updates, inner_state = jax.lax.cond(
      finite, apply, skip, updates, state.inner_state, params, arrays
    )
    return new_updates, SkipNonFiniteState(
      total=jnp.where(finite, state.total, optax.safe_increment(state.total)),
      consecutive=jnp.where(finite, 0, optax.safe_increment(state.consecutive)),
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skip_counts(opt_state: Any) -> SkipCounts:
  """Steps skipped for non-finite gradients, read from any optimizer state.

  Searches any nesting of ``chain``, ``MultiSteps`` and ``inject_hyperparams``
  states for a :class:`SkipNonFiniteState` (``lamb(skip_nonfinite=True)`` or
  :func:`skip_nonfinite`).

  Args:
    opt_state: the state of an optimizer built with ``skip_nonfinite``.

  Returns:
    :class:`SkipCounts` ``(total, consecutive)`` as int32 scalars.
  """
  found = _tree.find_states(
    opt_state,
    SkipNonFiniteState,
    "No skip_nonfinite stage in this optimizer state: build it with "
    "optax_lamb.lamb(..., skip_nonfinite=True) or optax_lamb.skip_nonfinite(tx).",
  )
  return SkipCounts(total=found[0].total, consecutive=found[0].consecutive)


def with_unscaling(
  inner: optax.GradientTransformation, grad_scale: Any = None
) -> optax.GradientTransformationExtraArgs:
  """Divide the gradients by `grad_scale` (or update's ``grad_scale=``) before `inner`.

  The state is `inner`'s own unless `grad_scale` is a schedule; then it is the
  pair ``(UnscaleGradientsState, inner_state)``.
  """
  check_grad_scale(grad_scale)
  inner = optax.with_extra_args_support(inner)

  def unscaled(updates, state, extra_args):
    scale, state = resolve_grad_scale(grad_scale, state, extra_args.pop("grad_scale", None))
    return (updates if scale is None else unscale(updates, scale)), state

  if not callable(grad_scale):

    def update_fn(updates, state, params=None, **extra_args):
      updates, _ = unscaled(updates, None, extra_args)
      return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)

  def init_fn(params):
    return UnscaleGradientsState(count=jnp.zeros([], jnp.int32)), inner.init(params)

  def schedule_update_fn(updates, state, params=None, **extra_args):
    updates, scale_state = unscaled(updates, state[0], extra_args)
    updates, inner_state = inner.update(updates, state[1], params, **extra_args)
    return updates, (scale_state, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, schedule_update_fn)
