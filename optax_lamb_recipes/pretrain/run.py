"""The training loop: phases in order, checkpoints, resuming, held-out evaluation, metrics."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lamb_recipes.data import num_predictions
from optax_lamb_recipes.pretrain import checkpoint, config, metrics, optim, shards, step
from optax_lamb_recipes.pretrain import model as model_lib
from optax_lamb_recipes.pretrain import prepare as prepare_lib
from optax_lamb_recipes.pretrain.config import RunConfig


@dataclasses.dataclass
class Options:
  """How to run (not what): where to write, the corpus, the devices, the reporting."""

  out: str
  data: str | None = None  # a prepared directory; None: ``corpus`` prepared into OUT/data
  corpus: list[str] | None = None  # text files; None: the King James Bible
  vocab: str | None = None  # a tokenizers JSON or a vocab.txt; None: see data.load_tokenizer
  vocab_size: int = 2048  # of a tokenizer trained on ``corpus``
  vocab_case: str = "auto"  # see data.load_tokenizer
  peak_tflops: float | None = None  # per device; None: metrics.PEAK_TFLOPS, else no MFU
  progress: bool = True
  devices: list | None = None  # None: every device of every process
  kill_at: tuple[int, int] | None = None  # (step, signal): rehearse a preemption after step
  held_out_every: int = 100  # of the data prepared here: every Nth line held out
  init_from: str | None = None  # another run's --out: start at phase 2 from its phase 1's end


EVAL_SEQUENCES = 1024  # held-out sequences per evaluation (at most; the same ones every time)
EVAL_KEY = 1 << 20  # the held-out masks' key, apart from every phase's training masks


class Refused(ValueError):
  """A run that cannot start as asked (the batch's split, the data); nothing trained."""


@dataclasses.dataclass
class Result:
  params: Any  # global arrays
  step: int  # optimizer steps done
  resumed_from: int  # 0: a fresh start
  terminated: bool  # stopped by SIGTERM (checkpoint saved)


@dataclasses.dataclass
class _Run:
  """Everything the loop needs, built once."""

  cfg: RunConfig
  opts: Options
  data: shards.Prepared
  mesh: Any
  model_cfg: Any
  model: step.Model
  steps: list[step.Step]
  ckpt: checkpoint.Checkpoints
  logger: metrics.Logger | None = None
  peak: float | None = None

  @property
  def ends(self) -> list[int]:
    return [int(e) for e in np.cumsum([p.steps for p in self.cfg.phases])]

  def meta(self, done: int, sampler: dict | None = None) -> dict:
    """The checkpoint's JSON: the step, the configuration, the data's fingerprint, and the
    sampler's state after ``done`` (None at a phase's end: the next starts afresh)."""
    out = {"step": done, "config": self.cfg.to_json(), "corpus": self.data.fingerprint}
    return out if sampler is None else {**out, "sampler": sampler}


def build(cfg: RunConfig, opts: Options) -> _Run:
  """The corpus, the mesh, the model and one jitted step per phase.

  Every check comes first: the settings, an earlier run's checkpoint in ``opts.out`` (its
  configuration, then its corpus), the batch's split over the devices; nothing is written to
  ``opts.out`` or compiled before they pass.
  """
  config.validate(cfg)
  ckpt_dir = os.path.join(opts.out, "checkpoints")
  previous = checkpoint.latest_meta(ckpt_dir)
  if previous is not None:
    checkpoint.check_resumable(previous, cfg.to_json())
  mesh = step.make_mesh(opts.devices)
  try:
    for p in cfg.phases:
      p.accumulation(mesh.size)
    data = prepared_data(cfg, opts)
  except (ValueError, FileNotFoundError) as e:
    raise Refused(str(e)) from None
  if previous is not None:
    checkpoint.check_resumable(previous, cfg.to_json(), data.fingerprint)
  elif opts.init_from is not None:
    _check_phase1_run(cfg, opts.init_from, data.fingerprint)
  rule = step.sharding_rule(mesh, cfg.fsdp)
  model_cfg = model_lib.bert_config(cfg.model, data.model_vocab)
  model = step.make_model(model_cfg, jnp.dtype(cfg.dtype), cfg.seed, rule, cfg.remat)
  args = dict(cfg.opt_args)
  schedules = [p.phase().schedule() for p in cfg.phases]
  txs = [optim.build(cfg.opt, sched, args) for sched in schedules]
  ratios = optim.has_trust_ratios(txs[0], model.abstract)
  steps = [
    step.make_step(model, tx, sched, mesh, rule, ratios)
    for tx, sched in zip(txs, schedules, strict=True)
  ]
  ckpt = checkpoint.Checkpoints(ckpt_dir)
  kind = mesh.devices.flat[0].device_kind
  return _Run(
    cfg,
    opts,
    data,
    mesh,
    model_cfg,
    model,
    steps,
    ckpt,
    peak=metrics.peak_flops(kind, opts.peak_tflops),
  )


def prepared_data(cfg: RunConfig, opts: Options) -> shards.Prepared:
  """``opts.data``, else ``opts.corpus`` (default: the King James Bible) prepared into OUT/data
  by process 0 (kept for the restarts), at every phase's length."""
  lens = sorted({p.seq_len for p in cfg.phases})
  if opts.data is not None:
    if opts.corpus or opts.vocab:
      raise ValueError("--data is prepared already: drop --corpus and --vocab (prepare's)")
    data = shards.Prepared.open(opts.data)
    for L in lens:
      data.rows("train", L)  # a length it lacks: refused by name
    return data
  where = os.path.join(opts.out, "data")
  if jax.process_index() == 0 and not _holds(where, lens):
    prepare_lib.prepare(
      where, opts.corpus, vocab=opts.vocab, vocab_size=opts.vocab_size, case=opts.vocab_case,
      seq_lens=lens, held_out_every=opts.held_out_every,
    )  # fmt: skip
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("pretrain data prepared")
  return shards.Prepared.open(where)


def _holds(directory: str, lens: list[int]) -> bool:
  try:
    return set(lens) <= set(shards.Prepared.open(directory).seq_lens)
  except (FileNotFoundError, ValueError):
    return False


def _check_phase1_run(cfg: RunConfig, other: str, fingerprint: str) -> None:
  """Refuse to start phase 2 from ``other`` unless its latest checkpoint ends the same phase 1
  (model, dtype, optimizer, seed, phase 1's settings) on the same data."""
  meta = checkpoint.latest_meta(os.path.join(other, "checkpoints"))
  if meta is None:
    raise Refused(f"--init-from {other}: no checkpoint in {other}/checkpoints")
  if len(cfg.phases) < 2:
    raise Refused(f"--init-from {other}: this run has no phase 2 to start")
  if checkpoint.per_layer(meta):
    raise Refused(f"--init-from {other}: {checkpoint.PER_LAYER}")
  theirs, ours = meta["config"], cfg.to_json()
  keys = ("model", "dtype", "opt", "opt_args", "seed")
  differ = [k for k in keys if theirs.get(k) != ours[k]]
  if theirs["phases"][0] != ours["phases"][0]:
    differ.append("phase1")
  if differ:
    raise Refused(f"--init-from {other}: its run differs in {differ}")
  if meta["step"] != cfg.phases[0].steps:
    raise Refused(f"--init-from {other}: its latest checkpoint is step {meta['step']}, "
                  f"not phase 1's end ({cfg.phases[0].steps})")  # fmt: skip
  if meta["corpus"] != fingerprint:
    raise Refused(f"--init-from {other}: it trained on other data or another vocabulary")


def start_state(run: _Run) -> tuple[int, int, Any, Any, dict | None]:
  """``(done, state_phase, params, opt_state, sampler)``: from the latest checkpoint (with the
  sampler's state if it stopped inside a phase), else from ``init_from``'s phase 1 (checked by
  ``build``), else fresh."""
  done = run.ckpt.latest()
  if done is None and run.opts.init_from is not None:
    done = run.ends[0]
    target = {"params": run.model.abstract, "opt_state": run.steps[0].state_abstract}
    other = checkpoint.Checkpoints(os.path.join(run.opts.init_from, "checkpoints"))
    try:
      state, _ = other.restore(target, done)
    finally:
      other.manager.close()
    return done, 0, state["params"], state["opt_state"], None
  if done is None:
    params = run.model.init()
    return 0, 0, params, run.steps[0].init(params), None
  phase = int(np.searchsorted(run.ends, done))  # a phase's last step belongs to it
  target = {"params": run.model.abstract, "opt_state": run.steps[phase].state_abstract}
  state, meta = run.ckpt.restore(target, done)
  checkpoint.check_resumable(meta, run.cfg.to_json(), run.data.fingerprint)  # checked in build
  return done, phase, state["params"], state["opt_state"], meta.get("sampler")


def train(cfg: RunConfig, opts: Options) -> Result:
  """Train ``cfg`` through its phases, resuming from ``opts.out`` if it holds a checkpoint."""
  run = build(cfg, opts)
  done, state_phase, params, opt_state, sampler = start_state(run)
  lead = jax.process_index() == 0
  run.logger = metrics.Logger(opts.out, done, cfg.total_steps, lead, opts.progress)
  run.logger.message(_describe(run, done))
  terminate = checkpoint.Terminate()
  start, stopped = done, False
  try:
    for p, st in enumerate(run.steps):
      if done >= run.ends[p]:
        continue
      if state_phase < p:  # the recipe's phase 2: moments kept, schedule restarted
        opt_state, state_phase = st.carry(params, opt_state), p
      params, opt_state, done, stopped = _phase(run, p, params, opt_state, done, terminate, sampler)
      sampler = None
      if stopped:
        break
    if not stopped:
      run.ckpt.save(done, {"params": params, "opt_state": opt_state}, run.meta(done))
  finally:
    run.ckpt.close()
    run.logger.close()
    terminate.restore()
  return Result(params, done, start, stopped)


class Batches:
  """Phase ``p``'s batches as this process reads them: its slice of each global batch from the
  training shard (``shards.Sampler``), masked, and the sampler's state after it."""

  def __init__(self, run: _Run, p: int, sampler_state: dict | None = None) -> None:
    phase = run.cfg.phases[p]
    self.rows = run.data.rows("train", phase.seq_len)
    self.sampler = shards.Sampler(len(self.rows), phase.batch, run.cfg.seed, p)
    if sampler_state is not None:
      self.sampler.restore(sampler_state)
    self.key = (run.cfg.seed, p)
    self.data = run.data
    self.where = (jax.process_index(), jax.process_count())

  def next(self) -> tuple[shards.MLMBatch, dict]:
    rows, samples = self.sampler.take(*self.where)
    order = np.argsort(rows, kind="stable")  # the memmap read in file order
    seqs = np.empty((len(rows), self.rows.shape[1]), self.rows.dtype)
    seqs[order] = self.rows[rows[order]]
    batch = shards.mask(seqs, samples, self.key, special_ids=self.data.special_ids,
                        vocab_size=self.data.vocab_size)  # fmt: skip
    return batch, self.sampler.state_dict()


def eval_batch(run: _Run, p: int) -> shards.MLMBatch | None:
  """Phase ``p``'s held-out examples as global arrays: the first sequences of the held-out shard
  (at most ``EVAL_SEQUENCES``, a whole number of passes), masked the same way every time."""
  phase = run.cfg.phases[p]
  per_pass = phase.batch // phase.accumulation(run.mesh.size)
  held = run.data.rows("held_out", phase.seq_len)
  n = min(EVAL_SEQUENCES, len(held)) // per_pass * per_pass
  if n == 0:
    return None
  i, count = jax.process_index(), jax.process_count()
  mine = np.arange(n // count * i, n // count * (i + 1))
  local = shards.mask(np.asarray(held[mine]), mine, (run.cfg.seed, p, EVAL_KEY),
                      special_ids=run.data.special_ids, vocab_size=run.data.vocab_size)  # fmt: skip
  return step.global_batch(local, n // per_pass, run.steps[p].batch_sharding, i, count)


def _phase(run: _Run, p: int, params, opt_state, done: int, terminate, sampler=None) -> tuple:
  """Train phase ``p`` from global step ``done`` to its end (or a SIGTERM); ``sampler``: the
  state saved with a checkpoint inside this phase."""
  phase, st, cfg = run.cfg.phases[p], run.steps[p], run.cfg
  begin = run.ends[p] - phase.steps
  if done > begin and sampler is None:
    raise ValueError(f"the checkpoint of step {done} has no sampler state to resume phase {p + 1}")
  batches = Batches(run, p, sampler if done > begin else None)
  held_out = eval_batch(run, p)
  if held_out is None:
    run.logger.message(f"phase {p + 1}: no held-out sequences of {phase.seq_len}: no evaluation")
  k = phase.accumulation(run.mesh.size)
  flops = phase.batch * model_lib.train_flops(
    run.model_cfg, phase.seq_len, num_predictions(phase.seq_len)
  )
  window = _Window()
  multi = jax.process_count() > 1
  where = (jax.process_index(), jax.process_count())
  with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the next batch while this one trains
    ahead = pool.submit(batches.next)
    for t in range(done - begin, phase.steps):
      local, sampled = ahead.result()
      if t + 1 < phase.steps:
        ahead = pool.submit(batches.next)
      batch = step.global_batch(local, k, st.batch_sharding, *where)
      params, opt_state, raw = st.update(params, opt_state, batch, np.int32(t))
      done += 1
      run.logger.advance()
      window.add(raw)
      last = t + 1 == phase.steps
      meta = run.meta(done, None if last else sampled)
      evaluated = held_out is not None and (done % cfg.eval_every == 0 or last)
      if evaluated:
        with window.excluded("eval_s", raw):
          scores = jax.device_get(st.evaluate(params, held_out))
      if done % cfg.log_every == 0 or last or evaluated:
        values = window.summary(run, raw, phase, flops)
        if evaluated:
          values.update({key: float(v) for key, v in scores.items()})
        run.logger.log(done, p, values)
      if done % cfg.checkpoint_every == 0:
        with window.excluded("checkpoint_s", params):
          run.ckpt.save(done, {"params": params, "opt_state": opt_state}, meta)
      _rehearse_kill(run.opts.kill_at, done)
      logged = done % cfg.log_every == 0 or last
      if (logged or not multi) and terminate.requested():
        run.ckpt.save(done, {"params": params, "opt_state": opt_state}, meta)
        run.logger.message(f"SIGTERM: saved step {done}; run the same command again to resume")
        return params, opt_state, done, True
  return params, opt_state, done, False


class _Window:
  """Throughput over the steps since the last log line (a phase's first step, which compiles,
  is left out), and the time of what is not training (checkpoint saves), which is kept out."""

  def __init__(self) -> None:
    self.started = False
    self.steps = 0
    self.since = 0.0
    self.other: dict[str, float] = {}

  @contextlib.contextmanager
  def excluded(self, name: str, ready):
    """Time the block as ``name``, not as training: ``ready`` (the step's output) is waited
    for first, so the step's own compute is not counted as the block's."""
    jax.block_until_ready(ready)
    start = time.perf_counter()
    try:
      yield
    finally:
      self.other[name] = self.other.get(name, 0.0) + time.perf_counter() - start

  def add(self, raw) -> None:
    if not self.started:
      jax.block_until_ready(raw)
      self.started, self.steps, self.since = True, 0, time.perf_counter()
    else:
      self.steps += 1

  def summary(self, run: _Run, raw, phase, flops: float) -> dict[str, float]:
    raw = jax.device_get(raw)
    now = time.perf_counter()
    other = {k: v for k, v in self.other.items() if self.started}
    seconds = max(now - self.since - sum(other.values()), 1e-9)
    values = metrics.summarize(
      raw, tokens=self.steps * phase.batch * phase.seq_len, seconds=seconds,
      flops=self.steps * flops, devices=run.mesh.size, peak=run.peak,
    )  # fmt: skip
    if self.steps == 0:  # nothing timed yet
      values = {k: v for k, v in values.items() if k not in ("tokens_per_s_per_device", "mfu")}
    else:
      values["step_s"] = seconds / self.steps
    values.update(other)
    self.steps, self.since, self.other = 0, now, {}
    return values


def _rehearse_kill(kill_at: tuple[int, int] | None, done: int) -> None:
  if kill_at is not None and kill_at[0] == done:
    os.kill(os.getpid(), kill_at[1])  # SIGTERM's handler runs before the next line


def _describe(run: _Run, done: int) -> str:
  leaves = jax.tree.leaves(run.model.abstract)
  n_params = sum(int(np.prod(a.shape)) for a in leaves)
  split = sum(not a.sharding.is_fully_replicated for a in leaves)
  lines = [
    f"{jax.process_count()} process(es), {run.mesh.size} device(s) "
    f"({run.mesh.devices.flat[0].device_kind}); BERT-{run.cfg.model}: {n_params / 1e6:.1f}M "
    f"params, vocab {run.data.vocab_size} (model {run.model_cfg.vocab_size}), "
    f"{run.data.index['tokens']['train']} tokens ({run.data.directory}); {run.cfg.opt}; "
    f"compute {run.cfg.dtype}",
  ]
  lines.append(f"parameter arrays split over the devices: {split} of {len(leaves)}")
  for i, p in enumerate(run.cfg.phases):
    k = p.accumulation(run.mesh.size)
    lines.append(
      f"phase {i + 1}: {p.steps} steps of {p.batch} x {p.seq_len} tokens "
      f"({k} x {p.batch // k} per step), peak lr {p.peak_lr:.3g}, warm-up {p.warmup}"
    )
  lines.append(f"resuming from step {done}" if done else "starting at step 0")
  return "\n".join(lines)
