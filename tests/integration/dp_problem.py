"""The small training problem shared by the data-parallel and multi-process tests.

A two-layer MLP regression with four leaves (two weights, two biases) on a
fixed synthetic data stream, trained with LAMB (weight decay on the weights
only, global-norm clipping active). Everything is built with NumPy from fixed
seeds, so every process and every test sees the same global batches.

Every leaf's leading dimension is divisible by 8, so each leaf can be sharded
over 8 (or 4, or 2) devices along its first axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_lamb

D_IN, D_HIDDEN, D_OUT = 16, 32, 8
GLOBAL_BATCH = 64
STEPS = 5
MAX_GRAD_NORM = 0.5
WEIGHT_DECAY = 0.01
LEARNING_RATE = 0.05
LEAVES = ("b1", "b2", "w1", "w2")
WEIGHTS = ("w1", "w2")
BIASES = ("b1", "b2")


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "w1": rng.normal(0.0, 1.0 / np.sqrt(D_IN), (D_IN, D_HIDDEN)).astype(np.float32),
    "b1": rng.normal(0.0, 0.1, (D_HIDDEN,)).astype(np.float32),
    "w2": rng.normal(0.0, 1.0 / np.sqrt(D_HIDDEN), (D_HIDDEN, D_OUT)).astype(np.float32),
    "b2": rng.normal(0.0, 0.1, (D_OUT,)).astype(np.float32),
  }


def make_batches(steps: int = STEPS, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Global batches: x of shape (steps, GLOBAL_BATCH, D_IN), y of (steps, GLOBAL_BATCH, D_OUT)."""
  rng = np.random.default_rng(seed)
  teacher = rng.normal(0.0, 1.0, (D_IN, D_OUT)).astype(np.float32)
  x = rng.normal(0.0, 1.0, (steps, GLOBAL_BATCH, D_IN)).astype(np.float32)
  y = (np.sin(x @ teacher) * 2.0 + 1.0).astype(np.float32)
  return x, y


def loss_fn(params, x, y):
  """Mean squared error over the (local) batch: the mean of equal shards' losses is the global loss."""
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  out = h @ params["w2"] + params["b2"]
  return jnp.mean(jnp.square(out - y))


def make_tx(axis_name=None) -> optax.GradientTransformationExtraArgs:
  """LAMB with weight decay on the weights only and global-norm clipping."""
  return optax_lamb.lamb(
    LEARNING_RATE,
    weight_decay=WEIGHT_DECAY,
    mask={"w1": True, "b1": False, "w2": True, "b2": False},
    max_grad_norm=MAX_GRAD_NORM,
    axis_name=axis_name,
  )


def fsdp_step(tx, sharded, axis, n, *, check_vma=False):
  """A train step on one device's shards: gather the sharded leaves, reduce-scatter their grads.

  `sharded` names the leaves split along their first axis over `axis`; the
  others are replicated and their gradients averaged over the devices. Under
  ``pmap`` (or ``shard_map(check_vma=False)``) that takes a ``pmean``; under
  ``shard_map`` with ``check_vma=True`` jax has already ``psum``'d the gradient
  of a replicated (``P()``) input, so it only takes the division by `n`.
  """

  def step(params, state, x, y):
    full = {
      k: lax.all_gather(v, axis, tiled=True) if k in sharded else v for k, v in params.items()
    }
    grads = jax.grad(loss_fn)(full, x, y)

    def reduce(k, g):
      if k in sharded:
        return lax.psum_scatter(g, axis, tiled=True) / n
      return g / n if check_vma else lax.pmean(g, axis)

    grads = {k: reduce(k, g) for k, g in grads.items()}
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def state_shardings(tx, state, params, param_shardings, replicated):
  """The README recipe: moments get their param's sharding, the rest (count, ratios) `replicated`."""
  return optax.tree_map_params(
    tx,
    lambda v, p, s: s if jnp.shape(v) == jnp.shape(p) else replicated,
    state,
    params,
    param_shardings,
    transform_non_params=lambda _: replicated,
  )


def reference_run(steps: int = STEPS, params=None, batches=None):
  """Single-device training on the global batches: (params, ratios per step) as NumPy."""
  params = init_params() if params is None else params
  xs, ys = make_batches(steps) if batches is None else batches
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  tx = make_tx()
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  ratios = []
  for t in range(steps):
    params, state = step(
      params, state, jax.device_put(xs[t], device), jax.device_put(ys[t], device)
    )
    ratios.append(jax.tree.map(np.asarray, optax_lamb.trust_ratios(state)))
  return jax.tree.map(np.asarray, params), ratios


def max_abs_diff(a, b) -> float:
  """Largest |a - b| over all leaves of two pytrees of arrays."""
  diffs = jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b)
  return max(jax.tree.leaves(diffs))
