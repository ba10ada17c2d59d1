"""A short demo: a small MLP regression trained with optax_lamb.lamb on the CPU.

Prints the loss and the per-layer trust ratios as training goes. Needs only the
package's own dependencies (jax, optax, numpy).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import optax_lamb


def init_mlp(key, sizes):
  params = {}
  for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
    key, sub = jax.random.split(key)
    params[f"layer{i}"] = {
      "kernel": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in),
      "bias": jnp.zeros(n_out),
    }
  return params


def mlp(params, x):
  *hidden, last = params.values()
  for layer in hidden:
    x = jax.nn.gelu(x @ layer["kernel"] + layer["bias"])
  return x @ last["kernel"] + last["bias"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=1024)
  args = parser.parse_args()

  key_data, key_teacher, key_params = jax.random.split(jax.random.PRNGKey(0), 3)
  teacher = init_mlp(key_teacher, [16, 64, 1])
  x_all = jax.random.normal(key_data, (args.batch * 8, 16))
  y_all = mlp(teacher, x_all)

  params = init_mlp(key_params, [16, 128, 128, 1])
  schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-2, args.steps // 10, args.steps)
  tx = optax_lamb.lamb(
    schedule,
    weight_decay=0.01,
    mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),  # no decay on biases
    max_grad_norm=1.0,
  )
  state = tx.init(params)

  def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)

  @jax.jit
  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  print(f"jax {jax.__version__} on {jax.default_backend()}; optax_lamb {optax_lamb.__version__}")
  for t in range(args.steps):
    i = (t % 8) * args.batch
    params, state, loss = step(params, state, x_all[i : i + args.batch], y_all[i : i + args.batch])
    if t % 50 == 0 or t == args.steps - 1:
      ratios = optax_lamb.trust_ratios(state)
      shown = "  ".join(
        f"{name}/{leaf}={float(r):.3g}"
        for name, layer in ratios.items()
        for leaf, r in layer.items()
      )
      print(f"step {t:4d}  loss {float(loss):.5f}  trust ratios: {shown}")


if __name__ == "__main__":
  main()
