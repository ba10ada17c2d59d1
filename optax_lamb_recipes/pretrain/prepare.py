"""Tokenize a text corpus once and cut it into fixed-length shards that training memory-maps.

    python -m optax_lamb_recipes.pretrain.prepare --corpus books/*.txt --vocab vocab.txt \\
        --seq-len 128 512 --out data/books

Text files hold one sentence or paragraph a line (a segment); blank lines (document breaks) are
skipped. Every line ends with [SEP], so every segment and document does; the lines are packed
end to end (RoBERTa's FULL-SENTENCES packing) and cut into rows of ``[CLS]`` + ``L - 1`` tokens,
with no padding: the model has no attention mask, so a padded row would attend to its padding.
Every ``--held-out-every``-th line goes to the held-out split instead (the same lines at every
length, so phase 2 never evaluates on text phase 1 trained on). The tokens stream through
``tokenizers`` in chunks of lines; only a vocabulary trained here (no ``--vocab``) needs the
whole text in memory. ``shards.py`` describes what is written.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from optax_lamb_recipes import data as data_lib
from optax_lamb_recipes.pretrain import shards
from optax_lamb_recipes.pretrain.data import CASES, TOKENIZER_FILE, load_tokenizer, read_lines

CHUNK_LINES = 4096  # lines per call of the tokenizer
CHUNK_ROWS = 65536  # rows per write of a shard


def iter_lines(paths: list[str] | None) -> Iterator[str]:
  """The non-empty lines of ``paths`` (stripped), or the King James Bible's."""
  if not paths:
    yield from (line for line in data_lib.kjv_text().split("\n") if line.strip())
    return
  for path in paths:
    with open(path, encoding="utf-8") as f:
      yield from (s for s in (line.strip() for line in f) if s)


def _batches(items: Iterable, size: int) -> Iterator[list]:
  it = iter(items)
  while chunk := list(itertools.islice(it, size)):
    yield chunk


def prepare(
  out_dir: str,
  paths: list[str] | None = None,
  *,
  vocab: str | None = None,
  vocab_size: int = 2048,
  case: str = "auto",
  seq_lens: Iterable[int] = (128, 512),
  held_out_every: int = 100,
) -> shards.Prepared:
  """Write ``out_dir`` (see ``shards``) from ``paths`` (default: the King James Bible)."""
  seq_lens = sorted({int(L) for L in seq_lens})
  if not seq_lens or seq_lens[0] < 8:
    raise ValueError(f"seq_lens={seq_lens}: at least one length, each >= 8")
  if held_out_every < 0 or held_out_every == 1:
    raise ValueError(f"held_out_every={held_out_every}: 0 (none) or >= 2")
  for path in paths or ():
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--corpus {path}: no such file")
  os.makedirs(out_dir, exist_ok=True)
  index_path = os.path.join(out_dir, shards.INDEX_FILE)
  if os.path.exists(index_path):
    os.remove(index_path)  # incomplete until rewritten
  trained = vocab is None and bool(paths)
  lines = read_lines(paths) if trained else []
  tok = load_tokenizer(vocab, lines, vocab_size, None, default_corpus=not paths, case=case)
  tok.save(os.path.join(out_dir, TOKENIZER_FILE))
  special_ids = {t: tok.token_to_id(t) for t in data_lib.SPECIAL_TOKENS}
  n_vocab = tok.get_vocab_size()
  dtype = np.dtype(np.uint16 if n_vocab <= 2**16 else np.int32)

  # 1. The token streams (a line's tokens, then [SEP]) of both splits, in temporary files.
  streams = {s: os.path.join(out_dir, f"{s}.tokens.tmp") for s in shards.SPLITS}
  digests = {s: hashlib.sha256() for s in shards.SPLITS}
  counts = dict.fromkeys(shards.SPLITS, 0)
  files = {s: open(p, "wb") for s, p in streams.items()}
  n_lines = 0
  try:
    for chunk in _batches(iter_lines(paths), CHUNK_LINES):
      encoded = tok.encode_batch(chunk, add_special_tokens=False)
      for e in encoded:
        split = "held_out" if held_out_every and n_lines % held_out_every == held_out_every - 1 else "train"  # fmt: skip
        ids = np.asarray([*e.ids, special_ids["[SEP]"]], dtype)
        files[split].write(ids.tobytes())
        digests[split].update(ids.astype("<i4").tobytes())
        counts[split] += len(ids)
        n_lines += 1
  finally:
    for f in files.values():
      f.close()
  if counts["train"] == 0:
    raise ValueError(f"no text in {paths}")

  # 2. Rows of [CLS] + L - 1 tokens, per split and length.
  rows: dict[str, dict[str, int]] = {}
  for L in seq_lens:
    rows[str(L)] = {}
    for split in shards.SPLITS:
      rows[str(L)][split] = _write_rows(
        streams[split], counts[split], dtype, L, special_ids,
        os.path.join(out_dir, shards.shard_file(split, L)),
      )  # fmt: skip
    if rows[str(L)]["train"] == 0:
      raise ValueError(f"the corpus has fewer than {L - 1} tokens: no sequence of length {L}")
  for path in streams.values():
    os.remove(path)

  fingerprint = hashlib.sha256()
  for split in shards.SPLITS:
    fingerprint.update(digests[split].digest())
  fingerprint.update(tok.to_str().encode())
  fingerprint.update(str(held_out_every).encode())
  index = {
    "format": shards.FORMAT,
    "dtype": dtype.name,
    "vocab_size": n_vocab,
    "special_ids": special_ids,
    "fingerprint": fingerprint.hexdigest()[:16],
    "lines": n_lines,
    "tokens": counts,
    "held_out_every": held_out_every,
    "shards": rows,
  }
  tmp = index_path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(index, f, indent=1)
  os.replace(tmp, index_path)  # the directory is complete once index.json exists
  return shards.Prepared(out_dir, index)


