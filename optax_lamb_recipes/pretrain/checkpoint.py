"""Orbax checkpoints of a run (every N steps and at SIGTERM) and what a resumed run checks.

A checkpoint holds the parameters, the optimizer state and, as JSON, the step, the run's
configuration and the corpus fingerprint: the data of a step are a function of the seed and
the step (``data.Stream``), so a resumed run re-reads exactly what it would have read. Saving is
asynchronous; orbax writes into a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

EXIT_TERMINATED = 143  # 128 + SIGTERM: the run saved and stopped early; run it again to resume


class Checkpoints:
  """``save(step, state, meta)`` and ``restore(target)`` under ``directory``."""

  def __init__(self, directory: str, keep: int = 3) -> None:
    self.manager = ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      item_names=("state", "meta"),
    )
    self.saved = self.manager.latest_step()

  def latest(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Start writing ``step`` (in the background); a step already saved is not written again."""
    if step == self.saved:
      return
    self.saved = step
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    self.manager.save(step, args=args, force=True)

  def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
    """``(state, meta)`` of ``step`` (default: the latest), into ``target``'s shardings."""
    step = self.latest() if step is None else step
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
    out = self.manager.restore(step, args=args)
    return out.state, out.meta

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


CADENCES = ("log_every", "checkpoint_every", "eval_every")  # may change between restarts
PER_LAYER = (
  "the checkpoint holds its layers one by one (written before they were stacked) "
  "and cannot resume; pretrain.model.stack_layers converts its params"
)


def per_layer(meta: dict) -> bool:
  """Whether ``meta``'s checkpoint has unstacked layers: its configuration predates ``remat``,
  which came with the stacked layers (the refusal names that, not orbax's tree mismatch)."""
  return "remat" not in meta["config"]


def check_resumable(meta: dict, config: dict, fingerprint: str | None = None) -> None:
  """Refuse a checkpoint written by another configuration or corpus (the curve would differ);
  ``fingerprint`` None: the configuration only (checked before the corpus is read)."""
  if per_layer(meta):
    raise SystemExit(f"{PER_LAYER}; use another --out to start anew")
  differ = sorted(k for k in config if k not in CADENCES and meta["config"].get(k) != config[k])
  if differ:
    raise SystemExit(f"the checkpoint's run differs in {differ}; use another --out to start anew")
  if fingerprint is not None and meta["corpus"] != fingerprint:
    raise SystemExit("the checkpoint was trained on another corpus or vocabulary")


def latest_meta(directory: str) -> dict | None:
  """The JSON saved with the latest checkpoint in ``directory`` (None: no checkpoint), read
  without the arrays and without creating anything: a run compares it before restoring, so a
  checkpoint of another model is refused by name rather than by orbax's structure mismatch."""
  if not os.path.isdir(directory):
    return None
  manager = ocp.CheckpointManager(
    os.path.abspath(directory),
    options=ocp.CheckpointManagerOptions(create=False),
    item_handlers={"meta": ocp.JsonCheckpointHandler()},
  )
  try:
    step = manager.latest_step()
    if step is None:
      return None
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  finally:
    manager.close()


class Terminate:
  """Set by SIGTERM; ``requested()`` agrees over every process (one may get it first)."""

  def __init__(self) -> None:
    self.flag = False
    self.previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.flag = True

  def requested(self) -> bool:
    if jax.process_count() == 1:
      return self.flag
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray(self.flag, np.int32))
    return bool(np.any(flags))

  def restore(self) -> None:
    signal.signal(signal.SIGTERM, self.previous)


def load(directory: str, step: int | None = None) -> tuple[dict, dict]:
  """``(state, meta)`` of a run's checkpoint (default: the latest) as NumPy arrays, whatever
  devices and processes wrote it: ``state["params"]`` for evaluation or export."""
  handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  manager = ocp.CheckpointManager(os.path.abspath(directory), item_handlers=handlers)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  tree = manager.item_metadata(step)["state"]
  tree = getattr(tree, "tree", tree)
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  args = ocp.args.Composite(
    state=ocp.args.PyTreeRestore(restore_args=as_numpy), meta=ocp.args.JsonRestore()
  )
  out = manager.restore(step, args=args)
  manager.close()
  return out.state, out.meta
