"""BERT pretraining with LAMB at any scale: ``python -m optax_lamb_recipes.pretrain``.

Modules: ``config`` (model sizes, phases, presets), ``data`` (corpus, tokenizer, each step's
masked batch), ``model`` (BERT sizes and their FLOP count), ``optim`` (optimizers by name),
``step`` (the sharded, gradient-accumulating step), ``checkpoint`` (orbax, SIGTERM), ``metrics``
(TensorBoard, metrics.jsonl, MFU), ``run`` (the loop) and ``bench`` (the GPU benchmark).
"""
