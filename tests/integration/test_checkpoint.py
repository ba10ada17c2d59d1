"""The optimizer state round-trips through orbax and flax.serialization; training resumes bit-identically.

Also a state saved by an earlier version (tests/data/checkpoints, written by
tests/data/make_checkpoint.py) restores and steps bit for bit.
"""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from helpers.asserts import assert_trees_equal

import optax_lamb


def build(config):
  if config == "default":
    return optax_lamb.lamb(1e-2), jnp.float32
  if config == "clip-mask-schedules":
    return (
      optax_lamb.lamb(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20),
        weight_decay=optax.linear_schedule(0.0, 0.01, 10),
        mask={"w": True, "b": False, "s": True},
        max_grad_norm=1.0,
        min_trust_ratio=0.01,
        max_trust_ratio=10.0,
        mu_dtype=jnp.float32,
      ),
      jnp.float32,
    )
  return (
    optax_lamb.lamb(
      optax.linear_schedule(1e-2, 1e-3, 20),
      weight_decay=0.01,
      skip_nonfinite=True,
      master_weights=True,
      grad_scale=lambda count: 2.0 ** (count % 3),
    ),
    jnp.bfloat16,
  )


CONFIGS = ["default", "clip-mask-schedules", "bf16-master-skip-scale"]


def grads_sequence(rng, params, n, with_nan):
  seq = []
  for i in range(n):
    g = {k: jnp.asarray(rng.normal(size=p.shape), p.dtype) for k, p in params.items()}
    if with_nan and i in (2, 7):
      g["w"] = g["w"].at[0, 0].set(jnp.nan)
    seq.append(g)
  return seq


def train(step, params, state, seq):
  for g in seq:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def save_restore_orbax(tree, template, path):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  return checkpointer.restore(path, jax.eval_shape(lambda: template))


def save_restore_flax(tree, template, path):
  path.write_bytes(serialization.to_bytes(tree))
  return serialization.from_bytes(template, path.read_bytes())


@pytest.mark.parametrize("backend", ["orbax", "flax"])
@pytest.mark.parametrize("config", CONFIGS)
def test_resume_is_bit_identical(config, backend, tmp_path, rng):
  tx, dtype = build(config)
  params = {
    "w": jnp.asarray(rng.normal(size=(6, 4)), dtype),
    "b": jnp.asarray(rng.normal(size=(4,)), dtype),
    "s": jnp.asarray(rng.normal(), dtype),
  }
  seq = grads_sequence(rng, params, 12, with_nan=config.startswith("bf16"))
  step = jax.jit(tx.update)

  p_full, s_full = train(step, params, tx.init(params), seq)

  p_mid, s_mid = train(step, params, tx.init(params), seq[:6])
  template = (tx.init(params), params)  # a fresh state: restoring must overwrite every value
  if backend == "orbax":
    s_mid2, p_mid2 = save_restore_orbax((s_mid, p_mid), template, tmp_path / "ckpt")
  else:
    s_mid2, p_mid2 = save_restore_flax((s_mid, p_mid), template, tmp_path / "state.msgpack")
  assert_trees_equal((s_mid2, p_mid2), (s_mid, p_mid))
  p_resumed, s_resumed = train(step, p_mid2, s_mid2, seq[6:])

  assert_trees_equal(p_resumed, p_full)
  assert_trees_equal(s_resumed, s_full)
  if config.startswith("bf16"):
    assert int(optax_lamb.skip_counts(s_resumed).total) == 2


def _load_maker():
  """tests/data/make_checkpoint.py, which wrote the committed checkpoints (option sets, inputs)."""
  path = Path(__file__).resolve().parents[1] / "data" / "make_checkpoint.py"
  spec = importlib.util.spec_from_file_location("make_checkpoint", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MAKER = _load_maker()


def _assert_bits(tree, saved, prefix):
  """Every leaf of `tree` has the saved bits (and the dtype whose width they have)."""
  leaves = jax.tree.leaves(tree)
  assert len(leaves) == len([k for k in saved.files if k.startswith(prefix + "_")]), prefix
  for i, x in enumerate(leaves):
    np.testing.assert_array_equal(MAKER.bits(x), saved[f"{prefix}_{i}"], err_msg=f"{prefix}_{i}")


COMMITTED = [
  (commit, config)
  for commit, folder in MAKER.FOLDERS.items()
  for config in MAKER.configs()
  if (folder / config).is_dir()
]


# Configurations whose step was changed on purpose since the checkpoints were written:
# skip_nonfinite with master weights decides before the step and selects in its writes (no copy
# of the state, CHANGELOG.md), which moves XLA:CPU's fused multiply-adds: a ratio's last bit.
STEP_CHANGED = {"skip_master_bfloat16"}


def _assert_close(tree, saved, prefix, dtype):
  """Every leaf of `tree` within float32 rounding of the saved one (bits read in the leaf's dtype)."""
  for i, x in enumerate(jax.tree.leaves(tree)):
    want = jnp.asarray(saved[f"{prefix}_{i}"]).view(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(want, np.float64),
                                 rtol=2e-6 if x.dtype == jnp.float32 else 1e-2, err_msg=f"{prefix}_{i}")  # fmt: skip
    else:
      np.testing.assert_array_equal(x, want, err_msg=f"{prefix}_{i}")


@pytest.mark.parametrize("form", ["orbax", "flax"])
@pytest.mark.parametrize("commit,config", COMMITTED)
def test_a_committed_checkpoint_restores_and_steps_bit_identically(commit, config, form):
  """A state saved by an earlier commit (tests/data/checkpoints*) restores into init's tree, bit
  for bit, and the next step from it is bit for bit the one that commit took."""
  tx, dtype, with_nan = MAKER.configs()[config]
  folder = MAKER.FOLDERS[commit] / config
  saved = np.load(folder / "steps.npz")
  params, grads = MAKER.params_and_grads(dtype, with_nan)
  params = jax.tree.unflatten(jax.tree.structure(params),
                              [jnp.asarray(saved[f"params_{i}"]).view(dtype)
                               for i in range(len(jax.tree.leaves(params)))])  # fmt: skip
  target = jax.eval_shape(tx.init, params)
  if form == "orbax":
    state = ocp.StandardCheckpointer().restore(folder / "orbax", target)
  else:
    state = serialization.from_bytes(tx.init(params), (folder / "state.msgpack").read_bytes())
  assert jax.tree.structure(state) == jax.tree.structure(target)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(
    lambda x: (x.shape, x.dtype), target
  )
  _assert_bits(state, saved, "state")
  _assert_bits(grads[MAKER.STEPS], saved, "grads")
  next_params, next_state = MAKER.step_fn(tx)(params, state, grads[MAKER.STEPS])
  if config in STEP_CHANGED:  # restored bit for bit above; the next step to float32 rounding
    _assert_close(next_params, saved, "next_params", dtype)
    _assert_close(next_state, saved, "next_state", dtype)
  else:
    _assert_bits(next_params, saved, "next_params")
    _assert_bits(next_state, saved, "next_state")
