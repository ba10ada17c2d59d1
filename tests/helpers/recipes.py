"""A sweep small enough for a test: the ci preset with two batches, two seeds and a tiny model."""

import dataclasses

from optax_lamb_recipes import model, presets

TINY_SWEEP = dataclasses.replace(
  presets.PRESETS["ci"],
  name="tiny", batches=(16, 32), samples=128, seeds=(0, 1), evals=2, eval_size=32,
  lamb_grid=(0.5, 1.0), adamw_grid=(1.0, 2.0),
  model=model.BertConfig(vocab_size=69, hidden=16, layers=1, heads=2, mlp=32, max_len=32),
)  # fmt: skip
