"""Skipping steps whose gradients (or, on request, results) hold a NaN or an Inf."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lamb import _nnx
from optax_lamb.core import _ratios
from optax_lamb.core._config import PerLeafAxisNames
from optax_lamb.faults import _check_args, _checks, _explain, _loss_scale, _spikes
from optax_lamb.faults._decision import decide, passes
from optax_lamb.faults._spikes import SkipSpikesState, SpikeRule


class SkipNonFiniteState(NamedTuple):
  """Skip counters (int32) and the wrapped optimizer's state.

  Attributes:
    total: int32 scalar, steps skipped since ``init``.
    consecutive: int32 scalar, steps skipped in a row up to the last update.
    inner_state: the wrapped transformation's state, unchanged by a skipped step.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> state = optax_lamb.skip_nonfinite(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    >>> print(int(state.total), int(state.consecutive), state.total.dtype)
    0 0 int32
  """

  total: jax.Array
  consecutive: jax.Array
  inner_state: Any


class SkipCounts(NamedTuple):
  """Steps skipped: in all, and in a row up to the last update (non-finite ones, and spikes
  when :func:`skip_nonfinite` has a :class:`SpikeRule`; :func:`spike_stats` counts those).

  Attributes:
    total: int32 scalar, steps skipped since ``init``.
    consecutive: int32 scalar, steps skipped in a row up to the last update.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.lamb(1e-3, skip_nonfinite=True)
    >>> total, consecutive = optax_lamb.skip_counts(tx.init({"w": jnp.ones(2)}))
    >>> print(int(total), int(consecutive), total.shape)
    0 0 ()
  """

  total: jax.Array
  consecutive: jax.Array


def all_finite(tree: Any, axis_name: PerLeafAxisNames = None, names_of: Any = None) -> jax.Array:
  """True when no leaf of `tree` holds a NaN or an Inf; agreed over `axis_name` if given.

  `axis_name` may be per leaf (as in :func:`optax_lamb.lamb`), of `names_of` (default
  `tree`): the count is summed over every axis any leaf is sharded on, so all devices
  take the same decision.
  """
  names = _checks.resolve_axis_names(axis_name, tree if names_of is None else names_of)
  bad = sum(
    (jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in jax.tree.leaves(tree)),
    jnp.zeros((), jnp.int32),
  )
  return _checks.psum_over_names(bad, names) == 0


def initial_state(inner_state: Any) -> SkipNonFiniteState:
  # Two arrays, not one twice: a donated state must not hold a buffer twice.
  zeros = lambda: jnp.zeros([], jnp.int32)
  return SkipNonFiniteState(total=zeros(), consecutive=zeros(), inner_state=inner_state)


def skip_nonfinite(
  inner: optax.GradientTransformation,
  *,
  axis_name: PerLeafAxisNames = None,
  max_consecutive_errors: int | None = None,
  check_results: bool = False,
  spikes: SpikeRule | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Skip every step whose gradients hold a NaN or an Inf (or, on request, whose results would).

  On such a step the updates are zero and the wrapped state is returned as it was
  (moments, step count, trust ratios, master weights), so the parameters do not
  change; :class:`SkipNonFiniteState` counts the skipped steps, in total and in a
  row (read them with :func:`skip_counts`). The branch is a :func:`jax.lax.cond`
  on the CPU and a select of the new or the old values on other platforms (where
  a conditional's predicate is read on the host: the step is then computed either
  way), so it jits, and ``optax.MultiSteps`` around it skips an accumulated step
  that one bad micro-batch poisoned.

  Args:
    inner: the transformation to protect.
    axis_name: mapped axis name(s) the gradients are sharded over (``shard_map``),
      so that every device agrees on skipping.
    max_consecutive_errors: as in :func:`optax.apply_if_finite`: once more than
      this many steps in a row were non-finite, such steps are applied (NaNs and
      Infs let through) until a finite one resets the count; None (the default):
      never, watch ``skip_counts(state).consecutive`` and stop the run yourself.
    check_results: also skip (and count) a step with finite gradients whose
      updates or new state (moments, master weights) would not be finite: a
      gradient of 1e20, say, whose square overflows the second moment for good.
      The step is then computed before the choice, so the old and the new state
      are alive together: about one more state's worth of memory at the peak
      (docs/faults.md gives the measured cost). Off by default.
    spikes: also skip (and count) a finite step whose global gradient norm, or loss
      (passed as ``tx.update(..., value=loss)``, optax's name for it), jumps far above
      its running average: a :class:`SpikeRule`. The state is then a
      :class:`SkipSpikesState`, which holds the averages; :func:`spike_stats` reads them
      and the number of spikes. None (the default): no spike test, the state is
      :class:`SkipNonFiniteState` as before.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with :class:`SkipNonFiniteState`
    (:class:`SkipSpikesState` with ``spikes``).

  Example:
    >>> import jax.numpy as jnp, optax, optax_lamb
    >>> tx = optax_lamb.skip_nonfinite(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state, params)
    >>> print(updates["w"].tolist(), int(optax_lamb.skip_counts(state).total))  # skipped
    [0.0, 0.0] 1
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> print([round(x, 4) for x in updates["w"].tolist()])  # taken
    [-0.1, -0.1]

  Skip a step whose gradient norm is 3x its average, after 2 accepted steps:

    >>> rule = optax_lamb.SpikeRule(factor=3.0, warmup_steps=2, decay=0.9)
    >>> tx = optax_lamb.skip_nonfinite(optax.sgd(0.1), spikes=rule)
    >>> state = tx.init(params)
    >>> for g in (1.0, 1.2, 50.0, 0.9):
    ...   updates, state = tx.update({"w": jnp.full(2, g)}, state, params, value=jnp.float32(2.0))
    >>> print(int(optax_lamb.skip_counts(state).total), int(optax_lamb.spike_stats(state).skipped))
    1 1
  """
  _check_args.check_transformation("inner", inner)
  _check_args.check_axis_name("axis_name", axis_name)
  if max_consecutive_errors is not None:
    _check_args.check_count("max_consecutive_errors", max_consecutive_errors)
  _check_args.check_bool("check_results", check_results)
  _spikes.check_rule("spikes", spikes)
  return skipping(inner, axis_name, max_consecutive_errors, check_results, spikes)


