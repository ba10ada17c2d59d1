"""Skipping spikes: steps whose gradient norm (or loss) jumps far above its running average.

An option of the skipping wrapper (``skip_nonfinite(tx, spikes=SpikeRule(...))``): its state
keeps a bias-corrected exponential moving average of the global gradient norm, and of the loss
when one is passed to ``update`` as ``value=``, over the steps it accepted. After
``warmup_steps`` accepted steps it skips a step whose norm exceeds ``factor`` times its average
(or whose loss exceeds ``loss_factor`` times its own); a skipped step leaves the averages as they
were, like the rest of the state.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lamb import _nnx
from optax_lamb.core import _ratios
from optax_lamb.core._config import PerLeafAxisNames
from optax_lamb.core._options import Scalar
from optax_lamb.faults import _checks
from optax_lamb.faults._decision import Verdict, passes

_BOOLS = (bool, np.bool_)


def _real(name: str, value: Any, ok: Any, what: str) -> None:
  if isinstance(value, _BOOLS) or not isinstance(value, numbers.Real):
    raise TypeError(f"SpikeRule: {name} must be {what}, got {name}={value!r}")
  if not ok(float(value)):
    raise ValueError(f"SpikeRule: {name} must be {what}, got {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class SpikeRule:
  """When :func:`optax_lamb.skip_nonfinite` skips a spike (its ``spikes=`` argument).

  A step is a spike when its global gradient norm exceeds ``factor`` times the running
  average of the norms of the steps taken so far, or, when the loss is passed to
  ``update`` as ``value=loss``, when the loss exceeds ``loss_factor`` times its running
  average. The averages are bias-corrected exponential moving averages (``decay`` per
  step, as Adam's moments); they start judging after ``warmup_steps`` accepted steps and
  are not updated by a skipped step.

  Attributes:
    factor: a step whose gradient norm is above ``factor`` times its average is skipped
      (a finite number > 1).
    warmup_steps: accepted steps averaged before the rule judges (an integer >= 1).
    decay: the averages' decay per accepted step, in [0, 1): 0.99 averages over about
      the last 100 steps.
    loss_factor: the same for the loss (a finite number > 1); None takes ``factor``.
      The loss must be positive for the rule to mean anything.

  Example:
    >>> import optax_lamb
    >>> print(optax_lamb.SpikeRule(factor=4.0, warmup_steps=50))
    SpikeRule(factor=4.0, warmup_steps=50, decay=0.99, loss_factor=None)
  """

  factor: float = 6.0
  warmup_steps: int = 100
  decay: float = 0.99
  loss_factor: float | None = None

  def __post_init__(self) -> None:
    _real("factor", self.factor, lambda x: 1.0 < x < math.inf, "a finite number > 1")
    steps = self.warmup_steps
    if isinstance(steps, _BOOLS) or not isinstance(steps, numbers.Integral):
      raise TypeError(
        f"SpikeRule: warmup_steps must be an integer >= 1, got warmup_steps={steps!r}"
      )
    if steps < 1:
      raise ValueError(
        f"SpikeRule: warmup_steps must be an integer >= 1, got warmup_steps={steps!r}"
      )
    _real("decay", self.decay, lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")
    if self.loss_factor is not None:
      _real(
        "loss_factor", self.loss_factor, lambda x: 1.0 < x < math.inf, "None or a finite number > 1"
      )


def check_rule(name: str, value: Any) -> None:
  if value is not None and not isinstance(value, SpikeRule):
    raise TypeError(f"{name} must be None or an optax_lamb.SpikeRule, got {name}={value!r}")


class SkipSpikesState(NamedTuple):
  """:class:`SkipNonFiniteState`'s counters and wrapped state, and the spike rule's averages.

  ``total`` and ``consecutive`` count every skipped step (non-finite or spike); ``spikes``
  the spikes among them; ``norm_steps`` / ``loss_steps`` the steps averaged so far into
  ``norm_average`` / ``loss_average`` (bias-corrected, float32).

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=optax_lamb.SpikeRule())
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> print(type(state).__name__, int(state.spikes), int(state.norm_steps))
    SkipSpikesState 0 0
  """

  total: jax.Array
  consecutive: jax.Array
  inner_state: Any
  spikes: jax.Array
  norm_steps: jax.Array
  norm_average: jax.Array
  loss_steps: jax.Array
  loss_average: jax.Array


class SpikeStats(NamedTuple):
  """What :func:`spike_stats` reads: steps skipped as spikes, the running averages of the
  gradient norm and of the loss, and how many steps each average holds (int32 and float32).

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=optax_lamb.SpikeRule())
    >>> print(optax_lamb.spike_stats(tx.init({"w": jnp.ones(2)}))._fields)
    ('skipped', 'norm_average', 'loss_average', 'norm_steps', 'loss_steps')
  """

  skipped: jax.Array
  norm_average: jax.Array
  loss_average: jax.Array
  norm_steps: jax.Array
  loss_steps: jax.Array


def initial_state(inner_state: Any) -> SkipSpikesState:
  # Separate arrays: a donated state must not hold one buffer twice.
  count = lambda: jnp.zeros([], jnp.int32)
  mean = lambda: jnp.zeros([], jnp.float32)
  return SkipSpikesState(count(), count(), inner_state, count(), count(), mean(), count(), mean())


def _axes(axis_name: PerLeafAxisNames, grads: Any) -> tuple[list, tuple[str, ...] | None]:
  names = _checks.resolve_axis_names(axis_name, grads)
  axes: set[str] = set()
  for name in names:
    axes.update((name,) if isinstance(name, str) else (name or ()))
  return names, tuple(sorted(axes)) or None


def _above(
  x: jax.Array, average: jax.Array, steps: jax.Array, rule: SpikeRule, factor: float
) -> jax.Array:
  return jnp.logical_and(steps >= rule.warmup_steps, x > factor * average)


def judge(
  rule: SpikeRule,
  state: Any,
  grads: Any,
  loss: Any,
  axis_name: PerLeafAxisNames,
  grad_scale: Scalar | None = None,
  clip_norm: bool = False,
) -> Verdict:
  """Whether this step is a spike, for a `SkipSpikesState`: from the global norm of the
  gradients divided by `grad_scale` (agreed over the mapped axes of `axis_name`) and the
  loss (None: not passed; averaged over those axes). `clip_norm`: the norm as lamb's global
  clipping computes it (`_ratios.global_norm`), which XLA then computes once for both (the
  two norms side by side made XLA:CPU copy the gradients)."""
  names, axes = _axes(axis_name, grads)
  leaves = jax.tree.leaves(grads)
  norm_of = _ratios.global_norm if clip_norm else _ratios.one_pass_global_norm
  norm = norm_of(leaves, names).astype(jnp.float32)
  if grad_scale is not None:
    norm = norm / jnp.asarray(grad_scale, jnp.float32)
  spike = _above(norm, state.norm_average, state.norm_steps, rule, rule.factor)
  if loss is None:
    return Verdict(spike, norm, None)
  loss = jnp.asarray(loss, jnp.float32)
  if jnp.ndim(loss) != 0:
    raise ValueError(
      f"skip_nonfinite(spikes=...): value must be a scalar loss, got shape {jnp.shape(loss)}"
    )
  if axes is not None:  # every device judges the same loss
    loss = jax.lax.pmean(loss, axes)
  loss_factor = rule.factor if rule.loss_factor is None else rule.loss_factor
  loss_spike = _above(loss, state.loss_average, state.loss_steps, rule, float(loss_factor))
  return Verdict(jnp.logical_or(spike, loss_spike), norm, loss)


def _averaged(
  average: jax.Array, steps: jax.Array, x: jax.Array, use: jax.Array, decay: float
) -> tuple[jax.Array, jax.Array]:
  """(average, steps) with `x` taken in where `use`: the bias-corrected EMA,
  a_n = a_{n-1} + (x - a_{n-1}) (1 - d) / (1 - d^n), so a_1 = x."""
  n = optax.safe_increment(steps)
  d = jnp.float32(decay)
  weight = (1 - d) / (1 - jnp.power(d, n.astype(jnp.float32)))  # exactly 1 at n = 1
  new = average + (x - average) * weight
  return jnp.where(use, new, average), jnp.where(use, n, steps)


def counted(
  rule: SpikeRule,
  state: SkipSpikesState,
  finite: jax.Array,
  verdict: Verdict,
  take: jax.Array,
  consecutive: jax.Array,
  new_inner: Any,
) -> SkipSpikesState:
  """The state after a step: `finite` (the gradients were), `verdict`, `take` (the step was
  applied); the averages take in the values of an applied step with finite gradients."""
  clean = finite if verdict.loss is None else jnp.logical_and(finite, jnp.isfinite(verdict.loss))
  ok, is_spike = passes(finite, verdict), jnp.logical_and(clean, verdict.spike)
  use = jnp.logical_and(take, finite)
  norm_ok = jnp.logical_and(use, jnp.isfinite(verdict.norm))
  norm_average, norm_steps = _averaged(
    state.norm_average, state.norm_steps, verdict.norm, norm_ok, rule.decay
  )
  loss_average, loss_steps = state.loss_average, state.loss_steps
  if verdict.loss is not None:
    loss_ok = jnp.logical_and(use, jnp.isfinite(verdict.loss))
    loss_average, loss_steps = _averaged(
      loss_average, loss_steps, verdict.loss, loss_ok, rule.decay
    )
  return SkipSpikesState(
    total=jnp.where(ok, state.total, optax.safe_increment(state.total)),
    consecutive=consecutive,
    inner_state=new_inner,
    spikes=jnp.where(is_spike, optax.safe_increment(state.spikes), state.spikes),
    norm_steps=norm_steps,
    norm_average=norm_average,
    loss_steps=loss_steps,
    loss_average=loss_average,
  )


def spike_stats(opt_state: Any) -> SpikeStats:
  """The spike rule's counters and averages, read from any optimizer state.

  Searches any nesting of ``chain``, ``MultiSteps`` and ``inject_hyperparams`` states for
  the state of ``skip_nonfinite(tx, spikes=...)``. :func:`optax_lamb.skip_counts` reads
  the same state's ``(total, consecutive)``, which count every skipped step.

  Args:
    opt_state: the state of an optimizer built with ``skip_nonfinite(tx, spikes=...)``.

  Returns:
    :class:`SpikeStats` ``(skipped, norm_average, loss_average, norm_steps, loss_steps)``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> rule = optax_lamb.SpikeRule(factor=3.0, warmup_steps=2, decay=0.9)
    >>> tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=rule)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, 1.2, 50.0):  # the third step's norm is a spike
    ...   _, state = tx.update({"w": jnp.full(2, g)}, state, params)
    >>> stats = optax_lamb.spike_stats(state)
    >>> print(int(stats.skipped), int(stats.norm_steps), round(float(stats.norm_average), 2))
    1 2 1.56
  """
  found = _checks.find_states(
    opt_state,
    SkipSpikesState,
    "No spike rule in this optimizer state: build it with "
    "optax_lamb.skip_nonfinite(tx, spikes=optax_lamb.SpikeRule(...)).",
  )
  s = found[0]
  values = (s.spikes, s.norm_average, s.loss_average, s.norm_steps, s.loss_steps)
  return SpikeStats(*_nnx.plain_values(values))
