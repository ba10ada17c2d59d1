"""BERT-base, BERT-large and a tiny BERT with their layers stacked and scanned, and their FLOP count.

``ScannedBert`` is ``optax_lamb_recipes.model.Bert`` (the laptop recipe's) with each layer
parameter stacked along a leading layer axis and the layers run by a scan: the program
holds one layer whatever the depth (compile time does not grow with it), and with
``remat`` each layer's activations are recomputed in the backward pass instead of stored (only
the ``[batch, seq, hidden]`` input of each layer is kept). LAMB needs one trust ratio per layer,
not per stacked leaf: ``stacked_axes`` says which leaves carry the layer axis.

The count is the matrix multiplications' (2 FLOPs a multiply-add), as MFU is usually counted
(Chowdhery et al. 2022, App. B): the embeddings are lookups, and LayerNorm, GELU, softmax and
the loss are left out. Training costs three forward passes (the backward pass multiplies each
matrix twice: once for the inputs' gradient, once for the weights').
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes.pretrain.config import MODELS

LAYERS = "layers"  # the top-level key of the stacked layer parameters


def bert_config(name: str, vocab_size: int) -> model_lib.BertConfig:
  """The named size (``tiny``, ``base``, ``large``) with the tokenizer's vocabulary."""
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; one of {sorted(MODELS)}")
  return model_lib.BertConfig(vocab_size=vocab_size, **MODELS[name])


class ScannedBert(model_lib.Bert):
  """``model_lib.Bert`` with stacked layers run by a scan; ``remat``: each layer under
  ``jax.checkpoint`` (its activations recomputed in the backward pass, not stored)."""

  def __init__(self, cfg: model_lib.BertConfig, *, rngs: nnx.Rngs, dtype=None, remat=False):
    # The embeddings and the head as Bert's; no layers there, they are stacked here.
    super().__init__(dataclasses.replace(cfg, layers=0), rngs=rngs, dtype=dtype)
    self.cfg, self.remat = cfg, remat

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs: nnx.Rngs) -> model_lib.Layer:
      return model_lib.Layer(cfg, rngs=rngs, dtype=dtype)

    self.layers = stacked(rngs)

  def encode(self, x):
    # jax.lax.scan over the layers' split state (the functional form of nnx.scan, as Flax's
    # scan-over-layers example): nnx.scan refuses a model merged outside an enclosing
    # jax.lax.scan (the held-out evaluation's loop over micro-batches) as another trace level.
    graphdef, state = nnx.split(self.layers)

    def layer(x, one):
      return nnx.merge(graphdef, one)(x), None

    if self.remat:  # under scan, CSE across iterations is not a risk (jax.checkpoint's docs)
      layer = jax.checkpoint(layer, prevent_cse=False)
    return jax.lax.scan(layer, x, state)[0]


def init_params(cfg: model_lib.BertConfig, seed: int = 0, dtype=None, remat: bool = False):
  """``(graphdef, params)`` of a ``ScannedBert``, as ``model_lib.init_params`` (float32 params;
  ``dtype`` and ``remat`` kept in ``graphdef``); ``model_lib.loss_fn`` takes them."""
  net = ScannedBert(cfg, rngs=nnx.Rngs(seed), dtype=dtype, remat=remat)
  graphdef, state = nnx.split(net)
  return graphdef, nnx.to_pure_dict(state)


def _top_key(path: tuple) -> str:
  return str(getattr(path[0], "key", getattr(path[0], "name", path[0])))


def stacked_axes(params: Any) -> Any:
  """LAMB's ``stacked_axes`` for ``ScannedBert``'s params: axis 0 of every layer leaf is the
  layer (one trust ratio per layer), no stacked axis elsewhere."""
  return jax.tree_util.tree_map_with_path(lambda p, _: int(_top_key(p) == LAYERS), params)


def unstack_layers(params: dict) -> dict:
  """``ScannedBert``'s params as ``model_lib.Bert``'s (``layers`` -> ``{0: ..., 1: ...}``)."""
  stacked = params[LAYERS]
  n = jax.tree.leaves(stacked)[0].shape[0]
  layers = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)}
  return {**params, LAYERS: layers}


def stack_layers(params: dict) -> dict:
  """``model_lib.Bert``'s params (a checkpoint written before the layers were stacked: keys
  ``0``, ``1``, ... or their strings) as ``ScannedBert``'s: the inverse of ``unstack_layers``."""
  layers = params[LAYERS]
  ordered = [layers[k] for k in sorted(layers, key=int)]
  return {**params, LAYERS: jax.tree.map(lambda *a: jnp.stack(a), *ordered)}


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