def skipping(
  inner: optax.GradientTransformation,
  axis_name: PerLeafAxisNames,
  max_errors: int | None,
  check_results: bool,
  spikes: SpikeRule | None = None,
) -> optax.GradientTransformationExtraArgs:
  """`skip_nonfinite` with checked arguments. lamb's own skip is not this wrapper: the planned
  step decides it (`optax_lamb.step._plan.plan_step`) and keeps each buffer where it is written,
  from the same `decide` and, for the state, the same `counted_state`."""
  inner = optax.with_extra_args_support(inner)
  state_type = SkipNonFiniteState if spikes is None else SkipSpikesState

  def init_fn(params: Any) -> Any:
    inner_state = inner.init(params)
    return initial_state(inner_state) if spikes is None else _spikes.initial_state(inner_state)

  def update_fn(updates, state, params=None, **extra_args) -> tuple[Any, Any]:
    if not isinstance(state, state_type):
      raise ValueError(
        f"skip_nonfinite: the optimizer state is {type(state).__name__} where "
        f"{state_type.__name__} (what skip_nonfinite(tx{'' if spikes is None else ', spikes=...'})"
        ".init(params) returns) is expected. " + _explain.RESTORE_HINT
      )
    verdict = None
    if spikes is not None:
      scale = extra_args.get("grad_scale")  # the norm of the unscaled gradients is judged
      scale = None if scale is None else _loss_scale.given_scale(scale)
      verdict = _spikes.judge(spikes, state, updates, extra_args.get("value"), axis_name, scale)
    if check_results:
      return _checking_results(
        inner, updates, state, params, extra_args, axis_name, max_errors, (spikes, verdict)
      )
    ok = all_finite(updates, axis_name)
    consecutive, take = decide(passes(ok, verdict), state.consecutive, max_errors)
    arrays = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array)}
    others = {k: v for k, v in extra_args.items() if not isinstance(v, jax.Array)}

    def apply(updates, inner_state, params, arrays) -> tuple[Any, Any]:
      return inner.update(updates, inner_state, params, **arrays, **others)

    def skip(updates, inner_state, params, arrays) -> tuple[Any, Any]:
      out, _ = jax.eval_shape(apply, updates, inner_state, params, arrays)
      return optax.tree.zeros_like(out), inner_state

    operands = (updates, state.inner_state, params, arrays)
    on_cpu = lambda: jax.lax.cond(take, apply, skip, *operands)
    on_accelerator = lambda: selected(take, apply(*operands), state.inner_state)
    new_updates, new_inner = jax.lax.platform_dependent(
      **_ratios.per_platform(on_cpu, on_accelerator)
    )
    return new_updates, counted_state(state, ok, consecutive, new_inner, (spikes, verdict), take)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _checking_results(
  inner: Any,
  updates: Any,
  state: Any,
  params: Any,
  extra_args: dict,
  axis_name: PerLeafAxisNames,
  max_errors: int | None,
  judged: tuple,
) -> tuple:
  """`check_results`: the step computed first, then kept only where all of it is finite."""
  new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
  # A per-leaf axis_name is the gradients' tree: the results are agreed over its axes.
  finite = all_finite((updates, new_updates, new_inner), axis_name, names_of=updates)
  consecutive, take = decide(passes(finite, judged[1]), state.consecutive, max_errors)
  on_cpu = lambda: jax.lax.cond(
    take,
    lambda taken, kept: taken,
    lambda taken, kept: (optax.tree.zeros_like(taken[0]), kept),
    (new_updates, new_inner),
    state.inner_state,
  )
  on_accelerator = lambda: selected(take, (new_updates, new_inner), state.inner_state)
  new_updates, new_inner = jax.lax.platform_dependent(
    **_ratios.per_platform(on_cpu, on_accelerator)
  )
  return new_updates, counted_state(state, finite, consecutive, new_inner, judged, take)


