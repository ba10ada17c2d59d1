"""The prepared-data pipeline: ``prepare`` on a small corpus, each process's slice of a batch,
masking that never touches the special tokens, the sampler's state across a resume, and the
held-out evaluation against the model's own loss."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("tokenizers")

from flax import nnx
from helpers import fast_compile

from optax_lamb_recipes import data, model
from optax_lamb_recipes.pretrain import checkpoint, prepare, shards, step
from optax_lamb_recipes.pretrain import model as pmodel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(ROOT, "optax_lamb_recipes", data.TOKENIZER_FILE)
WORDS = "in the beginning god created heaven and earth light darkness was upon face of deep".split()


def write_corpus(path, n_lines=120, seed=0) -> list[str]:
  """Lines of 3 to 14 words, with blank lines (document breaks) every 10 lines."""
  rng = np.random.default_rng(seed)
  lines = [" ".join(rng.choice(WORDS, rng.integers(3, 15))) for _ in range(n_lines)]
  text = "".join(line + ("\n\n" if i % 10 == 9 else "\n") for i, line in enumerate(lines))
  path.write_text(text)
  return lines


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  where = tmp_path_factory.mktemp("prepared")
  lines = write_corpus(where / "corpus.txt")
  out = prepare.prepare(
    str(where / "data"), [str(where / "corpus.txt")], vocab=VOCAB, seq_lens=(16, 32),
    held_out_every=7,
  )  # fmt: skip
  return out, lines


def expected_stream(lines, tok, keep) -> np.ndarray:
  """The reference: each kept line's ids (tokenized alone) and [SEP], in order."""
  sep = tok.token_to_id("[SEP]")
  ids = [
    [*tok.encode(s, add_special_tokens=False).ids, sep] for i, s in enumerate(lines) if keep(i)
  ]
  return np.concatenate([np.asarray(x) for x in ids])


def test_prepare_writes_cls_rows_of_the_lines_and_sep(prepared):
  out, lines = prepared
  tok = data.load_tokenizer()
  assert out.vocab_size == tok.get_vocab_size() and out.index["dtype"] == "uint16"
  assert out.index["lines"] == len(lines) and out.seq_lens == [16, 32]
  assert json.load(open(os.path.join(out.directory, shards.INDEX_FILE))) == out.index
  cls = tok.token_to_id("[CLS]")
  for split, keep in (("train", lambda i: i % 7 != 6), ("held_out", lambda i: i % 7 == 6)):
    stream = expected_stream(lines, tok, keep)
    assert out.index["tokens"][split] == len(stream)
    for L in (16, 32):
      rows = out.rows(split, L)
      n = len(stream) // (L - 1)
      assert rows.shape == (n, L) and n > 0
      assert (rows[:, 0] == cls).all()
      np.testing.assert_array_equal(rows[:, 1:].ravel(), stream[: n * (L - 1)])


def test_prepare_is_deterministic_and_fingerprints_the_text(tmp_path, prepared):
  out, _ = prepared
  write_corpus(tmp_path / "same.txt")
  again = prepare.prepare(str(tmp_path / "a"), [str(tmp_path / "same.txt")], vocab=VOCAB,
                          seq_lens=(16, 32), held_out_every=7)  # fmt: skip
  assert again.fingerprint == out.fingerprint
  np.testing.assert_array_equal(again.rows("train", 32), out.rows("train", 32))
  write_corpus(tmp_path / "other.txt", seed=1)
  other = prepare.prepare(str(tmp_path / "b"), [str(tmp_path / "other.txt")], vocab=VOCAB,
                          seq_lens=(16, 32), held_out_every=7)  # fmt: skip
  assert other.fingerprint != out.fingerprint
  with pytest.raises(ValueError, match="not 64"):
    out.rows("train", 64)


