"""One process of the multi-process test (tests/test_multiprocess.py starts two).

Joins a jax.distributed cluster on 127.0.0.1 (CPU collectives over gloo),
trains the `dp_problem` MLP over all the cluster's devices in two ways and
saves the final parameters, gathered to every process, to ``--out``:

- ``jit``: ``jax.jit`` with ``NamedSharding``, params, moments and batch sharded
  over one mesh axis spanning both processes (no ``axis_name``);
- ``shard_map``: weights sharded (FSDP), biases replicated, per-leaf ``axis_name``.

The device count per process comes from XLA_FLAGS, set by the parent.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
import dp_problem as prob  # noqa: E402
from data_parallel import join_cluster  # noqa: E402  (the example's own cluster set-up)


def global_array(value, mesh, spec):
  """A global array from a host value every process holds in full."""
  value = np.asarray(value)
  return jax.make_array_from_callback(
    value.shape, NamedSharding(mesh, spec), lambda index: value[index]
  )


def to_host(tree, mesh):
  """Gather a tree of global arrays onto every process (replicate, then read the local copy)."""
  replicated = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
  return jax.tree.map(lambda v: np.asarray(v.addressable_data(0)), replicated)


def train_jit(mesh, steps):
  tx = prob.make_tx()
  sharded = P("data")
  host_params = prob.init_params()
  params = {k: global_array(v, mesh, sharded) for k, v in host_params.items()}
  state = tx.init(params)  # eager init: the moments keep each param's sharding

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(prob.loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  xs, ys = prob.make_batches(steps)
  for t in range(steps):
    params, state = step(
      params, state, global_array(xs[t], mesh, sharded), global_array(ys[t], mesh, sharded)
    )
  return to_host(params, mesh)


def train_shard_map(mesh, steps):
  n = mesh.size
  axis_name = {k: "data" if k in prob.WEIGHTS else None for k in prob.LEAVES}
  tx = prob.make_tx(axis_name=axis_name)
  host_params = prob.init_params()
  param_specs = {k: P("data") if k in prob.WEIGHTS else P() for k in prob.LEAVES}
  host_state = tx.init(host_params)
  state_specs = prob.state_shardings(tx, host_state, host_params, param_specs, P())
  step = jax.jit(
    jax.shard_map(
      prob.fsdp_step(tx, prob.WEIGHTS, "data", n, check_vma=True),
      mesh=mesh,
      in_specs=(param_specs, state_specs, P("data"), P("data")),
      out_specs=(param_specs, state_specs),
    )
  )
  params = jax.tree.map(lambda v, s: global_array(v, mesh, s), host_params, param_specs)
  state = jax.tree.map(lambda v, s: global_array(v, mesh, s), host_state, state_specs)
  xs, ys = prob.make_batches(steps)
  for t in range(steps):
    x, y = global_array(xs[t], mesh, P("data")), global_array(ys[t], mesh, P("data"))
    params, state = step(params, state, x, y)
  return to_host(params, mesh)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--coordinator", required=True, help="host:port of process 0")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--steps", type=int, default=prob.STEPS)
  parser.add_argument("--out", required=True, help="npz file for this process's results")
  args = parser.parse_args(argv)

  join_cluster(args.coordinator, args.num_processes, args.process_id, timeout=60)
  try:
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    results = {"jit": train_jit(mesh, args.steps), "shard_map": train_shard_map(mesh, args.steps)}
    flat = {f"{mode}/{k}": v for mode, params in results.items() for k, v in params.items()}
    flat["process_count"] = np.asarray(jax.process_count())
    flat["device_count"] = np.asarray(jax.device_count())
    flat["local_device_count"] = np.asarray(jax.local_device_count())
    np.savez(args.out, **flat)
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
