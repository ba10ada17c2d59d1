"""A masked-LM BERT in Flax NNX (post-LayerNorm, as BERT), and its loss.

Parameters are float32; ``dtype`` (e.g. ``jnp.bfloat16``) sets the compute dtype of every
layer (mixed precision: float32 master weights, float32 loss), ``None`` computes in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Sizes of the model; the defaults run a sweep on two CPU cores in minutes."""

  vocab_size: int = 2048
  hidden: int = 64
  layers: int = 2
  heads: int = 4
  mlp: int = 256
  max_len: int = 128


class Layer(nnx.Module):
  """A post-LN transformer encoder layer: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs, dtype=None):
    init = nnx.initializers.truncated_normal(0.02)
    self.attn = nnx.MultiHeadAttention(
      num_heads=cfg.heads,
      in_features=cfg.hidden,
      kernel_init=init,
      decode=False,
      dtype=dtype,
      rngs=rngs,
    )
    self.attn_norm = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(cfg.hidden, cfg.mlp, kernel_init=init, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp, cfg.hidden, kernel_init=init, dtype=dtype, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = self.attn_norm(x + self.attn(x))
    return self.mlp_norm(x + self.mlp_out(jax.nn.gelu(self.mlp_in(x))))


class Bert(nnx.Module):
  """Token and position embeddings, encoder layers, and BERT's masked-LM head (tied decoder)."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs, dtype=None):
    init = nnx.initializers.truncated_normal(0.02)
    self.cfg = cfg
    embed = functools.partial(nnx.Embed, embedding_init=init, dtype=dtype, rngs=rngs)
    self.token_embed = embed(cfg.vocab_size, cfg.hidden)
    self.position_embed = embed(cfg.max_len, cfg.hidden)
    self.embed_norm = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)
    self.layers = nnx.List([Layer(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.layers)])
    self.head = nnx.Linear(cfg.hidden, cfg.hidden, kernel_init=init, dtype=dtype, rngs=rngs)
    self.head_norm = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)
    self.output_bias = nnx.Param(jnp.zeros((cfg.vocab_size,)))

  def __call__(self, inputs, positions):
    """Logits ``[batch, n_pred, vocab]`` at the masked ``positions`` only (as BERT's head)."""
    seq_len = inputs.shape[-1]
    x = self.token_embed(inputs) + self.position_embed(jnp.arange(seq_len))
    x = self.encode(self.embed_norm(x))
    x = jnp.take_along_axis(x, positions[..., None], axis=-2)
    x = self.head_norm(jax.nn.gelu(self.head(x)))
    return self.token_embed.attend(x) + self.output_bias[...]

  def encode(self, x):
    """The encoder layers in order (a Python loop; ``pretrain.model.ScannedBert`` scans)."""
    for layer in self.layers:
      x = layer(x)
    return x


def mlm_losses(model: Bert, batch) -> jax.Array:
  """Cross-entropy (nats) at each masked position, ``[batch, n_pred]``."""
  logits = model(batch.inputs, batch.positions)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]


def mlm_loss(model: Bert, batch) -> jax.Array:
  """Mean cross-entropy (nats) over the masked positions."""
  return mlm_losses(model, batch).mean()


def init_params(cfg: BertConfig, seed: int = 0, dtype=None):
  """``(graphdef, params)``: the static structure and the parameters as nested dicts of arrays.

  ``dtype`` is the compute dtype (kept in ``graphdef``); the parameters are float32 either way.
  """
  graphdef, state = nnx.split(Bert(cfg, rngs=nnx.Rngs(seed), dtype=dtype))
  return graphdef, nnx.to_pure_dict(state)


def loss_fn(graphdef, params, batch) -> jax.Array:
  """The masked-LM loss as a pure function of the parameters (for ``jax.grad``)."""
  return mlm_loss(nnx.merge(graphdef, params), batch)


def sequence_losses(graphdef, params, batch) -> jax.Array:
  """Each sequence's mean loss over its masked positions, ``[batch]`` (for paired comparisons)."""
  return mlm_losses(nnx.merge(graphdef, params), batch).mean(axis=-1)