def test_prepare_refuses_bad_arguments_before_writing(tmp_path):
  for kwargs, named in (({"seq_lens": ()}, "seq_lens"), ({"held_out_every": 1}, "held_out_every")):
    with pytest.raises(ValueError, match=named):
      prepare.prepare(str(tmp_path / "x"), None, **kwargs)
  with pytest.raises(FileNotFoundError, match="nothing.txt"):
    prepare.prepare(str(tmp_path / "x"), [str(tmp_path / "nothing.txt")])
  assert not (tmp_path / "x").exists()
  assert prepare.main(["--out", str(tmp_path / "y"), "--seq-len", "4"]) == 2
  assert not (tmp_path / "y").exists()


def test_two_processes_each_read_their_slice_and_together_the_global_batch():
  """Process 0 and 1 of 2 (as arguments) from the same state: each takes half the rows, the
  halves are disjoint and, in order, the one-process batch; the state moves by the whole batch."""
  for n_rows, batch in ((50, 8), (7, 4)):  # the second crosses epochs
    whole, halves = (
      shards.Sampler(n_rows, batch, 3, 1),
      [shards.Sampler(n_rows, batch, 3, 1) for _ in range(2)],
    )
    for _ in range(6):
      rows, samples = whole.take()
      parts = [h.take(i, 2) for i, h in enumerate(halves)]
      assert all(len(r) == batch // 2 for r, _ in parts)
      np.testing.assert_array_equal(np.concatenate([r for r, _ in parts]), rows)
      np.testing.assert_array_equal(np.concatenate([s for _, s in parts]), samples)
      assert not set(parts[0][1]) & set(parts[1][1])
      assert whole.state_dict() == halves[0].state_dict() == halves[1].state_dict()
  with pytest.raises(ValueError, match="does not split"):
    shards.Sampler(10, 4, 0, 0).take(0, 3)


def test_each_process_block_is_its_columns_of_the_micro_batches():
  """The layout of ``step.global_batch``: row r at micro-batch r % k, column r // k, so
  process p's rows are the p-th block of columns."""
  k, batch, processes = 2, 8, 2
  rows = np.arange(batch)[:, None] * np.ones((1, 3), int)
  placed = step.global_batch(data.MLMBatch(rows, rows, rows), k, sharding())
  want = np.asarray(placed.inputs)
  assert want.shape == (k, batch // k, 3)
  for r in range(batch):
    assert (want[r % k, r // k] == r).all()
  per = batch // processes
  for p in range(processes):
    cols = per // k
    np.testing.assert_array_equal(want[:, p * cols : (p + 1) * cols, 0].T.ravel(),
                                  np.arange(p * per, (p + 1) * per))  # fmt: skip


def sharding():
  mesh = step.make_mesh(jax.devices()[:1])
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, step.AXIS))


def test_masking_never_touches_the_special_tokens(prepared):
  out, _ = prepared
  ids = out.special_ids
  specials = np.asarray(list(ids.values()))
  rows = np.asarray(out.rows("train", 32))
  samples = np.arange(len(rows)) + 1000
  b = shards.mask(rows, samples, (0, 0), special_ids=ids, vocab_size=out.vocab_size)
  n_pred = data.num_predictions(32)
  assert b.positions.shape == (len(rows), n_pred)
  assert (np.diff(b.positions, axis=1) > 0).all()  # distinct, sorted
  original = np.take_along_axis(rows, b.positions, axis=1)
  np.testing.assert_array_equal(b.targets, original)
  assert not np.isin(b.targets, specials).any()  # [CLS], [SEP], [PAD] ... never masked
  untouched = np.ones(rows.shape, bool)
  np.put_along_axis(untouched, b.positions, False, axis=1)
  np.testing.assert_array_equal(b.inputs[untouched], rows[untouched])
  assert (b.inputs[:, 0] == ids["[CLS]"]).all()
  masked = np.take_along_axis(b.inputs, b.positions, axis=1)
  is_mask = masked == ids["[MASK]"]
  kept = masked == b.targets
  random = ~is_mask & ~kept
  assert not np.isin(masked[random], specials).any()  # random tokens are regular ones
  # 80 / 10 / 10 within 5 binomial standard deviations (a kept slot may also be a random draw
  # of the same token: 1/vocab of the 10%).
  n = masked.size
  for share, want in ((is_mask.mean(), 0.8), (random.mean(), 0.1)):
    assert abs(share - want) < 5 * np.sqrt(want * (1 - want) / n), (share, want)


def test_a_rows_mask_is_the_same_wherever_it_is_read(prepared):
  out, _ = prepared
  rows = np.asarray(out.rows("train", 16))[:8]
  kw = dict(special_ids=out.special_ids, vocab_size=out.vocab_size)
  whole = shards.mask(rows, np.arange(8), (1, 0), **kw)
  halves = [shards.mask(rows[a : a + 4], np.arange(a, a + 4), (1, 0), **kw) for a in (0, 4)]
  for i, x in enumerate(whole):
    np.testing.assert_array_equal(x, np.concatenate([h[i] for h in halves]))
  other = shards.mask(rows, np.arange(8), (2, 0), **kw)
  assert not np.array_equal(other.positions, whole.positions)


def test_uniform_draws_are_uniform():
  u = shards.uniform((0, 1), np.arange(200_000))
  assert 0 <= u.min() and u.max() < 1
  counts = np.histogram(u, bins=20, range=(0, 1))[0]
  expected = len(u) / 20
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 43.8  # the 0.999 quantile of chi-squared with 19 degrees of freedom


def test_resume_restores_the_sampler_bit_identically(tmp_path, prepared):
  """The state saved with a checkpoint (JSON, through orbax) continues the stream exactly: the
  same rows, sample numbers, masks and states as the sampler that never stopped."""
  out, _ = prepared
  rows = out.rows("train", 16)
  kw = dict(special_ids=out.special_ids, vocab_size=out.vocab_size)
  running = shards.Sampler(len(rows), 24, 5, 0)
  for _ in range(7):
    running.take()
  ckpt = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  ckpt.save(7, {"params": {"w": jnp.zeros(2)}}, {"step": 7, "sampler": running.state_dict()})
  ckpt.close()
  saved = checkpoint.latest_meta(str(tmp_path / "checkpoints"))["sampler"]
  assert saved == running.state_dict() and saved["epoch"] >= 1  # 168 rows: past one epoch
  resumed = shards.Sampler(len(rows), 24, 5, 0)
  resumed.restore(saved)
  for _ in range(5):
    (ra, sa), (rb, sb) = running.take(), resumed.take()
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(sa, sb)
    ma = shards.mask(np.asarray(rows[ra]), sa, (5, 0), **kw)
    mb = shards.mask(np.asarray(rows[rb]), sb, (5, 0), **kw)
    for x, y in zip(ma, mb, strict=True):
      np.testing.assert_array_equal(x, y)
    assert running.state_dict() == resumed.state_dict()
  with pytest.raises(ValueError, match="seed"):
    shards.Sampler(len(rows), 24, 6, 0).restore(saved)


def test_evaluation_is_the_models_loss_and_accuracy():
  """``step._evaluate`` of the scanned model (its layers scanned inside the loop over
  micro-batches) against ``model.mlm_losses`` and the logits' argmax of the Python-loop model
  with the same weights, computed apart."""
  cfg = model.BertConfig(vocab_size=128, hidden=32, layers=2, heads=2, mlp=64, max_len=16)
  graphdef, params = pmodel.init_params(cfg, 0)
  rng = np.random.default_rng(0)
  seqs = rng.integers(5, 128, (12, 16)).astype(np.int32)
  b = data.mask_tokens(seqs, rng, mask_id=4, vocab_size=128)
  stacked = data.MLMBatch(*(x.reshape(3, 4, *x.shape[1:]) for x in b))
  got = fast_compile.jit(lambda p, x: step._evaluate(graphdef, p, x))(params, stacked)
  net = nnx.merge(model.init_params(cfg, 0)[0], pmodel.unstack_layers(params))
  losses = np.asarray(model.mlm_losses(net, b), np.float64)
  logits = np.asarray(net(b.inputs, b.positions))
  np.testing.assert_allclose(got["eval/loss"], losses.mean(), rtol=1e-5)
  assert float(got["eval/accuracy"]) == pytest.approx((logits.argmax(-1) == b.targets).mean())
