"""A sweep small enough for a test: synthetic data, a one-layer model, two batches, two seeds."""

from optax_lamb_recipes import model, presets

TINY_SWEEP = presets.SweepConfig(
  name="tiny",
  data="hmm",
  batches=(16, 32),
  samples=128,
  lamb_lr=0.02,
  adamw_lr=3e-3,
  lamb_grid=(0.5, 1.0),
  adamw_grid=(1.0, 2.0),
  seeds=(0, 1),
  evals=2,
  eval_size=32,
  model=model.BertConfig(vocab_size=69, hidden=16, layers=1, heads=2, mlp=32, max_len=32),
)
