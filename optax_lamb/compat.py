"""Other libraries' LAMB, exactly: one constructor per library, with its argument names and defaults.

Each constructor returns an Optax transformation built on the same core as
:func:`optax_lamb.lamb` (so every ``implementation``, ``update_and_apply``,
``trust_ratios``, ``axis_name`` and checkpointing work with it) that computes
what that library computes. ``docs/which_lamb.md`` tabulates where the LAMBs
differ; each docstring here cites the source it follows.

=========================  ==========================================================
constructor                library
=========================  ==========================================================
``apex_fused_lamb``        ``apex.optimizers.FusedLAMB`` (the NVIDIA BERT recipe's)
``deepspeed_fused_lamb``   ``deepspeed.ops.lamb.FusedLamb``
``timm_lamb``              ``timm.optim.Lamb``
``torch_optimizer_lamb``   ``torch_optimizer.Lamb``
``keras_lamb``             ``keras.optimizers.Lamb`` (Keras 3)
``tfa_lamb``               ``tensorflow_addons.optimizers.LAMB``
=========================  ==========================================================

Shared rules:

* torch parameter groups map to ``weight_decay_mask``: a pytree prefix of bools
  (``None`` entries count as True) or a callable(params) returning one, like
  ``lamb``'s ``mask``. True where the leaf's group has the constructor's
  ``weight_decay``, False where the group has weight decay 0, with that
  library's consequences (apex and timm then give the leaf no trust ratio).
* A learning rate may be an optax schedule (count -> value) in place of a torch
  scheduler writing ``group['lr']`` or a Keras ``LearningRateSchedule``; both are
  read with the 0-based number of past steps.
* One step count for the whole tree. The torch libraries count per group or
  per parameter; in JAX every leaf has a gradient at every step, so the counts agree.
* An argument the library does not have is a ``TypeError`` (Python's own for
  an unexpected keyword); a value the library refuses is refused with the
  library's exception class, unless stated otherwise. The core's own limits
  also apply (a finite learning rate >= 0, decays in [0, 1)).
* Keyword-only extras of every constructor, as in :func:`optax_lamb.lamb`:
  ``stacked_axes`` (one trust ratio per stacked layer: what a torch model with
  one tensor per layer computes), ``axis_name``, ``implementation``,
  ``skip_nonfinite``, ``grad_scale``, ``master_weights``.

Example:
  >>> import jax.numpy as jnp, optax_lamb
  >>> params = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
  >>> tx = optax_lamb.compat.apex_fused_lamb(lr=1e-3, weight_decay=0.01,
  ...                                        weight_decay_mask={"w": True, "b": False})
  >>> state = tx.init(params)
"""

from __future__ import annotations

import math
from typing import Any

from optax_lamb import _check_args
from optax_lamb._compat_args import (
  check_betas,
  check_mask,
  check_number,
  keras_clipping,
  make,
  regex_mask,
)

__all__ = (
  "apex_fused_lamb",
  "deepspeed_fused_lamb",
  "keras_lamb",
  "tfa_lamb",
  "timm_lamb",
  "torch_optimizer_lamb",
)

_NO_LEAF = False  # a trust_ratio_mask prefix that matches every leaf: no leaf adapts


def _extras(stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights):
  return dict(
    stacked_axes=stacked_axes,
    axis_name=axis_name,
    implementation=implementation,
    skip_nonfinite=skip_nonfinite,
    grad_scale=grad_scale,
    master_weights=master_weights,
  )


def _adapted_unless_undecayed(always: bool, weight_decay: float, weight_decay_mask: Any) -> Any:
  """apex and timm: a leaf adapts iff its group's weight decay is not 0, or always."""
  if always:
    return None
  return weight_decay_mask if weight_decay != 0 else _NO_LEAF


