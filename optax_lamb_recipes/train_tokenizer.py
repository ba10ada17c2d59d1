"""Train the committed WordPiece tokenizer on the King James Bible.

Run once: ``python -m optax_lamb_recipes.train_tokenizer`` (deterministic, a few seconds);
it writes ``optax_lamb_recipes/kjv_wordpiece.json``.
"""

from __future__ import annotations

import argparse
import os

from optax_lamb_recipes import data


def train(vocab_size: int = 2048):
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  trainer = trainers.WordPieceTrainer(
    vocab_size=vocab_size, special_tokens=list(data.SPECIAL_TOKENS), show_progress=False
  )
  tok.train_from_iterator(data.kjv_text().split("\n"), trainer=trainer)
  return tok


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--vocab-size", type=int, default=2048)
  args = parser.parse_args()
  tok = train(args.vocab_size)
  path = os.path.join(os.path.dirname(__file__), data.TOKENIZER_FILE)
  tok.save(path)
  print(f"wrote {path}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
  main()