def selected(take: jax.Array, taken: tuple, kept: Any) -> tuple:
  """The skip's choice without a conditional: (`taken`'s updates, `taken`'s state) where `take`,
  else (zeros, `kept`), a select per array (what an accelerator runs: `_ratios.per_platform`)."""
  updates, state = taken
  zeros = lambda u: jnp.where(take, u, jnp.zeros_like(u))
  return jax.tree.map(zeros, updates), jax.tree.map(lambda n, o: jnp.where(take, n, o), state, kept)


def counted_state(
  state: Any,
  finite: jax.Array,
  consecutive: jax.Array,
  new_inner: Any,
  judged: tuple,
  take: jax.Array,
) -> Any:
  """The skip's state after a step (the wrapper's, lamb's planned step's): `finite`, the check
  the gradients passed (a spike aside); `judged`: (the spike rule, its verdict) or (None, None)."""
  rule, verdict = judged
  if verdict is None:
    return counted(state, finite, consecutive, new_inner)
  return _spikes.counted(rule, state, finite, verdict, take, consecutive, new_inner)


def counted(state: SkipNonFiniteState, finite, consecutive, new_inner) -> SkipNonFiniteState:
  return SkipNonFiniteState(
    total=jnp.where(finite, state.total, optax.safe_increment(state.total)),
    consecutive=consecutive,
    inner_state=new_inner,
  )


def skip_counts(opt_state: Any) -> SkipCounts:
  """Steps skipped (for non-finite gradients, or as spikes), read from any optimizer state.

  Searches any nesting of ``chain``, ``MultiSteps`` and ``inject_hyperparams``
  states for a :class:`SkipNonFiniteState` (``lamb(skip_nonfinite=True)`` or
  :func:`skip_nonfinite`).

  Args:
    opt_state: the state of an optimizer built with ``skip_nonfinite``.

  Returns:
    :class:`SkipCounts` ``(total, consecutive)`` as int32 scalars.

  Example:
    >>> import jax.numpy as jnp, optax_lamb
    >>> tx = optax_lamb.lamb(1e-3, skip_nonfinite=True)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    >>> counts = optax_lamb.skip_counts(state)
    >>> print(int(counts.total), int(counts.consecutive), counts.total.dtype)
    1 1 int32
  """
  found = _checks.find_states(
    opt_state,
    (SkipNonFiniteState, SkipSpikesState),
    "No skip_nonfinite stage in this optimizer state: build it with "
    "optax_lamb.lamb(..., skip_nonfinite=True) or optax_lamb.skip_nonfinite(tx).",
  )
  # Plain arrays also from a Flax NNX optimizer's state (OptVariable wrappers).
  counts = _nnx.plain_values((found[0].total, found[0].consecutive))
  return SkipCounts(*counts)
