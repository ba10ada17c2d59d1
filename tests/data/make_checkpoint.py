"""Write the committed checkpoints of tests/data/checkpoints/ (run once, by the code that made them).

For each option set of `CONFIGS`: three steps of lamb from fixed params and
gradients, then the state is saved with orbax (``StandardCheckpointer``, in
``<name>/orbax``) and with ``flax.serialization`` (``<name>/state.msgpack``);
``<name>/steps.npz`` holds the params after the three steps, the gradients of
a fourth, and the params and state leaves after it. The test
(tests/integration/test_checkpoint.py) restores each with the current code and
checks every leaf, and the fourth step, bit for bit: the checkpoint format and
the step did not change.

    python tests/data/make_checkpoint.py [FOLDER]   # from the repository root

``tests/data/checkpoints`` was made by optax_lamb at commit e617aff (the first four
configurations), ``tests/data/checkpoints-605f0a2`` at commit 605f0a2 (all of them):
each folder is read back by the current code with the configurations it holds.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_lamb  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "checkpoints"
FOLDERS = {"e617aff": HERE / "checkpoints", "605f0a2": HERE / "checkpoints-605f0a2"}
STEPS = 3
SHAPES = {"w": (3, 4), "b": (4,)}


def configs() -> dict:
  """name: (lamb, the params' dtype, whether the second gradients hold a NaN)."""
  return {
    "plain": (optax_lamb.lamb(1e-2), jnp.float32, False),
    "skip_master_bfloat16": (
      optax_lamb.lamb(1e-2, weight_decay=0.01, skip_nonfinite=True, master_weights=True),
      jnp.bfloat16,
      True,
    ),
    "schedules_mask": (
      optax_lamb.lamb(
        optax.linear_schedule(1e-2, 1e-3, 10),
        weight_decay=optax.linear_schedule(0.1, 0.01, 10),
        mask={"w": True, "b": False},
      ),
      jnp.float32,
      False,
    ),
    "stacked_axes": (optax_lamb.lamb(1e-2, stacked_axes={"w": 1, "b": 0}), jnp.float32, False),
    # The compat variants' placements (L2, decay of the params, step-size bias correction).
    "apex_l2": (optax_lamb.compat.apex_fused_lamb(1e-2, adam_w_mode=False), jnp.float32, False),
    "keras_decoupled": (
      optax_lamb.compat.keras_lamb(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.05),
      jnp.float32,
      False,
    ),
    "deepspeed_skip": (
      optax_lamb.compat.deepspeed_fused_lamb(1e-2, weight_decay=0.01, skip_nonfinite=True),
      jnp.float32,
      True,
    ),
  }


def params_and_grads(dtype, with_nan: bool):
  """Fixed params and STEPS + 1 gradients (`with_nan`: a NaN in the second, a skipped step)."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}
  grads = [{k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}
           for _ in range(STEPS + 1)]  # fmt: skip
  if with_nan:
    grads[1]["w"] = grads[1]["w"].at[0, 0].set(jnp.nan)
  return params, grads


def bits(x) -> np.ndarray:
  """The leaf's bits as unsigned integers (npz keeps no bfloat16), its dtype aside."""
  x = np.asarray(x)
  return x.view(f"uint{8 * x.dtype.itemsize}")


def step_fn(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def trained(tx, dtype, with_nan: bool):
  """(params, state) after STEPS steps, the fourth step's gradients, and its (params, state)."""
  params, grads = params_and_grads(dtype, with_nan)
  step = step_fn(tx)
  state = tx.init(params)
  for g in grads[:STEPS]:
    params, state = step(params, state, g)
  return params, state, grads[STEPS], step(params, state, grads[STEPS])


def main(out: Path = OUT) -> None:
  import orbax.checkpoint as ocp
  from flax import serialization

  shutil.rmtree(out, ignore_errors=True)
  for name, (tx, dtype, with_nan) in configs().items():
    params, state, grads, (next_params, next_state) = trained(tx, dtype, with_nan)
    folder = out / name
    folder.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / "orbax", state)
    checkpointer.wait_until_finished()
    (folder / "state.msgpack").write_bytes(serialization.to_bytes(state))
    trees = {"state": state, "params": params, "grads": grads, "next_params": next_params,
             "next_state": next_state}  # fmt: skip
    np.savez(
      folder / "steps.npz",
      **{f"{tree}_{i}": bits(x) for tree, value in trees.items()
         for i, x in enumerate(jax.tree.leaves(value))},
    )  # fmt: skip
    print(f"{name}: {len(jax.tree.leaves(state))} state leaves", file=sys.stderr)


if __name__ == "__main__":
  main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else OUT)
