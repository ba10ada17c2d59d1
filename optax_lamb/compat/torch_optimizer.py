"""torch_optimizer's ``Lamb``, exactly."""

from __future__ import annotations

import math

import optax

from optax_lamb.compat import _common
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build

_FLAGS = ("adam", "debias")  # the bool arguments


@_common.documented
def torch_optimizer_lamb(
  lr: optax.ScalarOrSchedule = 1e-3,
  betas: tuple[float, float] = (0.9, 0.999),
  eps: float = 1e-6,
  weight_decay: float = 0,
  clamp_value: float = 10,
  adam: bool = False,
  debias: bool = False,
  *,
  weight_decay_mask: PerLeafMask = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""``torch_optimizer.Lamb`` (pytorch-optimizer).

  Source: jettify/pytorch-optimizer at commit 51e361cb881eda64b4142a315c9529a9ac9950ae
  (release 0.3.0), ``torch_optimizer/lamb.py`` lines 45-158. Per step:

  .. math::
    m &\leftarrow b_1 m + (1 - b_1) g \quad \text{(no clipping; no bias correction inside u)} \\
    v &\leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= m / (\sqrt{v} + \epsilon) + \lambda p \quad (\text{decayed leaves}) \\
    r &= \min(\|p\|, \text{clamp\_value}) / \|u\| \quad (1 \text{ if either is 0; adam: } r = 1) \\
    p &\leftarrow p - \eta \sqrt{bc_2} / bc_1\, r\, u \quad (\eta \text{ without debias})

  Every leaf adapts unless ``adam``. ``clamp_value=0`` makes every ratio 1.

  Args:
    lr: learning rate, a float > 0 (torch_optimizer refuses <= 0) or an optax schedule.
    betas: (b1, b2), each in [0, 1) (ValueError otherwise, as torch_optimizer).
    eps: added to sqrt(v), > 0 (0 would give 0 / 0 where g = 0).
    weight_decay: lambda >= 0, added to u on decayed leaves.
    clamp_value: upper clamp of ||p|| in the ratio, >= 0 (``inf``: none), or a scalar array.
    adam: no trust ratio (r = 1 for every leaf).
    debias: multiply the step size by sqrt(1 - b2^t) / (1 - b1^t).
    {torch_groups}
    {lamb_options_and_returns}

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.full(3, 0.5)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> # no bias correction by default
    >>> tx = optax_lamb.compat.torch_optimizer_lamb(lr=1e-3, weight_decay=0.01)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> print(round(float(new["w"][0, 0]), 5), round(float(new["b"][0]), 5))
    0.999 0.4995
    >>> print({k: round(float(r), 4) for k, r in optax_lamb.trust_ratios(state).items()})
    {'b': 0.1579, 'w': 0.3152}
  """
  if not callable(lr) and _common.is_number(lr) and not lr > 0.0:
    raise ValueError(f"Invalid learning rate: {lr} (lr={lr!r}; torch_optimizer needs lr > 0)")
  if _common.is_number(eps) and not eps >= 0.0:
    raise ValueError(f"Invalid epsilon value: {eps} (eps={eps!r})")
  for i in range(2):
    beta = betas[i] if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
    if _common.is_number(beta) and not 0.0 <= beta < 1.0:
      raise ValueError(f"Invalid beta parameter at index {i}: {beta} (betas={betas!r})")
  if _common.is_number(weight_decay) and not weight_decay >= 0:
    raise ValueError(f"Invalid weight_decay value: {weight_decay} (weight_decay={weight_decay!r})")
  clamp = _check_args.number("clamp_value", clamp_value)  # None: an array (inf, 0 act alike)
  if clamp is not None and not clamp >= 0.0:
    raise ValueError(f"Invalid clamp value: {clamp_value} (clamp_value={clamp_value!r})")
  torch_style = _common.check_torch_style(locals(), _FLAGS)
  return build(
    **_common.build_args(
      **torch_style,
      bias_correction=debias,
      bias_correction_placement="step_size",
      trust_ratio_mask=_common.NO_LEAF if adam else None,
      max_param_norm=clamp_value if clamp is None else (None if clamp == math.inf else clamp),
      lamb_options=_common.lamb_options(locals()),
    )
  )
