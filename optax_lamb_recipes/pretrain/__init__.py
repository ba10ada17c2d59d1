"""BERT pretraining with LAMB at any scale: ``python -m optax_lamb_recipes.pretrain``.

Modules: ``config`` (model sizes, phases, presets, validation), ``data`` (corpus, tokenizer),
``prepare`` (the corpus tokenized into shards: ``python -m optax_lamb_recipes.pretrain.prepare``),
``shards`` (the shards, the per-process sampler, the masking), ``model`` (BERT sizes and their
FLOP count), ``optim`` (optimizers by name), ``step`` (the sharded, gradient-accumulating step),
``checkpoint`` (orbax, SIGTERM), ``metrics`` (TensorBoard, metrics.jsonl, MFU), ``run`` (the
loop) and ``bench`` (the GPU benchmark).
"""