def _torch_clip(max_grad_norm: Any, library: str) -> float | None:
  """apex's and timm's max_grad_norm: g / max(G / c, 1); 0 zeroes every gradient; inf: none."""
  value = check_number("max_grad_norm", max_grad_norm)
  if not value >= 0.0:
    raise ValueError(
      f"max_grad_norm must be a number >= 0 (0 zeroes every gradient, as {library} does; a "
      f"negative threshold, which would flip the gradients' signs, is refused), got "
      f"max_grad_norm={max_grad_norm!r}"
    )
  return None if value == math.inf else value


def apex_fused_lamb(
  lr: Any = 1e-3,
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
  weight_decay_mask: Any = None,
  set_grad_none: bool = True,
  stacked_axes: Any = None,
  axis_name: Any = None,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
):
  r"""``apex.optimizers.FusedLAMB``, the optimizer of NVIDIA's BERT recipe.

  Source: NVIDIA/apex at commit 6424da3b4faa6c8f062da4a48c424fff3f02d42d,
  ``apex/optimizers/fused_lamb.py`` lines 63-244 and ``csrc/multi_tensor_lamb.cu``
  lines 38-319. Per step, with G the global norm of all gradients:

  .. math::
    g &\leftarrow g \min(1, c / G) \quad (c = \mathrm{max\_grad\_norm};\ c = 0: g = 0) \\
    g &\leftarrow g + \lambda p \quad (\text{adam\_w\_mode=False: L2, decayed leaves}) \\
    m &\leftarrow b_1 m + b_3 g \quad (b_3 = 1 - b_1, \text{ or } 1 \text{ without grad\_averaging}),
      \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon} \; (+ \lambda p \text{ with adam\_w\_mode,
      decayed leaves}) \\
    p &\leftarrow p - \eta\, r\, u, \quad r = \|p\| / \|u\| \text{ (1 if either is 0)}

  A leaf gets the trust ratio only where its group's weight decay is not 0
  (``weight_decay != 0`` and ``weight_decay_mask`` True), or everywhere with
  ``use_nvlamb``; elsewhere r = 1.

  Args:
    lr: learning rate, a float >= 0 or an optax schedule.
    bias_correction: divide m and v by 1 - b^t inside u.
    betas: (b1, b2), each in [0, 1).
    eps: added to sqrt(v / bc2).
    weight_decay: lambda, a number >= 0 (decides which leaves adapt when built).
    amsgrad: apex refuses True (RuntimeError), and so does this.
    adam_w_mode: True: decay inside u (AdamW style); False: L2 added to the
      clipped gradient before the moments.
    grad_averaging: scale g by 1 - b1 in m.
    max_grad_norm: c, a number >= 0; 0 zeroes every gradient as apex does.
      ``None`` is a TypeError (apex fails with one in its kernel call); a
      negative c (apex: every gradient's sign flipped) is a ValueError.
    use_nvlamb: every leaf adapts, decayed or not.
    weight_decay_mask: torch's parameter groups (see the module docstring).
    set_grad_none: accepted and ignored (apex zeroes torch gradient buffers with it).
    stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale,
      master_weights: as in :func:`optax_lamb.lamb`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.
  """
  del set_grad_none
  if amsgrad:
    raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
  if max_grad_norm is None:
    raise TypeError("max_grad_norm must be a number (apex's kernel needs one), got None")
  b1, b2 = check_betas("betas", betas)
  _check_args.check_non_negative("eps", eps)
  weight_decay = check_number("weight_decay", weight_decay)
  _check_args.check_non_negative("weight_decay", weight_decay)
  for name, flag in (
    ("bias_correction", bias_correction),
    ("adam_w_mode", adam_w_mode),
    ("grad_averaging", grad_averaging),
    ("use_nvlamb", use_nvlamb),
  ):
    _check_args.check_bool(name, flag)
  check_mask("weight_decay_mask", weight_decay_mask)
  return make(
    learning_rate=lr,
    learning_rate_name="lr",
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=weight_decay,
    mask=weight_decay_mask,
    weight_decay_placement="direction" if adam_w_mode else "gradient",
    bias_correction=bias_correction,
    grad_averaging=grad_averaging,
    trust_ratio_mask=_adapted_unless_undecayed(use_nvlamb, weight_decay, weight_decay_mask),
    max_grad_norm=_torch_clip(max_grad_norm, "apex"),
    extras=_extras(
      stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights
    ),
  )


