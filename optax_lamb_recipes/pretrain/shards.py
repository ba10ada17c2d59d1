"""Prepared data (``prepare``'s output), the sampler that reads it, and BERT's masking.

A prepared directory holds, per sequence length ``L``, ``train-L.bin`` and ``held_out-L.bin``:
``[n, L]`` token ids as raw NumPy memmaps (``uint16`` when the vocabulary fits, else
``int32``), each row ``[CLS]`` and then ``L - 1`` tokens of the text, every line (a sentence,
a paragraph: a segment) ending with ``[SEP]``; and ``index.json``: the files' shapes and dtype,
the tokenizer's special ids and vocabulary size, the corpus's fingerprint. ``tokenizer.json``
beside them is the tokenizer that wrote them.

The sampler gives each step's global batch as a permutation of the rows per epoch, seeded by
(seed, phase, epoch); each process reads only its contiguous slice of the batch. Its state
(seed, phase, epoch, position) goes into the checkpoint. The masks come from a counter-based
generator keyed by (seed, phase) and each sample's number in the phase's stream, so a sample's
mask does not depend on which process reads it, nor on the order of the reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from optax_lamb_recipes.data import SPECIAL_TOKENS, MLMBatch, num_predictions

INDEX_FILE = "index.json"
FORMAT = 1
SPLITS = ("train", "held_out")


def shard_file(split: str, seq_len: int) -> str:
  return f"{split}-{seq_len}.bin"


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A prepared directory: ``rows(split, seq_len)`` memory-maps a shard (nothing is read yet)."""

  directory: str
  index: dict

  @classmethod
  def open(cls, directory: str) -> Prepared:
    path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(path):
      raise FileNotFoundError(
        f"no prepared data in {directory} (no {INDEX_FILE}): "
        "run python -m optax_lamb_recipes.pretrain.prepare"
      )
    with open(path) as f:
      index = json.load(f)
    if index.get("format") != FORMAT:
      raise ValueError(f"{path}: format {index.get('format')}, this version reads {FORMAT}")
    return cls(directory, index)

  @property
  def vocab_size(self) -> int:
    return self.index["vocab_size"]

  @property
  def model_vocab(self) -> int:
    """The model's vocabulary: the tokenizer's rounded up to a multiple of 128 (for matmuls)."""
    return -(-self.vocab_size // 128) * 128

  @property
  def special_ids(self) -> dict[str, int]:
    return self.index["special_ids"]

  @property
  def fingerprint(self) -> str:
    return self.index["fingerprint"]

  @property
  def seq_lens(self) -> list[int]:
    return sorted(int(L) for L in self.index["shards"])

  def rows(self, split: str, seq_len: int) -> np.ndarray:
    """The ``[n, seq_len]`` shard of ``split`` (``train`` or ``held_out``), memory-mapped."""
    if seq_len not in self.seq_lens:
      raise ValueError(
        f"{self.directory} has sequences of length {self.seq_lens}, not {seq_len}: "
        f"prepare it with --seq-len {seq_len}"
      )
    n = self.index["shards"][str(seq_len)][split]
    if n == 0:
      return np.zeros((0, seq_len), self.index["dtype"])
    path = os.path.join(self.directory, shard_file(split, seq_len))
    return np.memmap(path, dtype=self.index["dtype"], mode="r", shape=(n, seq_len))


# --- the sampler ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplerState:
  """Where a phase's sampler stands: ``position`` rows into epoch ``epoch`` of its order."""

  seed: int
  phase: int
  epoch: int = 0
  position: int = 0


class Sampler:
  """A phase's global batches of ``batch`` rows out of ``n_rows``: epochs of fresh
  permutations end to end; ``take`` gives a process its slice and moves the whole batch on."""

  def __init__(self, n_rows: int, batch: int, seed: int, phase: int) -> None:
    if n_rows < 1:
      raise ValueError(f"no sequences to sample (n_rows={n_rows})")
    self.n_rows, self.batch = n_rows, batch
    self.state = SamplerState(seed, phase)
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      if len(self._orders) > 1:
        self._orders.pop(min(self._orders))
      rng = np.random.default_rng((self.state.seed, self.state.phase, epoch))
      self._orders[epoch] = rng.permutation(self.n_rows)
    return self._orders[epoch]

  def take(self, process_index: int = 0, process_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, samples)`` of the next global batch that process ``process_index`` of
    ``process_count`` reads: its contiguous slice, ``batch / process_count`` rows, and their
    sample numbers in the phase's stream (for the masks); the state moves by the whole batch."""
    if self.batch % process_count or not 0 <= process_index < process_count:
      raise ValueError(
        f"process {process_index} of {process_count}: the batch of {self.batch} does not split"
      )
    per = self.batch // process_count
    s = self.state
    samples = s.epoch * self.n_rows + s.position + np.arange(per * process_index, per * (process_index + 1))  # fmt: skip
    epochs = samples // self.n_rows
    rows = np.empty_like(samples)
    for e in np.unique(epochs):
      at = epochs == e
      rows[at] = self._order(int(e))[samples[at] % self.n_rows]
    end = s.epoch * self.n_rows + s.position + self.batch
    self.state = dataclasses.replace(s, epoch=end // self.n_rows, position=end % self.n_rows)
    return rows, samples

  def state_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self.state)

  def restore(self, state: dict[str, Any]) -> None:
    """Continue from a saved ``state_dict`` (of the same seed and phase)."""
    saved = SamplerState(**state)
    if (saved.seed, saved.phase) != (self.state.seed, self.state.phase):
      raise ValueError(f"a sampler state of seed {saved.seed}, phase {saved.phase} "
                       f"restored into seed {self.state.seed}, phase {self.state.phase}")  # fmt: skip
    if not 0 <= saved.position < self.n_rows:
      raise ValueError(f"sampler position {saved.position} out of the {self.n_rows} rows")
    self.state = saved


# --- masking -------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer (Steele et al. 2014): a bijection of uint64 that scrambles bits."""
  with np.errstate(over="ignore"):
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniform(key: tuple[int, ...], counters: np.ndarray) -> np.ndarray:
  """Uniform floats in [0, 1), one per counter: a function of ``key`` and the counter only."""
  k = np.zeros((), np.uint64)
  for part in key:
    k = _mix(k ^ np.uint64(part))
  bits = _mix(_mix(k ^ counters.astype(np.uint64)))
  return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


# Counter streams of one sample: positions' priorities, the replacement draw, the random token.
_PRIORITY, _CHOICE, _TOKEN = 0, 1, 2


def mask(
  seqs: np.ndarray,
  samples: np.ndarray,
  key: tuple[int, ...],
  *,
  special_ids: dict[str, int],
  vocab_size: int,
  mask_prob: float = 0.15,
) -> MLMBatch:
  """BERT's masking of ``seqs`` ``[n, L]``: ``num_predictions(L)`` positions per sequence, drawn
  among its regular tokens (never [CLS], [SEP], [PAD], [MASK] or [UNK]), 80% replaced by [MASK],
  10% by a random regular token, 10% kept. ``samples`` number the rows in their stream; the
  draws are a function of (``key``, sample, position), so a row masks alike wherever it is read.

  A fixed count per sequence makes the batch's mean loss the mean of any split's means (the
  gradient accumulation is exact).
  """
  n, seq_len = seqs.shape
  n_pred = num_predictions(seq_len, mask_prob)
  specials = np.asarray(sorted(special_ids[t] for t in SPECIAL_TOKENS), np.int64)
  regular = ~np.isin(seqs, specials)
  if n and regular.sum(axis=1).min() < n_pred:
    raise ValueError(f"a sequence of length {seq_len} has fewer than {n_pred} regular tokens")
  ids = samples.astype(np.int64)[:, None]
  priority = uniform((*key, _PRIORITY), ids * seq_len + np.arange(seq_len))
  priority[~regular] = 2.0  # after every regular position
  positions = np.sort(np.argsort(priority, axis=1, kind="stable")[:, :n_pred], axis=1)
  targets = np.take_along_axis(seqs, positions, axis=1).astype(np.int32)
  slots = ids * n_pred + np.arange(n_pred)
  u = uniform((*key, _CHOICE), slots)
  pool = np.setdiff1d(np.arange(vocab_size), specials)  # the regular ids, sorted
  random_tokens = pool[(uniform((*key, _TOKEN), slots) * len(pool)).astype(np.int64)]
  replaced = np.where(u < 0.8, special_ids["[MASK]"], np.where(u < 0.9, random_tokens, targets))
  inputs = seqs.astype(np.int32)
  np.put_along_axis(inputs, positions, replaced.astype(np.int32), axis=1)
  return MLMBatch(inputs, positions.astype(np.int32), targets)
