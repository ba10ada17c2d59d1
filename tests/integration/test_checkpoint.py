"""The optimizer state round-trips through orbax and flax.serialization; training resumes bit-identically."""

import jax
import jax.numpy as jnp
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