DEEPSPEED_CLIP_EPS = 1e-6  # added to the gradient norm before it is compared with max_grad_norm


def deepspeed_fused_lamb(
  lr: Any = 1e-3,
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
  weight_decay_mask: Any = None,
  stacked_axes: Any = None,
  axis_name: Any = None,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
):
  r"""``deepspeed.ops.lamb.FusedLamb``.

  Source: deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641,
  ``deepspeed/ops/lamb/fused_lamb.py`` lines 41-170 and
  ``csrc/lamb/fused_lamb_cuda_kernel.cu`` lines 194-370. Per step:

  .. math::
    g &\leftarrow g \cdot c / (G + 10^{-6}) \quad \text{when } G + 10^{-6} > c > 0 \\
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2
      \quad \text{(no bias correction inside u)} \\
    u &= m / (\sqrt{v} + \epsilon) + \lambda p \quad (\text{eps\_inside\_sqrt: }
      m / \sqrt{v + \epsilon}) \\
    r &= \max(\min(\|p\| / \|u\|, \text{max\_coeff}), \text{min\_coeff}) \quad
      (1, \text{unclamped, if either norm is } 0) \\
    p &\leftarrow p - \eta \sqrt{bc_2} / bc_1 \, r\, u \quad (\eta \text{ without bias\_correction})

  Every leaf adapts, decayed or not.

  Decisions: G is the global norm of all gradients (DeepSpeed divides by the
  norm its caller passes to ``step(grad_norms=...)``; its FP16 wrapper passes
  per-group norms). With ``min_coeff > max_coeff`` DeepSpeed's clamps (max
  first, then min) give r = min_coeff, and so does this. A negative
  ``min_coeff`` clamps nothing, as in DeepSpeed; a negative ``max_coeff``
  (negative ratios) is refused with a ValueError.

  Args:
    lr: learning rate, a float >= 0 or an optax schedule.
    bias_correction: multiply the step size by sqrt(1 - b2^t) / (1 - b1^t).
    betas: (b1, b2), each in [0, 1).
    eps: added to sqrt(v), or inside it with ``eps_inside_sqrt``.
    eps_inside_sqrt: u = m / sqrt(v + eps).
    weight_decay: lambda >= 0, added to u on decayed leaves.
    max_grad_norm: c; 0 or less: no clipping.
    max_coeff: upper clamp of the trust ratio (``inf``: none).
    min_coeff: lower clamp of the trust ratio.
    amsgrad: DeepSpeed refuses True (RuntimeError), and so does this.
    weight_decay_mask: torch's parameter groups (see the module docstring).
    stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale,
      master_weights: as in :func:`optax_lamb.lamb`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.
  """
  if amsgrad:
    raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
  b1, b2 = check_betas("betas", betas)
  _check_args.check_non_negative("eps", eps)
  _check_args.check_bool("eps_inside_sqrt", eps_inside_sqrt)
  _check_args.check_bool("bias_correction", bias_correction)
  _check_args.check_non_negative("weight_decay", weight_decay)
  clip = check_number("max_grad_norm", max_grad_norm)
  if math.isnan(clip):
    raise ValueError(f"max_grad_norm must be a number, got max_grad_norm={max_grad_norm!r}")
  high, low = check_number("max_coeff", max_coeff), check_number("min_coeff", min_coeff)
  if not high >= 0.0:
    raise ValueError(f"max_coeff must be >= 0 (r > 0), got max_coeff={max_coeff!r}")
  if not -math.inf < low < math.inf:
    raise ValueError(f"min_coeff must be a finite number, got min_coeff={min_coeff!r}")
  high = max(high, low)  # min_coeff > max_coeff: DeepSpeed clamps with max, then min: r = min_coeff
  check_mask("weight_decay_mask", weight_decay_mask)
  return make(
    learning_rate=lr,
    learning_rate_name="lr",
    b1=b1,
    b2=b2,
    eps=0.0 if eps_inside_sqrt else eps,
    eps_root=eps if eps_inside_sqrt else 0.0,
    weight_decay=weight_decay,
    mask=weight_decay_mask,
    bias_correction=bias_correction,
    bias_correction_placement="step_size",
    min_trust_ratio=low if low > 0 else None,
    max_trust_ratio=None if high == math.inf else high,
    max_grad_norm=clip if clip > 0 else None,
    clip_norm_eps=DEEPSPEED_CLIP_EPS,
    extras=_extras(
      stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights
    ),
  )


