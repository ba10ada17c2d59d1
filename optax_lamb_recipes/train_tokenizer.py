"""Train a WordPiece tokenizer on the King James Bible, deterministically.

    python -m optax_lamb_recipes.train_tokenizer                   # writes ./kjv_wordpiece.json
    python -m optax_lamb_recipes.train_tokenizer --out other.json

The trainer in ``tokenizers`` picks the same 2,048 tokens on every run but numbers the ones
tied in frequency in hash order, so two runs disagree on a few dozen ids. Here the ids are
reassigned in a fixed order (special tokens first, then the rest sorted), which makes the
output the same on every run. The package's committed ``kjv_wordpiece.json`` holds the same
vocabulary (tested) with the ids of an earlier, unsorted run; it is kept as it is because the
committed sweep results were trained with those ids. Nothing is written into the package
unless ``--out`` points there.
"""

from __future__ import annotations

import argparse
import json

from optax_lamb_recipes import data


def train(vocab_size: int = 2048, texts=None):
  """A ``tokenizers.Tokenizer`` with ids in a fixed order (identical on every run).

  ``texts``: the lines to train on (default: the King James Bible, one chapter a line).
  """
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  trainer = trainers.WordPieceTrainer(
    vocab_size=vocab_size, special_tokens=list(data.SPECIAL_TOKENS), show_progress=False
  )
  texts = data.kjv_text().split("\n") if texts is None else texts
  tok.train_from_iterator(texts, trainer=trainer)
  spec = json.loads(tok.to_str())
  vocab = spec["model"]["vocab"]
  rest = sorted(t for t in vocab if t not in data.SPECIAL_TOKENS)
  spec["model"]["vocab"] = {t: i for i, t in enumerate([*data.SPECIAL_TOKENS, *rest])}
  return Tokenizer.from_str(json.dumps(spec))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab-size", type=int, default=2048)
  parser.add_argument("--out", default=data.TOKENIZER_FILE, help="where to write the JSON")
  args = parser.parse_args(argv)
  tok = train(args.vocab_size)
  tok.save(args.out)
  print(f"wrote {args.out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
  main()
