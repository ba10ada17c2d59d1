"""The optimizers of the recipe and a jitted training loop that runs several learning rates at once.

Every batch size runs as micro-batches of a fixed size accumulated by :class:`optax.MultiSteps`
(the way to train with batches larger than memory). Because the number of micro-batches per
step, the peak learning rate and the schedule lengths are all traced values, one compiled
training segment serves every batch size and learning rate of a sweep; the learning rates of
one optimizer family train side by side under ``jax.vmap`` on the same data.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lamb
from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes import schedules
from optax_lamb_recipes.data import MLMBatch

FAMILIES = ("lamb", "adamw")


def is_decayed(path: Sequence[Any]) -> bool:
  """BERT's rule: no weight decay on biases and LayerNorm parameters (nor on the output bias)."""
  names = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
  return not any("bias" in n or "norm" in n for n in names)


def decay_mask(params: Any) -> Any:
  """A pytree of bools like ``params``: True where weight decay (and LAMB's ratio) applies."""
  return jax.tree_util.tree_map_with_path(lambda path, _: is_decayed(path), params)


# The optimizer settings a random search may set per run (``Trainer.run``'s ``trials``).
SEARCHABLE = ("b2", "eps", "weight_decay")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The recipe's optimizer settings (You et al. 2019 and NVIDIA's BERT recipe)."""

  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-6
  weight_decay: float = 0.01
  max_grad_norm: float = 1.0
  # NVIDIA's recipe leaves the no-decay params (biases, LayerNorm) without a trust ratio.
  ratio_on_no_decay: bool = False
  # LAMB's moment storage: None (the param's dtype), or "int8" / "uint8": 8-bit block-wise
  # quantized (``optax_lamb.lamb``'s mu_dtype / nu_dtype; moments8.py)
  mu_dtype: str | None = None
  nu_dtype: str | None = None


def make_optimizer(
  family: str,
  learning_rate: optax.ScalarOrSchedule,
  *,
  accumulate: Any = 1,
  opt: OptimizerConfig = OptimizerConfig(),
  **lamb_options: Any,
) -> optax.GradientTransformation:
  """``"lamb"`` (optax_lamb.lamb) or ``"adamw"`` (optax.adamw after global clipping), same settings.

  Args:
    family: ``"lamb"`` or ``"adamw"``.
    learning_rate: a float or schedule (counted in optimizer steps, not micro-batches).
    accumulate: micro-batches per step (int or traced scalar); ``1`` skips ``MultiSteps``
      when it is a Python int.
    opt: betas, eps, weight decay and clipping.
    **lamb_options: further keyword arguments of :func:`optax_lamb.lamb` (``"lamb"`` only).
  """
  if family == "lamb":
    tx = optax_lamb.lamb(
      learning_rate,
      opt.b1,
      opt.b2,
      opt.eps,
      weight_decay=opt.weight_decay,
      mask=decay_mask,
      trust_ratio_mask=None if opt.ratio_on_no_decay else decay_mask,
      max_grad_norm=opt.max_grad_norm,
      **({"mu_dtype": opt.mu_dtype, "nu_dtype": opt.nu_dtype} | lamb_options),
    )
  elif family == "adamw" and (lamb_options or opt.mu_dtype or opt.nu_dtype):
    named = sorted(lamb_options) + [k for k in ("mu_dtype", "nu_dtype") if getattr(opt, k)]
    raise TypeError(f"options of lamb only, not of adamw: {named}")
  elif family == "adamw":
    tx = optax.chain(
      optax.clip_by_global_norm(opt.max_grad_norm),
      optax.adamw(
        learning_rate, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
      ),
    )
  else:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  if isinstance(accumulate, int) and accumulate == 1:
    return tx
  return optax.MultiSteps(tx, every_k_schedule=lambda _: accumulate)


def carry_over_moments(old_state: Any, new_state: Any) -> Any:
  """Phase 2's fresh state with phase 1's Adam moments (and their step count) put back in.

  The recipe's second phase keeps the optimizer's memory but restarts the learning-rate
  schedule (re-warm-up): every :class:`optax.ScaleByAdamState` in ``new_state`` is replaced,
  in order, by the one in ``old_state``; everything else (schedule counts, MultiSteps
  accumulators) stays fresh. Works through any nesting (chain, MultiSteps, masked).
  """
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  old = [s for s in jax.tree.leaves(old_state, is_leaf=is_adam) if is_adam(s)]
  count = [0]

  def swap(x):
    if not is_adam(x):
      return x
    if count[0] >= len(old):
      raise ValueError("phase 2's optimizer has more Adam stages than phase 1's")
    count[0] += 1
    return old[count[0] - 1]

  out = jax.tree.map(swap, new_state, is_leaf=is_adam)
  if count[0] != len(old):
    raise ValueError(f"phase 1 has {len(old)} Adam stages, phase 2 has {count[0]}")
  return out


def leaf_names(params: Any) -> list[str]:
  """Readable names of the leaves, in ``jax.tree.leaves`` order (``layers/0/mlp_in/kernel``)."""
  return [
    "/".join(str(getattr(k, "key", k)) for k in path)
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]


@dataclasses.dataclass
class RunResult:
  """What one learning rate of one group recorded."""

  family: str
  batch: int
  peak_lr: float
  samples: list[int]  # samples seen at each evaluation
  held_out: list[float]  # held-out masked-LM loss at each evaluation
  train: list[float]  # mean training loss over each segment
  trust_ratios: dict[str, list[float]] | None  # per decayed leaf, per optimizer step (LAMB)
  lr: list[float]  # the learning rate of each optimizer step
  phase_ends: list[int]  # samples seen at the end of each phase
  seconds: float
  test: list[float] | None = None  # test-split loss at each evaluation, when a test set is given
  test_per_sequence: list[float] | None = None  # the final model's loss on each test sequence
  # ||dp|| / ||p|| per decayed leaf and optimizer step (LAMB: lr x clamp, AdamW: what Adam does)
  relative_steps: dict[str, list[float]] | None = None

  @property
  def final(self) -> float:
    return self.held_out[-1]


def _to_device(batch: MLMBatch) -> MLMBatch:
  return MLMBatch(*(jnp.asarray(x) for x in batch))


@dataclasses.dataclass(frozen=True)
class _Programs:
  """The jitted training segment, initialisation and evaluation of one model and optimizer setup.

  They take the parameters as arguments, so every seed's trainer shares them: a sweep compiles
  each once (``_programs``), not once per seed.
  """

  graphdef: Any
  opt: OptimizerConfig

  def _tx(self, family, hyper):
    sched = schedules.warmup_poly_decay(
      hyper["peak_lr"], hyper["warmup"], hyper["steps"], hyper["power"]
    )
    searched = {k: hyper[k] for k in SEARCHABLE if k in hyper}  # a random search's trials
    opt = dataclasses.replace(self.opt, **searched)
    return make_optimizer(family, sched, accumulate=hyper["k"], opt=opt)

  def init(self, params, hyper, *, family):
    return jax.vmap(lambda p, h: self._tx(family, h).init(p))(params, hyper)

  def carry(self, params, old_state, hyper, *, family):
    return carry_over_moments(old_state, self.init(params, hyper, family=family))

  def segment(self, params, state, hyper, data, *, family):
    def one_arm(params, state, hyper):
      tx = self._tx(family, hyper)

      def step(carry, mb):
        params, state = carry
        loss, grads = jax.value_and_grad(model_lib.loss_fn, argnums=1)(self.graphdef, params, mb)
        updates, state = tx.update(grads, state, params)
        moved = _relative_step(updates, params)
        params = optax.apply_updates(params, updates)
        ratios = (
          jnp.stack(jax.tree.leaves(optax_lamb.trust_ratios(state)))
          if family == "lamb"
          else jnp.zeros(())
        )
        return (params, state), (loss, ratios, moved)

      (params, state), (losses, ratios, moved) = jax.lax.scan(step, (params, state), data)
      return params, state, losses.mean(), ratios, moved

    return jax.vmap(one_arm, in_axes=(0, 0, 0))(params, state, hyper)

  def jitted(self):
    """``(segment, init, carry, eval, eval_sequences)``, compiled on first use."""
    losses = lambda fn: jax.jit(jax.vmap(lambda p, b: fn(self.graphdef, p, b), in_axes=(0, None)))
    return (
      jax.jit(self.segment, static_argnames=("family",), donate_argnums=(0, 1)),
      jax.jit(self.init, static_argnames=("family",)),
      jax.jit(self.carry, static_argnames=("family",)),
      losses(model_lib.loss_fn),
      losses(model_lib.sequence_losses),
    )


@functools.lru_cache(maxsize=4)
def _programs(model_cfg: model_lib.BertConfig, opt: OptimizerConfig):
  graphdef, _ = model_lib.init_params(model_cfg, 0)  # the structure, the same for every seed
  return _Programs(graphdef, opt).jitted()


@dataclasses.dataclass
class Trainer:
  """Training segments and evaluation for one seed's initial model (compiled once per setup).

  ``micro`` is the micro-batch size: a batch B trains as ``B // micro`` accumulated micro-batches.
  """

  model_cfg: model_lib.BertConfig
  opt: OptimizerConfig = OptimizerConfig()
  micro: int = 16
  seed: int = 0

  def __post_init__(self):
    self.graphdef, self.params0 = model_lib.init_params(self.model_cfg, self.seed)
    self.names = leaf_names(self.params0)
    self.decayed = np.array(jax.tree.leaves(decay_mask(self.params0)))
    programs = _programs(self.model_cfg, self.opt)
    self._segment, self._init, self._carry, self._eval, self._eval_sequences = programs

  def run(
    self,
    family: str,
    peak_lrs: Sequence[float],
    phases: Sequence[schedules.Phase],
    train_data: dict[int, MLMBatch],
    held_out: dict[int, MLMBatch],
    *,
    test: dict[int, MLMBatch] | None = None,
    evals_per_phase: int = 8,
    progress: Callable[[int], None] | None = None,
    trials: Sequence[dict[str, float]] | None = None,
    on_segment: Callable[[Any, Any], None] | None = None,
  ) -> list[RunResult]:
    """Train one family at several peak learning rates (side by side) through ``phases``.

    ``train_data[seq_len]`` is the stream of examples for that sequence length; every run
    reads it from the start, in order, so every batch size sees the same samples.
    ``held_out`` (the validation split) and ``test``, when given, are evaluated together;
    the final model's loss on each test sequence is kept too (for paired comparisons).
    Phase i's peak learning rate is ``peak_lrs[j] * phase.peak_lr / phases[0].peak_lr``.
    ``progress(n)`` is called with the samples trained after each segment.
    ``trials`` (one phase only): per learning rate, a ``warmup_frac`` of the steps and values
    of ``SEARCHABLE`` replacing the trainer's ``opt``, as traced values (one compilation).
    ``on_segment(params, state)`` after each segment, every learning rate's stacked on a leading
    axis (moments8_diagnose.py): read them before returning, the next segment donates them.
    """
    start = time.perf_counter()
    n = len(peak_lrs)
    if trials is not None and (len(phases) != 1 or len(trials) != n):
      raise ValueError(f"trials need one phase and one trial per learning rate, got {len(trials)}")
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), self.params0)
    state, log, offsets = None, _Log(), {}
    for i, ph in enumerate(phases):
      k = self._micro_steps(ph, evals_per_phase)
      peaks = np.asarray(peak_lrs, np.float32) * (ph.peak_lr / phases[0].peak_lr)
      hyper = _hyper(ph, peaks, k, trials)
      if state is None:
        state = self._init(params, hyper, family=family)
      else:
        state = self._carry(params, state, hyper, family=family)
      log.lrs.append(_lr_schedules(hyper, ph.steps))
      off = offsets.get(ph.seq_len, 0)
      for seg in self._segments(train_data[ph.seq_len], off, ph, k, evals_per_phase, i):
        params, state, loss, ratios, moved = self._segment(params, state, hyper, seg, family=family)
        if on_segment is not None:
          on_segment(params, state)
        log.seen += len(seg.inputs) * self.micro
        log.samples.append(log.seen)
        log.train.append(np.asarray(loss))
        log.held.append(np.asarray(self._eval(params, _to_device(held_out[ph.seq_len]))))
        if test is not None:
          log.tested.append(np.asarray(self._eval(params, _to_device(test[ph.seq_len]))))
        if family == "lamb":
          log.ratios.append(np.asarray(ratios)[:, k - 1 :: k])
        log.moved.append(np.asarray(moved)[:, k - 1 :: k])  # the micro-batch that stepped
        if progress is not None:
          progress(len(seg.inputs) * self.micro)
      offsets[ph.seq_len] = off + ph.steps * ph.batch
      log.phase_ends.append(log.seen)
    if test is not None:
      final_test = _to_device(test[phases[-1].seq_len])
      log.per_sequence = np.asarray(self._eval_sequences(params, final_test))
    return self._results(family, phases[0].batch, peak_lrs, log, time.perf_counter() - start)

  def _micro_steps(self, ph: schedules.Phase, evals_per_phase: int) -> int:
    """Micro-batches per optimizer step; refuses batches and step counts that do not divide."""
    k = ph.batch // self.micro
    if k * self.micro != ph.batch or ph.steps % evals_per_phase:
      raise ValueError(
        f"batch {ph.batch} must be a multiple of micro {self.micro} and "
        f"steps {ph.steps} a multiple of evals_per_phase {evals_per_phase}"
      )
    return k

  def _segments(self, stream: MLMBatch, off: int, ph, k: int, evals: int, phase: int):
    """The phase's training data as ``evals`` segments of ``[micro-batches, micro, seq]``."""
    need = ph.steps * ph.batch
    if off + need > len(stream.inputs):
      raise ValueError(
        f"phase {phase} needs {need} sequences of length {ph.seq_len}, "
        f"only {len(stream.inputs) - off} left"
      )
    seg_micro = ph.steps * k // evals
    for e in range(evals):
      lo = off + e * seg_micro * self.micro
      rows = slice(lo, lo + seg_micro * self.micro)
      yield MLMBatch(*(jnp.asarray(x[rows]).reshape(seg_micro, self.micro, -1) for x in stream))

  def _results(self, family, batch, peak_lrs, log: _Log, seconds: float) -> list[RunResult]:
    lrs_all = np.concatenate(log.lrs, axis=1)
    ratios_all = np.concatenate(log.ratios, axis=1) if log.ratios else None
    moved_all = np.concatenate(log.moved, axis=1)
    decayed = [
      (li, nm) for li, (nm, d) in enumerate(zip(self.names, self.decayed, strict=True)) if d
    ]
    results = []
    for j, peak in enumerate(peak_lrs):
      ratios = None
      if ratios_all is not None:  # the decayed leaves (the others have ratio 1 by default)
        ratios = {nm: ratios_all[j, :, li].tolist() for li, nm in decayed}
      results.append(
        RunResult(
          family=family,
          batch=batch,
          peak_lr=float(peak),
          samples=list(log.samples),
          held_out=[float(h[j]) for h in log.held],
          train=[float(t[j]) for t in log.train],
          trust_ratios=ratios,
          lr=lrs_all[j].tolist(),
          phase_ends=list(log.phase_ends),
          seconds=seconds,
          test=[float(t[j]) for t in log.tested] if log.tested else None,
          test_per_sequence=None if log.per_sequence is None else log.per_sequence[j].tolist(),
          relative_steps={nm: moved_all[j, :, li].tolist() for li, nm in decayed},
        )
      )
    return results


