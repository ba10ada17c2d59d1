"""Per-optimizer learning rates, TensorBoard namespaces, and cased vocabularies."""

import json
import os

import pytest

pytest.importorskip("flax")
pytest.importorskip("tokenizers")

from optax_lamb_recipes import data, presets
from optax_lamb_recipes.pretrain import __main__ as cli
from optax_lamb_recipes.pretrain import config, metrics
from optax_lamb_recipes.pretrain import data as pdata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(ROOT, "optax_lamb_recipes", data.TOKENIZER_FILE)


@pytest.mark.parametrize("preset", sorted(config.PRESETS))
def test_adamw_gets_its_own_learning_rates(preset):
  """--opt adamw used LAMB's 6e-3 at 64K; now its own table, below LAMB's."""
  lamb, adamw = config.preset(preset, "lamb"), config.preset(preset, "adamw")
  assert adamw.opt == "adamw" and len(adamw.phases) == len(lamb.phases)
  for p, (lr, at) in zip(adamw.phases, config.ADAMW_LRS[preset], strict=True):
    want = lr * ((p.batch / at) ** 0.5 if at else 1.0)
    assert p.peak_lr == pytest.approx(want)
  for a, b in zip(adamw.phases, lamb.phases, strict=True):
    assert a.peak_lr < b.peak_lr
    assert (a.batch, a.steps, a.warmup, a.seq_len) == (b.batch, b.steps, b.warmup, b.seq_len)
  # The LAMBs of other libraries keep LAMB's.
  assert config.preset(preset, "timm_lamb").phases == lamb.phases
  cfg = cli.run_config(cli.parse_args(["--preset", preset, "--opt", "adamw"]))
  assert cfg == adamw
  cfg = cli.run_config(cli.parse_args(["--preset", preset, "--set", "opt=adamw"]))
  assert cfg == adamw


def test_adamw_smoke_rate_is_the_laptop_recipes_pilot():
  quick = presets.PRESETS["quick"]
  phase1 = config.preset("smoke", "adamw").phases[0]
  assert phase1.lr == quick.adamw_lr and phase1.lr_batch == min(quick.batches)


def test_a_set_learning_rate_still_wins():
  args = cli.parse_args(["--opt", "adamw", "--set", "phase1.lr=1e-3"])
  assert cli.run_config(args).phases[0].lr == 1e-3


def test_tensorboard_tags_are_namespaced():
  tags = {
    k: metrics.tensorboard_tag(k)
    for k in ("loss", "lr", "grad_norm", "trust_ratio/q50", "tokens_per_s_per_device", "mfu",
              "step_s", "checkpoint_s", "phase", "eval/loss", "eval/accuracy")
  }  # fmt: skip
  assert tags["loss"] == "train/loss" and tags["phase"] == "train/phase"
  assert tags["lr"] == "opt/lr" and tags["trust_ratio/q50"] == "opt/trust_ratio/q50"
  assert tags["eval/accuracy"] == "eval/accuracy" and tags["checkpoint_s"] == "train/checkpoint_s"
  assert all(t.split("/")[0] in ("train", "opt", "eval") for t in tags.values())


def write_vocab(path, extra=()):
  vocab = json.loads(open(VOCAB).read())["model"]["vocab"]
  path.write_text("\n".join([*sorted(vocab, key=vocab.get), *extra]) + "\n")
  return str(path)


def test_a_cased_vocabulary_keeps_the_case(tmp_path):
  cased = write_vocab(tmp_path / "cased.txt", ["God", "LORD"])
  uncased = write_vocab(tmp_path / "uncased.txt")
  assert pdata.vocab_is_cased(cased) and not pdata.vocab_is_cased(uncased)
  text = ["God said unto the LORD"]

  def tokens(vocab, case):
    tok = pdata.load_tokenizer(vocab, text, 0, None, default_corpus=False, case=case)
    return tok.encode(text[0], add_special_tokens=False).tokens

  assert tokens(cased, "auto")[0] == "God" and "LORD" in tokens(cased, "auto")
  assert tokens(cased, "uncased")[0] == "god"
  assert tokens(uncased, "auto")[0] == "god"
  assert tokens(VOCAB, "auto")[0] == "god"  # the committed JSON: uncased by its normalizer
  assert tokens(VOCAB, "cased")[0] != "god"
  with pytest.raises(ValueError, match="case"):
    pdata.load_tokenizer(None, text, 300, None, default_corpus=False, case="cased")
