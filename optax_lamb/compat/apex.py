"""apex's ``FusedLAMB``, exactly (the optimizer of NVIDIA's BERT recipe)."""

from __future__ import annotations

import optax

from optax_lamb.compat import _common
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build

_FLAGS = ("bias_correction", "adam_w_mode", "grad_averaging", "use_nvlamb")  # the bool arguments


@_common.documented
def apex_fused_lamb(
  lr: optax.ScalarOrSchedule = 1e-3,
  bias_correction: bool = True,
  betas: tuple[float, float] = (0.9, 0.999),
  eps: float = 1e-6,
  weight_decay: float = 0.01,
  amsgrad: bool = False,
  adam_w_mode: bool = True,
  grad_averaging: bool = True,
  max_grad_norm: float = 1.0,
  use_nvlamb: bool = False,
  *,
  weight_decay_mask: PerLeafMask = None,
  set_grad_none: bool = True,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""``apex.optimizers.FusedLAMB``, the optimizer of NVIDIA's BERT recipe.

  Source: NVIDIA/apex at commit 6424da3b4faa6c8f062da4a48c424fff3f02d42d,
  ``apex/optimizers/fused_lamb.py`` lines 63-244 and ``csrc/multi_tensor_lamb.cu``
  lines 38-319. Per step, with G the global norm of all gradients:

  .. math::
    g &\leftarrow g \min(1, c / G) \quad (c = \mathrm{max\_grad\_norm};\ c = 0: g = 0) \\
    g &\leftarrow g + \lambda p \quad (\text{adam\_w\_mode=False: L2, decayed leaves}) \\
    m &\leftarrow b_1 m + b_3 g \quad (b_3 = 1 - b_1, \text{ or } 1 \text{ without grad\_averaging}) \\
    v &\leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon} \; (+ \lambda p \text{ with adam\_w\_mode,
      decayed leaves}) \\
    p &\leftarrow p - \eta\, r\, u, \quad r = \|p\| / \|u\| \text{ (1 if either is 0)}

  A leaf gets the trust ratio only where its group's weight decay is not 0
  (``weight_decay != 0`` and ``weight_decay_mask`` True), or everywhere with
  ``use_nvlamb``; elsewhere r = 1. A weight decay given as an array (as
  ``optax.inject_hyperparams`` passes it) decides this at each step.

  Args:
    lr: learning rate, a float >= 0 or an optax schedule (in place of a torch scheduler;
      read with the 0-based number of past steps).
    bias_correction: divide m and v by 1 - b^t inside u.
    betas: (b1, b2), each in [0, 1).
    eps: added to sqrt(v / bc2).
    weight_decay: lambda, a number >= 0 or a scalar array (decides which leaves adapt).
    amsgrad: apex refuses True (RuntimeError), and so does this.
    adam_w_mode: True: decay inside u (AdamW style); False: L2 added to the
      clipped gradient before the moments.
    grad_averaging: scale g by 1 - b1 in m.
    max_grad_norm: c, a number >= 0 or a scalar array; 0 zeroes every gradient as apex does.
      ``None`` is a TypeError (apex fails with one in its kernel call); a
      negative c (apex: every gradient's sign flipped) is a ValueError.
    use_nvlamb: every leaf adapts, decayed or not.
    weight_decay_mask: torch's parameter groups, as a pytree prefix of bools
      (``None`` entries count as True) or a callable(params) returning one, like
      :func:`optax_lamb.lamb`'s ``mask``: True where the leaf's group has this
      ``weight_decay``, False where its group has weight decay 0. Such a leaf also gets no trust ratio unless ``use_nvlamb``, as in apex. None: every leaf.
    set_grad_none: accepted and ignored (apex zeroes torch gradient buffers with it).
    {lamb_options_and_returns}

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.full(3, 0.5)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> tx = optax_lamb.compat.apex_fused_lamb(  # b: not decayed, so no trust ratio
    ...   lr=1e-3, weight_decay=0.01, weight_decay_mask={"w": True, "b": False})
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> print(round(float(new["w"][0, 0]), 5), round(float(new["b"][0]), 5))
    0.999 0.499
    >>> print({k: round(float(r), 4) for k, r in optax_lamb.trust_ratios(state).items()})
    {'b': 1.0, 'w': 0.9901}
  """
  del set_grad_none
  if amsgrad:
    raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
  if max_grad_norm is None:
    raise TypeError("max_grad_norm must be a number (apex's kernel needs one), got None")
  decay = _check_args.number("weight_decay", weight_decay)  # None: an array, read each step
  torch_style = _common.check_torch_style(locals(), _FLAGS)
  return build(
    **_common.build_args(
      **torch_style,
      **_common.adaptation(use_nvlamb, decay, torch_style["mask"]),
      weight_decay_placement="direction" if adam_w_mode else "gradient",
      bias_correction=bias_correction,
      grad_averaging=grad_averaging,
      max_grad_norm=_common.torch_clip(max_grad_norm, "apex"),
      lamb_options=_common.lamb_options(locals()),
    )
  )