@dataclasses.dataclass
class _Log:
  """What a run records as it goes, for every learning rate of the group at once."""

  seen: int = 0
  samples: list = dataclasses.field(default_factory=list)
  held: list = dataclasses.field(default_factory=list)
  tested: list = dataclasses.field(default_factory=list)
  train: list = dataclasses.field(default_factory=list)
  ratios: list = dataclasses.field(default_factory=list)
  moved: list = dataclasses.field(default_factory=list)
  lrs: list = dataclasses.field(default_factory=list)
  phase_ends: list = dataclasses.field(default_factory=list)
  per_sequence: np.ndarray | None = None


def _relative_step(updates: Any, params: Any) -> jax.Array:
  """``||update|| / ||param||`` of each leaf, stacked in ``jax.tree.leaves`` order."""
  ratio = lambda u, p: optax.tree.norm(u) / jnp.maximum(optax.tree.norm(p), 1e-30)
  return jnp.stack(jax.tree.leaves(jax.tree.map(ratio, updates, params)))


def _hyper(ph: schedules.Phase, peaks: np.ndarray, k: int, trials=None) -> dict[str, jax.Array]:
  """The traced hyper-parameters of one phase, one row per learning rate (and trial)."""
  n = len(peaks)
  hyper = {
    "peak_lr": jnp.asarray(peaks),
    "warmup": jnp.full((n,), ph.warmup_steps, jnp.float32),
    "steps": jnp.full((n,), ph.steps, jnp.float32),
    "power": jnp.full((n,), ph.power, jnp.float32),
    "k": jnp.full((n,), k, jnp.int32),
  }
  if trials is not None:
    warmups = [max(1, round(t["warmup_frac"] * ph.steps)) for t in trials]
    hyper["warmup"] = jnp.asarray(warmups, jnp.float32)
    for name in SEARCHABLE:
      hyper[name] = jnp.asarray([t[name] for t in trials], jnp.float32)
  return hyper


def _lr_schedules(hyper: dict[str, jax.Array], steps: int) -> np.ndarray:
  """``[run, step]``: each run's learning rate at every step of the phase."""
  sched = lambda h: jax.vmap(
    schedules.warmup_poly_decay(h["peak_lr"], h["warmup"], h["steps"], h["power"])
  )(jnp.arange(steps))
  return np.asarray(jax.vmap(sched)({k: hyper[k] for k in ("peak_lr", "warmup", "steps", "power")}))
