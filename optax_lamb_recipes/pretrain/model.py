"""BERT-base, BERT-large and a tiny BERT (``optax_lamb_recipes.model``), and their FLOP count.

The count is the matrix multiplications' (2 FLOPs a multiply-add), as MFU is usually counted
(Chowdhery et al. 2022, App. B): the embeddings are lookups, and LayerNorm, GELU, softmax and
the loss are left out. Training costs three forward passes (the backward pass multiplies each
matrix twice: once for the inputs' gradient, once for the weights').
"""

from __future__ import annotations

from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes.pretrain.config import MODELS


def bert_config(name: str, vocab_size: int) -> model_lib.BertConfig:
  """The named size (``tiny``, ``base``, ``large``) with the tokenizer's vocabulary."""
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; one of {sorted(MODELS)}")
  return model_lib.BertConfig(vocab_size=vocab_size, **MODELS[name])


def forward_flops(cfg: model_lib.BertConfig, seq_len: int, n_pred: int) -> int:
  """Matmul FLOPs of one sequence's forward pass, with ``n_pred`` masked positions.

  Per layer and token: Q, K, V and output projections 4 * 2 H^2, scores and weighted values
  2 * 2 L H, the MLP 2 * 2 H F; the head only at the masked positions: a dense layer 2 H^2 and
  the tied decoder 2 H V.
  """
  h, f, v, n = cfg.hidden, cfg.mlp, cfg.vocab_size, cfg.layers
  per_token_layer = 8 * h * h + 4 * seq_len * h + 4 * h * f
  return n * seq_len * per_token_layer + n_pred * (2 * h * h + 2 * h * v)


def train_flops(cfg: model_lib.BertConfig, seq_len: int, n_pred: int) -> int:
  """Matmul FLOPs of one sequence's forward and backward pass: 3x the forward."""
  return 3 * forward_flops(cfg, seq_len, n_pred)


def parameter_count(cfg: model_lib.BertConfig) -> int:
  """The number of parameters (float32 each), by formula."""
  h, f = cfg.hidden, cfg.mlp
  layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
  return (
    (cfg.vocab_size + cfg.max_len) * h
    + 2 * h
    + cfg.layers * layer
    + h * h
    + h
    + 2 * h
    + cfg.vocab_size
  )
