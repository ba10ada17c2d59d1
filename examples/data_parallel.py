"""Data-parallel LAMB: a Flax NNX MLP trained on every device of every process.

The global batch is sharded over a one-axis device mesh (``data``) that spans
all local devices, and all processes when launched multi-process. Under
``jax.jit`` the arrays are global: the gradient of the mean loss is already
all-reduced by the compiler, so ``optax_lamb.lamb`` needs no ``axis_name``
(that is only for ``shard_map``/``pmap``, where each device sees its shard).
``--shard-params`` also shards the params and the Adam moments over ``data``
(ZeRO/FSDP-style); the result is the same.

Single host, 8 fake CPU devices::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py

Two processes on one machine (2 devices each), one command per process::

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/data_parallel.py \\
      --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 &
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/data_parallel.py \\
      --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb

D_IN, D_HIDDEN, D_OUT = 32, 128, 4
SHOWN_RATIOS = ("kernel", "scale")  # the trust ratios logged: weight matrices and LayerNorm scale


class MLP(nnx.Module):
  """Linear -> LayerNorm -> gelu -> Linear -> gelu -> Linear."""

  def __init__(self, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(D_IN, D_HIDDEN, rngs=rngs)
    self.norm = nnx.LayerNorm(D_HIDDEN, rngs=rngs)
    self.fc2 = nnx.Linear(D_HIDDEN, D_HIDDEN, rngs=rngs)
    self.out = nnx.Linear(D_HIDDEN, D_OUT, rngs=rngs)

  def __call__(self, x):
    x = nnx.gelu(self.norm(self.fc1(x)))
    x = nnx.gelu(self.fc2(x))
    return self.out(x)


def synthetic_batch(step: int, batch_size: int, seed: int = 0):
  """The global batch of a step: a fixed random teacher network plus noise (same on every process)."""
  teacher = np.random.default_rng(seed)
  w1 = teacher.normal(0, 1 / np.sqrt(D_IN), (D_IN, 64))
  w2 = teacher.normal(0, 1 / np.sqrt(64), (64, D_OUT))
  rng = np.random.default_rng((seed, step))
  x = rng.normal(size=(batch_size, D_IN))
  y = np.sin(2 * np.tanh(x @ w1) @ w2) + 0.01 * rng.normal(size=(batch_size, D_OUT))
  return x.astype(np.float32), y.astype(np.float32)


def global_array(value, sharding):
  """A global array from a host value that every process holds in full.

  Real input pipelines read only their process's rows and use
  ``jax.make_array_from_process_local_data`` instead.
  """
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def leaf_name(path) -> str:
  keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
  return "/".join(str(k) for k in keys if k != "value")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-size", type=int, default=512, help="global batch size")
  parser.add_argument("--learning-rate", type=float, default=0.02)
  parser.add_argument("--weight-decay", type=float, default=0.01)
  parser.add_argument("--max-grad-norm", type=float, default=1.0)
  parser.add_argument("--log-every", type=int, default=20)
  parser.add_argument(
    "--shard-params", action="store_true", help="shard params and moments over the data axis (ZeRO)"
  )
  parser.add_argument("--save", help="write the final params to this .npz file (process 0)")
  group = parser.add_argument_group("multi-process launch (jax.distributed)")
  group.add_argument("--coordinator", help="host:port of process 0, e.g. 127.0.0.1:12355")
  group.add_argument("--num-processes", type=int, help="number of processes in the job")
  group.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes-1")
  return parser.parse_args(argv)


def join_cluster(coordinator: str, num_processes: int, process_id: int, timeout: int = 120):
  """``jax.distributed.initialize``, with CPU collectives over gloo where the option exists."""
  try:  # gloo is the default CPU collectives on recent jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, KeyError, ValueError):
    pass
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=timeout,
  )


def main(argv=None):
  args = parse_args(argv)
  if args.coordinator is not None:
    join_cluster(args.coordinator, args.num_processes, args.process_id)
  params = train(args)
  if args.save and jax.process_index() == 0:
    np.savez(args.save, **params)
  if args.coordinator is not None:
    jax.distributed.shutdown()


def train(args, devices=None) -> dict[str, np.ndarray]:
  """Train on `devices` (default: every device of every process); the final params on the host."""
  devices = jax.devices() if devices is None else devices
  lead = jax.process_index() == 0
  n_devices = len(devices)
  if args.batch_size % n_devices:
    raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {n_devices} devices")
  mesh = jax.make_mesh((n_devices,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
  data_sharding = NamedSharding(mesh, P("data"))
  if lead:
    print(
      f"{jax.process_count()} process(es), {n_devices} devices ({jax.local_device_count()} local), "
      f"global batch {args.batch_size} ({args.batch_size // n_devices} per device)",
      flush=True,
    )

  model = MLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)

  def param_sharding(x):
    shardable = args.shard_params and x.ndim > 0 and x.shape[0] % n_devices == 0
    return NamedSharding(mesh, P("data") if shardable else P())

  params = jax.tree.map(lambda x: global_array(x, param_sharding(x)), params)

  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.learning_rate, max(1, args.steps // 10), max(2, args.steps)
  )
  tx = optax_lamb.lamb(
    schedule,
    weight_decay=args.weight_decay,
    mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),  # decay the kernels only
    max_grad_norm=args.max_grad_norm,  # clips the global (all-reduced) gradient
  )
  opt_state = tx.init(params)  # eagerly: the moments take each param's sharding

  def loss_fn(params, x, y):
    return jnp.mean(jnp.square(nnx.merge(graphdef, params)(x) - y))

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # grads of the global-batch mean
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  start = time.perf_counter()
  for step in range(1, args.steps + 1):
    x, y = synthetic_batch(step, args.batch_size)
    x, y = global_array(x, data_sharding), global_array(y, data_sharding)
    params, opt_state, loss = train_step(params, opt_state, x, y)
    if lead and (step % args.log_every == 0 or step in (1, args.steps)):
      ratios = jax.tree_util.tree_flatten_with_path(optax_lamb.trust_ratios(opt_state))[0]
      shown = "  ".join(
        f"{leaf_name(p)}={float(r):.3f}" for p, r in ratios if leaf_name(p).endswith(SHOWN_RATIOS)
      )
      print(f"step {step:4d}  loss {float(loss):.5f}  trust ratios: {shown}", flush=True)

  if lead:
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
  # gather the (possibly sharded, possibly multi-process) params onto every process
  replicated = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(params)
  flat = jax.tree_util.tree_flatten_with_path(replicated)[0]
  return {leaf_name(p): np.asarray(v.addressable_data(0)) for p, v in flat}


if __name__ == "__main__":
  main()