def _timm_validate(name: str, value: Any, argument: str) -> None:
  """timm's _validate_scalar: a negative value is a ValueError('Invalid <name>: <value>')."""
  if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
    raise ValueError(f"Invalid {name}: {value} ({argument}={value!r}; timm refuses < 0)")


def timm_lamb(
  lr: Any = 1e-3,
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
  weight_decay_mask: Any = None,
  base_lr: float | None = None,
  stacked_axes: Any = None,
  axis_name: Any = None,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
):
  r"""``timm.optim.Lamb``.

  Source: huggingface/pytorch-image-models at commit
  aa4b5850c1543fa488abf260f18390eda46cf85d (timm 1.0.29), ``timm/optim/lamb.py``
  lines 90-252 and ``timm/optim/_helpers.py`` lines 37-83. Per step:

  .. math::
    g &\leftarrow g / \max(G / c, 1) \quad (c = \mathrm{max\_grad\_norm};\ c = 0: g = 0) \\
    m &\leftarrow b_1 m + b_3 g \quad (b_3 = 1 - b_1, \text{ or } 1 \text{ without
      grad\_averaging}), \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v} / \sqrt{bc_2} + \epsilon}; \quad \text{caution: }
      \kappa = [u g > 0],\ u \leftarrow u \kappa / \max(\mathrm{mean}(\kappa), 10^{-3}) \\
    u &\leftarrow u + \lambda p, \text{ or with decoupled\_decay } p \leftarrow p - s \lambda p
      \text{ first } (s = \eta_t, \text{ or } \eta_t^2 / \eta_0 \text{ corrected}) \\
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
    lr: learning rate eta_t, a float >= 0 or an optax schedule.
    bias_correction: divide m and v by 1 - b^t inside u.
    betas: (b1, b2), each in [0, 1).
    eps: added to sqrt(v) / sqrt(bc2), >= 0.
    weight_decay: lambda, a number >= 0 (decides which leaves adapt when built).
    grad_averaging: scale g by 1 - b1 in m.
    max_grad_norm: c >= 0, or None: no clipping.
    trust_clip: clamp the trust ratio at 1.
    always_adapt: every leaf adapts, decayed or not.
    caution: timm's cautious update.
    decoupled_decay: shrink p by s lambda p before the step, outside the ratio.
    corrected_weight_decay: s = eta_t^2 / eta_0 instead of eta_t.
    weight_decay_mask: torch's parameter groups (see the module docstring).
    base_lr: eta_0 for ``corrected_weight_decay`` with a schedule as ``lr``.
    stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale,
      master_weights: as in :func:`optax_lamb.lamb`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.
  """
  _timm_validate("learning rate", lr, "lr")
  _timm_validate("epsilon", eps, "eps")
  _timm_validate("weight_decay", weight_decay, "weight_decay")
  b1, b2 = check_betas("betas", betas)
  _check_args.check_non_negative("eps", eps)
  weight_decay = check_number("weight_decay", weight_decay)
  _check_args.check_non_negative("weight_decay", weight_decay)
  for name, flag in (
    ("bias_correction", bias_correction),
    ("grad_averaging", grad_averaging),
    ("trust_clip", trust_clip),
    ("always_adapt", always_adapt),
    ("caution", caution),
    ("decoupled_decay", decoupled_decay),
    ("corrected_weight_decay", corrected_weight_decay),
  ):
    _check_args.check_bool(name, flag)
  check_mask("weight_decay_mask", weight_decay_mask)
  clip = None if max_grad_norm is None else _torch_clip(max_grad_norm, "timm")
  decoupled = decoupled_decay and weight_decay != 0
  corrected = decoupled and corrected_weight_decay
  if base_lr is not None:
    if not callable(lr):
      raise ValueError(f"base_lr is for an lr schedule; a float lr is its own base, got lr={lr!r}")
    _check_args.check_positive("base_lr", base_lr)
  elif corrected:
    if callable(lr):
      raise ValueError(
        "corrected_weight_decay=True with an lr schedule needs base_lr: timm divides by the "
        "constructor's lr, which a torch scheduler scales (got base_lr=None)"
      )
    base_lr = lr
  return make(
    learning_rate=lr,
    learning_rate_name="lr",
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=weight_decay,
    mask=weight_decay_mask,
    weight_decay_placement="params" if decoupled else "direction",
    decay_base_lr=base_lr if corrected else None,
    bias_correction=bias_correction,
    grad_averaging=grad_averaging,
    trust_ratio_mask=_adapted_unless_undecayed(always_adapt, weight_decay, weight_decay_mask),
    max_trust_ratio=1.0 if trust_clip else None,
    max_grad_norm=clip,
    caution=caution,
    extras=_extras(
      stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights
    ),
  )


