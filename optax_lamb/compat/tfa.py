"""TF Addons' ``LAMB``, exactly."""

from __future__ import annotations

import math
from typing import Any

import optax

from optax_lamb.compat import _common
from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames
from optax_lamb.faults import _check_args
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build


def _inverse_time_decay(learning_rate: Any, decay: Any, known: float | None) -> Any:
  """Keras 2's legacy ``decay``: lr_t = learning_rate(count) / (1 + decay count); the learning
  rate as given where `decay` is the number 0 (`known`, its value; None for an array)."""
  if known == 0:
    return learning_rate
  value = lambda count: learning_rate(count) if callable(learning_rate) else learning_rate
  return lambda count: value(count) / (1.0 + decay * count)


def _check_keyword(name: str, value: Any) -> None:
  """A clip threshold or decay: a number, not NaN (TF lets NaN through to NaN params or no
  clipping), and a finite decay (inf gives NaN params from the second step). A scalar array
  (``optax.inject_hyperparams``, maybe traced) is checked for shape and dtype only."""
  number = _check_args.number(name, value)
  if number is not None and (math.isnan(number) or (name == "decay" and math.isinf(number))):
    what = "a finite number >= 0" if name == "decay" else "a number >= 0"
    raise ValueError(f"{name} must be {what}, got {name}={value!r}")


@_common.documented
def tfa_lamb(
  learning_rate: optax.ScalarOrSchedule = 0.001,
  beta_1: float = 0.9,
  beta_2: float = 0.999,
  epsilon: float = 1e-6,
  weight_decay: float = 0.0,
  exclude_from_weight_decay: list[str] | None = None,
  exclude_from_layer_adaptation: list[str] | None = None,
  *,
  lr: optax.ScalarOrSchedule | None = None,
  decay: float = 0.0,
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
  r"""``tensorflow_addons.optimizers.LAMB`` (TF Addons 0.23.0, Keras 2.15's legacy optimizer).

  Source: tensorflow/addons at commit d208d75 (0.23.0),
  ``tensorflow_addons/optimizers/lamb.py`` lines 40-254, on keras-team/keras 2.15
  ``keras/optimizers/legacy/optimizer_v2.py`` lines 371-443, 554-566 and 1183-1193.
  Per step, with eta_t = learning_rate(count) / (1 + decay count):

  .. math::
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon} + \lambda p \quad (\text{leaves not
      excluded from weight decay}) \\
    r &= \|p\| / \|u\| \quad \text{(1 if either is 0, and on leaves excluded from layer
      adaptation)} \\
    p &\leftarrow p - \eta_t\, r\, u

  The exclusions are lists of regexes ``re.search``'ed in each leaf's path, its
  keys joined by '/' (``{'dense': {'bias': b}}``: 'dense/bias').
  ``exclude_from_layer_adaptation`` None or empty takes the weight-decay list.
  Clips, in TF's order: ``clipvalue``, then ``clipnorm`` (per variable: per leaf,
  or per stacked slice), then ``global_clipnorm``; ``lr`` is TF's old name of
  ``learning_rate`` (it wins when given), ``decay`` its inverse-time decay of the
  learning rate.

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
    clipnorm: per-variable clip threshold, >= 0 (not with global_clipnorm): per leaf, or per
      stacked slice with ``stacked_axes`` (one layer's variable).
    clipvalue: elementwise clip threshold, >= 0.
    global_clipnorm: global-norm clip threshold, >= 0.
    {lamb_options_and_returns}

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.full(3, 0.5)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> tx = optax_lamb.compat.tfa_lamb(  # regexes on leaf paths; b: no ratio either
    ...   learning_rate=1e-3, weight_decay=0.01, exclude_from_weight_decay=["b"])
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> print(round(float(new["w"][0, 0]), 5), round(float(new["b"][0]), 5))
    0.999 0.499
    >>> print({k: round(float(r), 4) for k, r in optax_lamb.trust_ratios(state).items()})
    {'b': 1.0, 'w': 0.9901}
  """
  keywords = {"clipnorm": clipnorm, "clipvalue": clipvalue, "lr": lr, "decay": decay}
  keywords["global_clipnorm"] = global_clipnorm
  for name, value in keywords.items():
    if name != "lr" and value is not None:
      _check_keyword(name, value)
    if _common.is_number(value) and value < 0:
      raise ValueError(f"Expected {name} >= 0, received: {value}")
  if clipnorm is not None and global_clipnorm is not None:
    raise ValueError("Cannot accept both `clipnorm` and `global_clipnorm`.")
  if epsilon is None or (_common.is_number(epsilon) and epsilon == 0):
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
  known_decay = _check_args.number("decay", decay)
  learning_rate = learning_rate if lr is None else lr
  _check_args.check_non_negative(
    "lr" if lr is not None else "learning_rate", learning_rate, schedule=True
  )
  options = _common.lamb_options(locals())
  return build(
    **_common.build_args(
      learning_rate=_inverse_time_decay(learning_rate, decay, known_decay),
      learning_rate_name="learning_rate",
      b1=beta_1,
      b2=beta_2,
      eps=epsilon,
      weight_decay=weight_decay,
      mask=_common.regex_mask(exclude_from_weight_decay),
      bias_correction=True,
      trust_ratio_mask=_common.regex_mask(
        exclude_from_layer_adaptation or exclude_from_weight_decay
      ),
      max_grad_norm=global_clipnorm,
      grad_transform=_common.keras_clipping(clipnorm, clipvalue, options),
      lamb_options=options,
    )
  )
