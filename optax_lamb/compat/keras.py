"""Keras 3's ``Lamb``, exactly."""

from __future__ import annotations

import optax

from optax_lamb.compat import _common
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build


@_common.documented
def keras_lamb(
  learning_rate: optax.ScalarOrSchedule = 0.001,
  beta_1: float = 0.9,
  beta_2: float = 0.999,
  epsilon: float = 1e-7,
  weight_decay: float | None = None,
  *,
  weight_decay_mask: PerLeafMask = None,
  clipnorm: float | None = None,
  clipvalue: float | None = None,
  global_clipnorm: float | None = None,
  stacked_axes: PerLeafAxes = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""``keras.optimizers.Lamb`` (Keras 3).

  Source: keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60 (Keras
  3.15.1), ``keras/src/optimizers/lamb.py`` lines 38-132 and
  ``keras/src/optimizers/base_optimizer.py`` lines 68-193, 466-959 and 1108-1197.
  Per step, with eta_t the learning rate at the 0-based step count:

  .. math::
    p &\leftarrow p - \eta_t \lambda p \quad \text{(decayed leaves, before the update: outside
      the ratio)} \\
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon} \\
    p &\leftarrow p - \eta_t\, r\, u, \quad r = \|p\| / \|u\| \text{ (the decayed p; 1 if
      either is 0)}

  Every leaf adapts. At most one of Keras' gradient clips acts first:
  ``global_clipnorm`` (g min(1, c / G)), ``clipnorm`` (per variable, g c / max(||g||, c))
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
    epsilon: added to sqrt(v / bc2), > 0 (0 would give 0 / 0 where g = 0).
    weight_decay: lambda >= 0, or None: no decay.
    weight_decay_mask: which leaves decay: a pytree prefix of bools (``None`` entries
      count as True) or a callable(params) returning one, like :func:`optax_lamb.lamb`'s
      ``mask``; None: every leaf.
    clipnorm: per-variable clip threshold: per leaf, or per stacked slice with
      ``stacked_axes`` (one layer's variable).
    clipvalue: elementwise clip threshold.
    global_clipnorm: global-norm clip threshold. A clip threshold given as a scalar array
      (``optax.inject_hyperparams``) clips nothing at the steps where it is <= 0.
    {lamb_options_and_returns}

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.full(3, 0.5)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> tx = optax_lamb.compat.keras_lamb(  # decay applied to p before the step
    ...   learning_rate=1e-3, weight_decay=0.01, weight_decay_mask={"w": True, "b": False})
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> print(round(float(new["w"][0, 0]), 5), round(float(new["b"][0]), 5))
    0.99899 0.4995
    >>> print({k: round(float(r), 4) for k, r in optax_lamb.trust_ratios(state).items()})
    {'b': 0.5, 'w': 1.0}
  """
  if isinstance(learning_rate, (bool, int)):
    raise ValueError(
      "Argument `learning_rate` should be float, or an instance of LearningRateSchedule, or a "
      f"callable. Received instead: learning_rate={learning_rate}"
    )
  clips = _common.keras_clip_options(clipnorm, clipvalue, global_clipnorm)
  _check_args.check_in_unit_interval("beta_1", beta_1)
  _check_args.check_in_unit_interval("beta_2", beta_2)
  _check_args.check_positive("epsilon", epsilon)  # 0 would give 0 / 0 where g = 0
  if weight_decay is not None:
    _check_args.check_non_negative("weight_decay", weight_decay)
  _common.check_mask("weight_decay_mask", weight_decay_mask)
  options = _common.lamb_options(locals())
  return build(
    **_common.build_args(
      learning_rate=learning_rate,
      learning_rate_name="learning_rate",
      b1=beta_1,
      b2=beta_2,
      eps=epsilon,
      weight_decay=0.0 if weight_decay is None else weight_decay,
      mask=_common.named_mask("weight_decay_mask", weight_decay_mask),
      weight_decay_placement="params",
      bias_correction=True,
      max_grad_norm=clips["global_clipnorm"],
      grad_transform=_common.keras_clipping(clips["clipnorm"], clips["clipvalue"], options),
      lamb_options=options,
    )
  )
