"""Loss scaling: gradients divided by a loss scale before anything else sees them."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb.core import _leaf, _options
from optax_lamb.core._options import Scalar
from optax_lamb.faults import _check_args


class UnscaleGradientsState(NamedTuple):
  """Number of updates seen, the argument of a ``grad_scale`` schedule.

  Attributes:
    count: int32 scalar, the number of updates taken so far.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax_lamb.unscale_gradients(optax.constant_schedule(1024.0))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> updates, state = tx.update({"w": jnp.full(2, 2048.0)}, state)
    >>> print(updates["w"].tolist(), int(state.count), state.count.dtype)
    [2.0, 2.0] 1 int32
  """

  count: jax.Array  # type: ignore[assignment]  # as optax's count states (shadows tuple.count)


def unscale(grads: Any, grad_scale: Scalar) -> Any:
  """Divide every gradient by `grad_scale` in float32 (at least) (`optax_lamb.core._leaf.unscale`).

  Low-precision gradients come back in float32: a loss-scaled float16 gradient
  holds values that underflow in float16 once unscaled.
  """
  return jax.tree.map(lambda g: _leaf.unscale(g, grad_scale), grads)


def divided(grads: Any, built: Any, given: Any, state: Any) -> tuple[Any, Any]:
  """(`grads` divided by this step's loss scale, the scale's state after it): the scale fixed
  when built (`built`: a number, an array or a schedule read at ``state.count``) or `given` to
  update (checked here), or none. The one division by the loss scale: :func:`unscale_gradients`
  and the prologue of lamb and the compat constructors."""
  given = None if given is None else given_scale(given)
  scale, state = _options.grad_scale_at_step(built, given, state)
  return (grads if scale is None else unscale(grads, scale)), state


def given_scale(given: Any) -> Any:
  """The scale passed as ``update(..., grad_scale=s)``, checked: the gradients that update
  receives are multiplied by it."""
  check_grad_scale(given)
  return given


def unscale_gradients(
  grad_scale: optax.ScalarOrSchedule | None = None, *, from_update: bool = False
) -> optax.GradientTransformationExtraArgs:
  r"""Divide the gradients by a loss scale: :math:`g \leftarrow g / s`.

  Put it first in a chain so that clipping, finiteness checks and the moments
  see the true gradient. The scale comes from the factory argument (a float, an
  array, or a schedule ``count -> scale`` evaluated on the number of updates so
  far) or, with ``from_update=True``, from the ``grad_scale=`` keyword of ``update``
  for a dynamic loss scaler such as ``jmp.DynamicLossScale`` (pass its
  ``loss_scale``). Giving both is an error. With neither, gradients pass through
  unchanged. Low-precision gradients are returned in float32.

  Who divides by ``update(..., grad_scale=s)``: ``optax.chain`` hands every extra
  argument to every stage, so exactly one kind of stage reads it. optax_lamb's
  optimizers (:func:`optax_lamb.lamb`, the ``optax_lamb.compat`` constructors) and
  :func:`optax_lamb.skip_nonfinite`'s spike rule always take their gradients as
  multiplied by it; this stage divides by it only when built with
  ``from_update=True``, for chains of other optimizers (``optax.sgd``,
  ``optax.adamw``, ...). So ``optax.chain(unscale_gradients(), optax_lamb.lamb(...))``
  divides once (lamb does), as ``lamb`` alone does; ``from_update=True`` before an
  optax_lamb optimizer would divide twice. A scale given when a stage is built is
  that stage's own and always divides.

  Args:
    grad_scale: ``None``, a positive float, a scalar array, or a schedule.
    from_update: divide by the ``grad_scale=`` passed to ``update`` (only where no
      optax_lamb optimizer after this stage reads it).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; its state is
    :class:`UnscaleGradientsState` for a schedule, :class:`optax.EmptyState` otherwise.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax.chain(optax_lamb.unscale_gradients(from_update=True), optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> updates, state = tx.update({"w": jnp.ones(2) * 1024.0}, state, grad_scale=1024.0)
    >>> print([round(x, 4) for x in updates["w"].tolist()])  # -0.1 * 1024 / 1024
    [-0.1, -0.1]
  """
  check_grad_scale(grad_scale)
  if not isinstance(from_update, bool):
    raise TypeError(f"from_update must be a bool, got from_update={from_update!r}")
  if from_update and grad_scale is not None:
    raise ValueError(
      "unscale_gradients: give the scale when built (grad_scale) or pass it to update "
      f"(from_update=True), not both; got grad_scale={grad_scale!r} and from_update=True"
    )
  is_schedule = callable(grad_scale)
  grad_scale = _check_args.scalar_valued(grad_scale, "grad_scale")

  def init_fn(params) -> Any:
    del params
    if is_schedule:
      return UnscaleGradientsState(count=jnp.zeros([], jnp.int32))
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args) -> tuple[Any, Any]:
    del params
    given = extra_args.get("grad_scale") if from_update else None  # else the optimizer's
    return divided(updates, grad_scale, given, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_grad_scale(grad_scale: Any) -> None:
  if grad_scale is not None:
    _check_args.check_positive("grad_scale", grad_scale, schedule=True)
