"""The corpus's text and its WordPiece tokenizer (``prepare`` tokenizes with them), and the
corpus tokenized in memory (``load_corpus``: small corpora, tests)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import TYPE_CHECKING

import numpy as np

from optax_lamb_recipes import data as data_lib
from optax_lamb_recipes import train_tokenizer

if TYPE_CHECKING:
  from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"  # a trained tokenizer is kept beside the checkpoints


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token ids of the whole corpus (lines joined by [SEP]) and the tokenizer's special ids."""

  ids: np.ndarray
  vocab_size: int  # the tokenizer's
  mask_id: int
  fingerprint: str  # of the ids and the vocabulary: a resumed run checks it

  @property
  def model_vocab(self) -> int:
    """The model's vocabulary: the tokenizer's rounded up to a multiple of 128 (for matmuls)."""
    return -(-self.vocab_size // 128) * 128


def read_lines(paths: list[str] | None) -> list[str]:
  """Non-empty lines of the given text files, or the King James Bible (a paragraph a line)."""
  if not paths:
    return data_lib.kjv_text().split("\n")
  lines = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      lines.extend(line.strip() for line in f)
  lines = [line for line in lines if line]
  if not lines:
    raise ValueError(f"no text in {paths}")
  return lines


CASES = ("auto", "cased", "uncased")


def load_tokenizer(vocab: str | None, lines: list[str], vocab_size: int, out_dir: str | None, *,
                   default_corpus: bool, case: str = "auto") -> Tokenizer:  # fmt: skip
  """The tokenizer: ``vocab`` (a tokenizers JSON or a BERT ``vocab.txt``), else one kept in
  ``out_dir`` by an earlier start, else the committed KJV one (default corpus), else one trained
  on ``lines`` with ``tokenizers`` (and kept in ``out_dir``).

  ``case``: ``cased`` keeps the text's case, ``uncased`` lowercases it (and strips accents, as
  BERT's uncased models); ``auto`` takes a JSON's own normalizer, and a ``vocab.txt`` as cased
  when one of its tokens has a capital letter (BERT's cased vocabularies do, uncased ones not).
  The vocabularies trained here and the committed one are uncased.
  """
  from tokenizers import Tokenizer

  if case not in CASES:
    raise ValueError(f"case={case!r}: one of {CASES}")
  kept = os.path.join(out_dir, TOKENIZER_FILE) if out_dir else None
  if vocab is not None:
    if vocab.endswith(".json"):
      tok = Tokenizer.from_file(vocab)
      if case != "auto":
        tok.normalizer = _bert_normalizer(lowercase=case == "uncased")
    else:
      tok = _from_vocab_txt(vocab, case)
  elif case == "cased":
    raise ValueError("case='cased' needs a cased --vocab (the vocabularies made here are uncased)")
  elif kept and os.path.exists(kept):
    tok = Tokenizer.from_file(kept)
  elif default_corpus:
    tok = data_lib.load_tokenizer()
  else:
    tok = train_tokenizer.train(vocab_size, lines)
    if kept:
      os.makedirs(out_dir, exist_ok=True)
      tok.save(kept)
  missing = [t for t in data_lib.SPECIAL_TOKENS if tok.token_to_id(t) is None]
  if missing:
    raise ValueError(f"the vocabulary has no {missing}")
  return tok


def _bert_normalizer(lowercase: bool):
  from tokenizers import normalizers

  return normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)


def vocab_is_cased(path: str) -> bool:
  """Whether a ``vocab.txt`` has a token with a capital letter (the [SPECIAL] ones aside)."""
  with open(path, encoding="utf-8") as f:
    tokens = (line.strip() for line in f)
    return any(t.lower() != t for t in tokens if not (t.startswith("[") and t.endswith("]")))


def _from_vocab_txt(path: str, case: str = "auto") -> Tokenizer:
  """A BERT ``vocab.txt`` (one token a line) as a BERT WordPiece tokenizer (see ``case``)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  tok = Tokenizer(models.WordPiece.from_file(path, unk_token="[UNK]"))
  cased = vocab_is_cased(path) if case == "auto" else case == "cased"
  tok.normalizer = _bert_normalizer(lowercase=not cased)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  return tok


def load_corpus(
  paths: list[str] | None = None,
  vocab: str | None = None,
  vocab_size: int = 2048,
  out_dir: str | None = None,
  case: str = "auto",
) -> Corpus:
  """The corpus tokenized (see :func:`load_tokenizer` for which tokenizer)."""
  lines = read_lines(paths)
  tok = load_tokenizer(vocab, lines, vocab_size, out_dir, default_corpus=not paths, case=case)
  ids = data_lib.token_ids(lines, tok)
  digest = hashlib.sha256(ids.tobytes())
  digest.update(tok.to_str().encode())
  return Corpus(ids, tok.get_vocab_size(), tok.token_to_id("[MASK]"), digest.hexdigest()[:16])
