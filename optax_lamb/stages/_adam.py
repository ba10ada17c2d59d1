"""Stage 1: Adam scaling, with optional bias correction and moment dtypes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from optax_lamb.core import _leaf, _moment_storage, _ratios
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames
from optax_lamb.core._options import LambOptions, Scalar, StepScalars
from optax_lamb.faults import _check_args, _checks


def scale_by_adam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  *,
  bias_correction: bool = True,
  grad_averaging: bool = True,
  mu_dtype: DTypeLike | None = None,
  nu_dtype: DTypeLike | None = None,
) -> optax.GradientTransformation:
  """Rescale updates by Adam's moment estimates: the m, v and u lines of the LAMB update.

  The update is written out once, in :func:`optax_lamb.lamb`; this stage computes
  its moments m, v and the direction u (before the decay term).

  With ``bias_correction=False`` the two corrections are 1, as in Google's
  original LAMB code. With ``grad_averaging=False`` the gradient enters the first
  moment unscaled, m_t = b_1 m_{t-1} + g_t (apex's and timm's switch). Moments are computed in float32 (at least) and stored in
  ``mu_dtype`` / ``nu_dtype`` (default: the param dtype); ``mu_dtype=jnp.int8`` and
  ``nu_dtype=jnp.uint8`` store them 8-bit block-wise quantized (as in :func:`optax_lamb.lamb`,
  docs/quantized_moments.md). The state is
  :class:`optax.ScaleByAdamState`, so ``optax.scale_by_adam`` checkpoints load
  into it and back.

  Args:
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    bias_correction: divide the moments by 1 - b^t.
    grad_averaging: scale the gradient by 1 - b1 in the first moment.
    mu_dtype: storage dtype of the first moment; ``jnp.int8``: 8-bit block-wise quantized.
    nu_dtype: storage dtype of the second moment; ``jnp.uint8``: 8-bit block-wise quantized.

  Returns:
    An :class:`optax.GradientTransformation`.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.scale_by_adam()
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> updates, state = tx.update({"w": jnp.array([1.0, -2.0, 0.5])}, state)
    >>> print([round(x, 4) for x in updates["w"].tolist()])  # step 1: about sign(g)
    [1.0, -1.0, 1.0]
    >>> print(type(state).__name__, state.mu["w"].dtype)
    ScaleByAdamState float32
  """
  mu_dtype, nu_dtype = _check_args.check_adam_args(
    b1, b2, eps, eps_root, bias_correction, grad_averaging, mu_dtype, nu_dtype
  )
  return adam_stage(
    b1,
    b2,
    eps,
    eps_root,
    bias_correction=bias_correction,
    grad_averaging=grad_averaging,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
  )


def adam_stage(
  b1: Scalar,
  b2: Scalar,
  eps: Scalar,
  eps_root: Scalar,
  *,
  bias_correction: bool,
  grad_averaging: bool,
  mu_dtype: np.dtype | None,
  nu_dtype: np.dtype | None,
  caution: bool = False,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
) -> optax.GradientTransformation:
  """:func:`scale_by_adam` with checked arguments, and timm's caution (`optax_lamb.core._leaf.cautious`
  over each leaf's or stacked slice's kept fraction, counted over `axis_name`)."""
  options = LambOptions(grad_averaging=grad_averaging, caution=caution)

  def init_fn(params) -> Any:
    return optax.ScaleByAdamState(
      count=jnp.zeros([], jnp.int32),
      mu=jax.tree.map(lambda p: _moment_storage.init(p, mu_dtype), params),
      nu=jax.tree.map(lambda p: _moment_storage.init(p, nu_dtype), params),
    )

  def update_fn(updates, state, params=None) -> tuple[Any, Any]:
    mu_leaves = _checks.moment_leaves(state.mu)  # a quantized leaf as one (codes, scales)
    _checks.check_same_structure(updates, "updates", mu_leaves, "the optimizer state (mu)")
    count = optax.safe_increment(state.count)
    bc1, bc2 = _leaf.bias_corrections(count, b1, b2, bias_correction)
    s = StepScalars(b1=b1, b2=b2, eps=eps, eps_root=eps_root, bc1=bc1, bc2=bc2)
    treedef: Any = jax.tree.structure(updates)
    gs, ms, vs = (treedef.flatten_up_to(t) for t in (updates, state.mu, state.nu))
    moments = [_leaf.moments(g, m, v, options, s) for g, m, v in zip(gs, ms, vs, strict=True)]
    us = [
      _leaf.adam_direction(m, v, s).astype(g.dtype) for g, (m, v) in zip(gs, moments, strict=True)
    ]
    if caution:
      axes = treedef.flatten_up_to(_checks.resolve_stacked_axes(stacked_axes, params))
      names = _checks.resolve_axis_names(axis_name, params)
      kept = [_ratios.caution_fraction(*x) for x in zip(us, gs, axes, names, strict=True)]
      us = list(map(_leaf.cautious, us, gs, kept))
    store = _moment_storage.store_all  # a leaf's two moments in one pass where both quantize
    stored = [store([m, v], [om, ov]) for (m, v), om, ov in zip(moments, ms, vs, strict=True)]
    mu, nu = (treedef.unflatten([x[i] for x in stored]) for i in (0, 1))
    return treedef.unflatten(us), optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)
