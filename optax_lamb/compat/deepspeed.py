"""DeepSpeed's ``FusedLamb``, exactly."""

from __future__ import annotations

import math

import optax

from optax_lamb.compat import _common
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build

_FLAGS = ("eps_inside_sqrt", "bias_correction")  # the bool arguments

DEEPSPEED_CLIP_EPS = 1e-6  # added to the gradient norm before it is compared with max_grad_norm


@_common.documented
def deepspeed_fused_lamb(
  lr: optax.ScalarOrSchedule = 1e-3,
  bias_correction: bool = True,
  betas: tuple[float, float] = (0.9, 0.999),
  eps: float = 1e-8,
  eps_inside_sqrt: bool = False,
  weight_decay: float = 0.0,
  max_grad_norm: float = 0.0,
  max_coeff: float = 10.0,
  min_coeff: float = 0.01,
  amsgrad: bool = False,
  *,
  weight_decay_mask: PerLeafMask = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""``deepspeed.ops.lamb.FusedLamb``.

  Source: deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641,
  ``deepspeed/ops/lamb/fused_lamb.py`` lines 41-170 and
  ``csrc/lamb/fused_lamb_cuda_kernel.cu`` lines 194-370. Per step:

  .. math::
    g &\leftarrow g \cdot c / (G + 10^{-6}) \quad \text{when } G + 10^{-6} > c > 0 \\
    m &\leftarrow b_1 m + (1 - b_1) g \quad \text{(no bias correction inside u)} \\
    v &\leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= m / (\sqrt{v} + \epsilon) + \lambda p \quad (\text{eps\_inside\_sqrt: }
      m / \sqrt{v + \epsilon}) \\
    r &= \max(\min(\|p\| / \|u\|, \text{max\_coeff}), \text{min\_coeff})
      \quad (1, \text{unclamped, if a norm is } 0) \\
    p &\leftarrow p - \eta \sqrt{bc_2} / bc_1 \, r\, u \quad (\eta \text{ without bias\_correction})

  Every leaf adapts, decayed or not.

  Decisions: G is the global norm of all gradients, as in DeepSpeed's engine:
  with fp16 on it wraps LAMB in ``FP16_UnfusedOptimizer``, which clips with the
  global norm (through the ``scale`` it passes to ``FusedLamb.step``) and passes
  no ``grad_norms`` (``deepspeed/runtime/fp16/unfused_optimizer.py``,
  ``step_fused_lamb``). Called directly, ``FusedLamb`` divides by the norm its
  caller passes to ``step(grad_norms=...)``. With ``min_coeff > max_coeff`` DeepSpeed's clamps (max
  first, then min) give r = min_coeff, and so does this. A negative
  ``min_coeff`` clamps nothing, as in DeepSpeed; a negative ``max_coeff``
  (negative ratios) is refused with a ValueError.

  Args:
    lr: learning rate, a float >= 0 or an optax schedule (in place of a torch scheduler;
      read with the 0-based number of past steps).
    bias_correction: multiply the step size by sqrt(1 - b2^t) / (1 - b1^t).
    betas: (b1, b2), each in [0, 1).
    eps: added to sqrt(v), or inside it with ``eps_inside_sqrt``.
    eps_inside_sqrt: u = m / sqrt(v + eps).
    weight_decay: lambda >= 0, added to u on decayed leaves.
    max_grad_norm: c; 0 or less: no clipping (a scalar array: decided at each step).
    max_coeff: upper clamp of the trust ratio (``inf``: none).
    min_coeff: lower clamp of the trust ratio.
    amsgrad: DeepSpeed refuses True (RuntimeError), and so does this.
    {torch_groups}
    {lamb_options_and_returns}

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.full(3, 0.5)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> tx = optax_lamb.compat.deepspeed_fused_lamb(lr=1e-3, weight_decay=0.01)
    >>> # bias correction on the step: 1e-3 * sqrt(1 - 0.999) / (1 - 0.9) = 3.2e-4
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> print(round(float(new["w"][0, 0]), 5), round(float(new["b"][0]), 5))
    0.99968 0.49984
    >>> print({k: round(float(r), 4) for k, r in optax_lamb.trust_ratios(state).items()})
    {'b': 0.1579, 'w': 0.3152}
  """
  if amsgrad:
    raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
  torch_style = _common.check_torch_style(locals(), _FLAGS)
  clip = _check_args.number("max_grad_norm", max_grad_norm)  # each None: an array
  if clip is not None and math.isnan(clip):
    raise ValueError(f"max_grad_norm must be a number, got max_grad_norm={max_grad_norm!r}")
  high, low = _check_args.number("max_coeff", max_coeff), _check_args.number("min_coeff", min_coeff)
  if high is not None and not high >= 0.0:
    raise ValueError(f"max_coeff must be >= 0 (r > 0), got max_coeff={max_coeff!r}")
  if low is not None and not -math.inf < low < math.inf:
    raise ValueError(f"min_coeff must be a finite number, got min_coeff={min_coeff!r}")
  min_ratio, max_ratio = _common.ratio_clamps(max_coeff, high, min_coeff, low)
  return build(
    **_common.build_args(
      **{**torch_style, "eps": 0.0 if eps_inside_sqrt else eps},
      eps_root=eps if eps_inside_sqrt else 0.0,
      bias_correction=bias_correction,
      bias_correction_placement="step_size",
      min_trust_ratio=min_ratio,
      max_trust_ratio=max_ratio,
      max_grad_norm=_common.positive_or_off(max_grad_norm, clip),
      clip_norm_eps=DEEPSPEED_CLIP_EPS,
      lamb_options=_common.lamb_options(locals()),
    )
  )