def torch_optimizer_lamb(
  lr: Any = 1e-3,
  betas: tuple[float, float] = (0.9, 0.999),
  eps: float = 1e-6,
  weight_decay: float = 0,
  clamp_value: float = 10,
  adam: bool = False,
  debias: bool = False,
  *,
  weight_decay_mask: Any = None,
  stacked_axes: Any = None,
  axis_name: Any = None,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
):
  r"""``torch_optimizer.Lamb`` (pytorch-optimizer).

  Source: jettify/pytorch-optimizer at commit 51e361cb881eda64b4142a315c9529a9ac9950ae
  (release 0.3.0), ``torch_optimizer/lamb.py`` lines 45-158. Per step:

  .. math::
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2
      \quad \text{(no clipping; no bias correction inside u)} \\
    u &= m / (\sqrt{v} + \epsilon) + \lambda p \quad (\text{decayed leaves}) \\
    r &= \min(\|p\|, \text{clamp\_value}) / \|u\| \quad (1 \text{ if either is 0; adam: } r = 1) \\
    p &\leftarrow p - \eta \sqrt{bc_2} / bc_1\, r\, u \quad (\eta \text{ without debias})

  Every leaf adapts unless ``adam``. ``clamp_value=0`` makes every ratio 1.

  Args:
    lr: learning rate, a float > 0 (torch_optimizer refuses <= 0) or an optax schedule.
    betas: (b1, b2), each in [0, 1) (ValueError otherwise, as torch_optimizer).
    eps: added to sqrt(v), >= 0.
    weight_decay: lambda >= 0, added to u on decayed leaves.
    clamp_value: upper clamp of ||p|| in the ratio, >= 0 (``inf``: none).
    adam: no trust ratio (r = 1 for every leaf).
    debias: multiply the step size by sqrt(1 - b2^t) / (1 - b1^t).
    weight_decay_mask: torch's parameter groups (see the module docstring).
    stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale,
      master_weights: as in :func:`optax_lamb.lamb`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.
  """
  if not callable(lr) and _is_number(lr) and not lr > 0.0:
    raise ValueError(f"Invalid learning rate: {lr} (lr={lr!r}; torch_optimizer needs lr > 0)")
  if _is_number(eps) and not eps >= 0.0:
    raise ValueError(f"Invalid epsilon value: {eps} (eps={eps!r})")
  for i in range(2):
    beta = betas[i] if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
    if _is_number(beta) and not 0.0 <= beta < 1.0:
      raise ValueError(f"Invalid beta parameter at index {i}: {beta} (betas={betas!r})")
  if _is_number(weight_decay) and not weight_decay >= 0:
    raise ValueError(f"Invalid weight_decay value: {weight_decay} (weight_decay={weight_decay!r})")
  clamp = check_number("clamp_value", clamp_value)
  if not clamp >= 0.0:
    raise ValueError(f"Invalid clamp value: {clamp_value} (clamp_value={clamp_value!r})")
  b1, b2 = check_betas("betas", betas)
  _check_args.check_non_negative("eps", eps)
  _check_args.check_non_negative("weight_decay", weight_decay)
  _check_args.check_bool("adam", adam)
  _check_args.check_bool("debias", debias)
  check_mask("weight_decay_mask", weight_decay_mask)
  return make(
    learning_rate=lr,
    learning_rate_name="lr",
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=weight_decay,
    mask=weight_decay_mask,
    bias_correction=debias,
    bias_correction_placement="step_size",
    trust_ratio_mask=_NO_LEAF if adam else None,
    max_param_norm=None if clamp == math.inf else clamp,
    extras=_extras(
      stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights
    ),
  )


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _keras_clip_options(clipnorm, clipvalue, global_clipnorm) -> dict:
  """Keras 3: at most one clip option (ValueError); one that is not > 0 clips nothing."""
  given = {"clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm}
  for name, value in given.items():
    if value is not None:
      check_number(name, value)
  if sum(v is not None for v in given.values()) > 1:
    raise ValueError(
      "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
      f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
    )
  return {
    name: (value if value is not None and value > 0 else None) for name, value in given.items()
  }


def keras_lamb(
  learning_rate: Any = 0.001,
  beta_1: float = 0.9,
  beta_2: float = 0.999,
  epsilon: float = 1e-7,
  weight_decay: float | None = None,
  *,
  weight_decay_mask: Any = None,
  clipnorm: float | None = None,
  clipvalue: float | None = None,
  global_clipnorm: float | None = None,
  stacked_axes: Any = None,
  axis_name: Any = None,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
):
  r"""``keras.optimizers.Lamb`` (Keras 3).

  Source: keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60 (Keras
  3.15.1), ``keras/src/optimizers/lamb.py`` lines 38-132 and
  ``keras/src/optimizers/base_optimizer.py`` lines 68-193, 466-959 and 1108-1197.
  Per step, with eta_t the learning rate at the 0-based step count:

  .. math::
    p &\leftarrow p - \eta_t \lambda p \quad \text{(decayed leaves, before the update: outside
      the ratio)} \\
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon}, \qquad
    p \leftarrow p - \eta_t\, r\, u, \quad r = \|p\| / \|u\| \text{ (the decayed p; 1 if
      either is 0)}

  Every leaf adapts. At most one of Keras' gradient clips acts first:
  ``global_clipnorm`` (g min(1, c / G)), ``clipnorm`` (per leaf, g c / max(||g||, c))
  or ``clipvalue`` (clip(g, -c, c)); one that is not > 0 clips nothing, as in Keras.
  The bias corrections take b^t in float32, as Keras does for float32 variables.

  Decisions and differences: ``weight_decay_mask`` replaces
  ``exclude_from_weight_decay(var_list, var_names)`` (Keras matches var_names
  against the variable's own name, the last path component). An unknown
  keyword is a TypeError here, a ValueError in Keras. Keras' EMA, loss scaling
  and gradient accumulation (``use_ema``, ``loss_scale_factor``,
  ``gradient_accumulation_steps``) are not arguments here: use ``optax.ema``,
  ``grad_scale`` and ``optax.MultiSteps``.

  Args:
    learning_rate: a float >= 0, an optax schedule or a scalar array; an int is a
      ValueError, as in Keras.
    beta_1: b1 in [0, 1).
    beta_2: b2 in [0, 1).
    epsilon: added to sqrt(v / bc2), >= 0.
    weight_decay: lambda >= 0, or None: no decay.
    weight_decay_mask: which leaves decay (see the module docstring); None: all.
    clipnorm: per-leaf clip threshold.
    clipvalue: elementwise clip threshold.
    global_clipnorm: global-norm clip threshold.
    stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale,
      master_weights: as in :func:`optax_lamb.lamb`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.
  """
  if isinstance(learning_rate, (bool, int)):
    raise ValueError(
      "Argument `learning_rate` should be float, or an instance of LearningRateSchedule, or a "
      f"callable. Received instead: learning_rate={learning_rate}"
    )
  clips = _keras_clip_options(clipnorm, clipvalue, global_clipnorm)
  _check_args.check_in_unit_interval("beta_1", beta_1)
  _check_args.check_in_unit_interval("beta_2", beta_2)
  _check_args.check_non_negative("epsilon", epsilon)
  if weight_decay is not None:
    _check_args.check_non_negative("weight_decay", weight_decay)
  check_mask("weight_decay_mask", weight_decay_mask)
  return make(
    learning_rate=learning_rate,
    learning_rate_name="learning_rate",
    b1=beta_1,
    b2=beta_2,
    eps=epsilon,
    weight_decay=0.0 if weight_decay is None else weight_decay,
    mask=weight_decay_mask,
    weight_decay_placement="params",
    bias_correction=True,
    max_grad_norm=clips["global_clipnorm"],
    grad_transform=keras_clipping(clips["clipnorm"], clips["clipvalue"], axis_name),
    extras=_extras(
      stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights
    ),
  )


def _inverse_time_decay(learning_rate: Any, decay: float):
  """Keras 2's legacy ``decay``: lr_t = learning_rate(count) / (1 + decay count)."""
  if not decay > 0:
    return learning_rate
  value = lambda count: learning_rate(count) if callable(learning_rate) else learning_rate
  return lambda count: value(count) / (1.0 + decay * count)


def tfa_lamb(
  learning_rate: Any = 0.001,
  beta_1: float = 0.9,
  beta_2: float = 0.999,
  epsilon: float = 1e-6,
  weight_decay: float = 0.0,
  exclude_from_weight_decay: list[str] | None = None,
  exclude_from_layer_adaptation: list[str] | None = None,
  *,
  lr: Any = None,
  decay: float = 0.0,
  clipnorm: float | None = None,
  clipvalue: float | None = None,
  global_clipnorm: float | None = None,
  stacked_axes: Any = None,
  axis_name: Any = None,
  implementation: Any = "auto",
  skip_nonfinite: bool = False,
  grad_scale: Any = None,
  master_weights: bool = False,
):
  r"""``tensorflow_addons.optimizers.LAMB`` (TF Addons 0.23.0, Keras 2.15's legacy optimizer).

  Source: tensorflow/addons at commit d208d75 (0.23.0),
  ``tensorflow_addons/optimizers/lamb.py`` lines 40-254, on keras-team/keras 2.15
  ``keras/optimizers/legacy/optimizer_v2.py`` lines 371-443, 554-566 and 1183-1193.
  Per step, with eta_t = learning_rate(count) / (1 + decay count):

  .. math::
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon} + \lambda p \quad (\text{leaves not
      excluded from weight decay}) \\
    p &\leftarrow p - \eta_t\, r\, u, \quad r = \|p\| / \|u\| \text{ (1 if either is 0, and
      on leaves excluded from layer adaptation)}

  The exclusions are lists of regexes ``re.search``'ed in each leaf's path, its
  keys joined by '/' (``{'dense': {'bias': b}}``: 'dense/bias').
  ``exclude_from_layer_adaptation`` None or empty takes the weight-decay list.
  Clips, in TF's order: ``clipvalue``, then ``clipnorm`` (per leaf), then
  ``global_clipnorm``; ``lr`` is TF's old name of ``learning_rate`` (it wins
  when given), ``decay`` its inverse-time decay of the learning rate.

  Decisions and differences: TF matches the regexes against the variable name
  'dense/bias:0', here against 'dense/bias'; a pattern anchored with '$'
  ('bias$'), which never matches in TF, matches here. ``epsilon`` 0 or None
  fails in TF Addons with an AttributeError (it reaches for Keras' backend
  epsilon); here it is a ValueError. TF's ``name`` and ``weight_decay_rate``
  (old name of weight_decay) are not arguments here.

  Args:
    learning_rate: a float >= 0, an optax schedule or a scalar array.
    beta_1: b1 in [0, 1).
    beta_2: b2 in [0, 1).
    epsilon: added to sqrt(v / bc2), > 0.
    weight_decay: lambda >= 0.
    exclude_from_weight_decay: regexes of the paths that do not decay.
    exclude_from_layer_adaptation: regexes of the paths that get no trust ratio.
    lr: the old name of learning_rate, >= 0.
    decay: inverse-time decay of the learning rate, >= 0.
    clipnorm: per-leaf clip threshold, >= 0 (not with global_clipnorm).
    clipvalue: elementwise clip threshold, >= 0.
    global_clipnorm: global-norm clip threshold, >= 0.
    stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale,
      master_weights: as in :func:`optax_lamb.lamb`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with ``lamb``'s state.
  """
  keywords = {"clipnorm": clipnorm, "clipvalue": clipvalue, "lr": lr, "decay": decay}
  keywords["global_clipnorm"] = global_clipnorm
  for name, value in keywords.items():
    if _is_number(value) and value < 0:
      raise ValueError(f"Expected {name} >= 0, received: {value}")
  if clipnorm is not None and global_clipnorm is not None:
    raise ValueError("Cannot accept both `clipnorm` and `global_clipnorm`.")
  if epsilon is None or (_is_number(epsilon) and epsilon == 0):
    raise ValueError(
      f"epsilon must be > 0: TF Addons falls back to Keras' backend epsilon for "
      f"epsilon={epsilon!r} and fails (AttributeError), got epsilon={epsilon!r}"
    )
  for name, patterns in (
    ("exclude_from_weight_decay", exclude_from_weight_decay),
    ("exclude_from_layer_adaptation", exclude_from_layer_adaptation),
  ):
    if patterns is not None and (
      isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns)
    ):
      raise TypeError(f"{name} must be None or a list of regexes (str), got {name}={patterns!r}")
  _check_args.check_in_unit_interval("beta_1", beta_1)
  _check_args.check_in_unit_interval("beta_2", beta_2)
  _check_args.check_non_negative("epsilon", epsilon)
  _check_args.check_non_negative("weight_decay", weight_decay)
  check_number("decay", decay)
  learning_rate = learning_rate if lr is None else lr
  _check_args.check_non_negative(
    "lr" if lr is not None else "learning_rate", learning_rate, schedule=True
  )
  return make(
    learning_rate=_inverse_time_decay(learning_rate, decay),
    learning_rate_name="learning_rate",
    b1=beta_1,
    b2=beta_2,
    eps=epsilon,
    weight_decay=weight_decay,
    mask=regex_mask(exclude_from_weight_decay),
    bias_correction=True,
    trust_ratio_mask=regex_mask(exclude_from_layer_adaptation or exclude_from_weight_decay),
    max_grad_norm=global_clipnorm,
    grad_transform=keras_clipping(clipnorm, clipvalue, axis_name),
    extras=_extras(
      stacked_axes, axis_name, implementation, skip_nonfinite, grad_scale, master_weights
    ),
  )
