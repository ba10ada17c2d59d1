"""timm's ``Lamb``, exactly."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_lamb.compat import _common
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build

_FLAGS = (
  "bias_correction",
  "grad_averaging",
  "trust_clip",
  "always_adapt",
  "caution",
  "decoupled_decay",
  "corrected_weight_decay",
)  # the bool arguments


def _timm_validate(name: str, value: Any, argument: str) -> None:
  """timm's _validate_scalar: a negative value is a ValueError('Invalid <name>: <value>')."""
  if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
    raise ValueError(f"Invalid {name}: {value} ({argument}={value!r}; timm refuses < 0)")


@_common.documented
def timm_lamb(
  lr: optax.ScalarOrSchedule = 1e-3,
  bias_correction: bool = True,
  betas: tuple[float, float] = (0.9, 0.999),
  eps: float = 1e-6,
  weight_decay: float = 0.01,
  grad_averaging: bool = True,
  max_grad_norm: float | None = 1.0,
  trust_clip: bool = False,
  always_adapt: bool = False,
  caution: bool = False,
  decoupled_decay: bool = False,
  corrected_weight_decay: bool = False,
  *,
  weight_decay_mask: PerLeafMask = None,
  base_lr: float | None = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""``timm.optim.Lamb``.

  Source: huggingface/pytorch-image-models at commit
  aa4b5850c1543fa488abf260f18390eda46cf85d (timm 1.0.29), ``timm/optim/lamb.py``
  lines 90-252 and ``timm/optim/_helpers.py`` lines 37-83. Per step:

  .. math::
    g &\leftarrow g / \max(G / c, 1) \quad (c = \mathrm{max\_grad\_norm};\ c = 0: g = 0) \\
    m &\leftarrow b_1 m + b_3 g \quad (b_3 = 1 - b_1, \text{ or } 1 \text{ without
      grad\_averaging}) \\
    v &\leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v} / \sqrt{bc_2} + \epsilon} \\
    u &\leftarrow u \kappa / \max(\mathrm{mean}(\kappa), 10^{-3}), \quad \kappa = [u g > 0]
      \quad \text{(caution only)} \\
    u &\leftarrow u + \lambda p, \text{ or with decoupled\_decay } p \leftarrow p - s \lambda p
      \text{ first} \\
      & \quad (s = \eta_t, \text{ or } \eta_t^2 / \eta_0 \text{ corrected}) \\
    p &\leftarrow p - \eta_t\, r\, u, \quad r = \|p\| / \|u\| \text{ (1 if either is 0;
      trust\_clip: } \min(r, 1))

  A leaf decays where ``weight_decay != 0`` and ``weight_decay_mask`` is True,
  and gets the trust ratio there (everywhere with ``always_adapt``).

  Decisions: timm's ``corrected_weight_decay`` divides by the constructor's lr,
  eta_0, which a torch scheduler then scales: with an optax schedule as ``lr``
  pass that base as ``base_lr`` (a float ``lr`` is its own base). caution's
  mean is over each leaf's elements, or each stacked slice's with
  ``stacked_axes``. ``max_grad_norm=0`` zeroes the gradients as timm does (timm
  gives NaN when every gradient is 0; here they stay 0); a negative one is a
  ValueError.

  Args:
    lr: learning rate eta_t, a float >= 0 or an optax schedule (in place of a torch
      scheduler; read with the 0-based number of past steps).
    bias_correction: divide m and v by 1 - b^t inside u.
    betas: (b1, b2), each in [0, 1).
    eps: added to sqrt(v) / sqrt(bc2), > 0 (0 would give 0 / 0 where g = 0).
    weight_decay: lambda, a number >= 0 or a scalar array (decides which leaves adapt; an
      array, as ``optax.inject_hyperparams`` passes it, at each step).
    grad_averaging: scale g by 1 - b1 in m.
    max_grad_norm: c >= 0, or None: no clipping.
    trust_clip: clamp the trust ratio at 1.
    always_adapt: every leaf adapts, decayed or not.
    caution: timm's cautious update.
    decoupled_decay: shrink p by s lambda p before the step, outside the ratio.
    corrected_weight_decay: s = eta_t^2 / eta_0 instead of eta_t.
    weight_decay_mask: torch's parameter groups, as a pytree prefix of bools
      (``None`` entries count as True) or a callable(params) returning one, like
      :func:`optax_lamb.lamb`'s ``mask``: True where the leaf's group has this
      ``weight_decay``, False where its group has weight decay 0. Such a leaf also gets no trust ratio unless ``always_adapt``, as in timm. None: every leaf.
    base_lr: eta_0 for ``corrected_weight_decay`` with a schedule as ``lr``, or with an
      ``lr`` that ``optax.inject_hyperparams`` changes during the run (without it, the
      injected lr of each step is its own base).
    {lamb_options_and_returns}

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.full(3, 0.5)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> tx = optax_lamb.compat.timm_lamb(  # weight_decay=0.01, clipping at 1.0
    ...   lr=1e-3, weight_decay_mask={"w": True, "b": False})  # b: no decay, no ratio
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> print(round(float(new["w"][0, 0]), 5), round(float(new["b"][0]), 5))
    0.999 0.499
    >>> print({k: round(float(r), 4) for k, r in optax_lamb.trust_ratios(state).items()})
    {'b': 1.0, 'w': 0.9901}
  """
  _timm_validate("learning rate", lr, "lr")
  _timm_validate("epsilon", eps, "eps")
  _timm_validate("weight_decay", weight_decay, "weight_decay")
  decay = _check_args.number("weight_decay", weight_decay)  # None: an array, read each step
  torch_style = _common.check_torch_style(locals(), _FLAGS)
  clip = None if max_grad_norm is None else _common.torch_clip(max_grad_norm, "timm")
  # An array weight decay takes the decoupled placement: where it is 0 the decay is 0 p.
  decoupled = decoupled_decay and (decay is None or decay != 0)
  corrected = decoupled and corrected_weight_decay
  if base_lr is not None:
    if not (callable(lr) or isinstance(lr, jax.Array)):
      raise ValueError(
        f"base_lr is for an lr schedule or an injected (array) lr; a float lr is its own base, "
        f"got lr={lr!r}"
      )
    _check_args.check_positive("base_lr", base_lr)
  elif corrected:
    if callable(lr):
      raise ValueError(
        "corrected_weight_decay=True with an lr schedule needs base_lr: timm divides by the "
        "constructor's lr, which a torch scheduler scales (got base_lr=None)"
      )
    base_lr = lr
  return build(
    **_common.build_args(
      **torch_style,
      **_common.adaptation(always_adapt, decay, torch_style["mask"]),
      weight_decay_placement="params" if decoupled else "direction",
      decay_base_lr=base_lr if corrected else None,
      bias_correction=bias_correction,
      grad_averaging=grad_averaging,
      max_trust_ratio=1.0 if trust_clip else None,
      max_grad_norm=clip,
      caution=caution,
      lamb_options=_common.lamb_options(locals()),
    )
  )