def _write_rows(stream: str, n_tokens: int, dtype, seq_len: int, special_ids, path: str) -> int:
  """Cut the token stream into ``[n, seq_len]`` rows of [CLS] + ``seq_len - 1`` tokens (the
  tail is dropped); refuse rows with too few maskable tokens. Returns ``n``."""
  body = seq_len - 1
  n = n_tokens // body
  if os.path.exists(path):
    os.remove(path)
  if n == 0:
    return 0
  tokens = np.memmap(stream, dtype=dtype, mode="r", shape=(n * body,))
  out = np.memmap(path, dtype=dtype, mode="w+", shape=(n, seq_len))
  specials = list(special_ids.values())
  need = data_lib.num_predictions(seq_len)
  for a in range(0, n, CHUNK_ROWS):
    b = min(n, a + CHUNK_ROWS)
    block = tokens[a * body : b * body].reshape(b - a, body)
    fewest = int((~np.isin(block, specials)).sum(axis=1).min())
    if fewest < need:
      raise ValueError(
        f"a sequence of length {seq_len} would hold {fewest} maskable tokens, fewer than the "
        f"{need} that BERT masks: the lines are too short for this length"
      )
    out[a:b, 0] = special_ids["[CLS]"]
    out[a:b, 1:] = block
  out.flush()
  del out, tokens
  return n


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m optax_lamb_recipes.pretrain.prepare",
    description=__doc__.split("\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--out", required=True, help="the directory to write")
  p.add_argument("--corpus", nargs="+", help="text files (default: the King James Bible)")
  p.add_argument("--vocab", help="tokenizers JSON or BERT vocab.txt (default: as pretrain's)")
  p.add_argument("--vocab-size", type=int, default=2048, help="of a vocabulary trained here")
  p.add_argument("--vocab-case", choices=CASES, default="auto")
  p.add_argument("--seq-len", type=int, nargs="+", default=[128, 512], help="row lengths")
  p.add_argument("--held-out-every", type=int, default=100,
                 help="every Nth line to the held-out split (0: none)")  # fmt: skip
  args = p.parse_args(argv)
  try:
    prepared = prepare(
      args.out, args.corpus, vocab=args.vocab, vocab_size=args.vocab_size,
      case=args.vocab_case, seq_lens=args.seq_len, held_out_every=args.held_out_every,
    )  # fmt: skip
  except (ValueError, FileNotFoundError) as e:
    print(f"{p.prog}: error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(prepared.index["shards"]), f"fingerprint {prepared.fingerprint}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
