"""The cases of cases.py as optax_lamb.compat calls, and a jitted 20-step run of one.

Each library's case is translated the way a user would port it:

  torch libraries  the two parameter groups -> weight_decay_mask (True on problem.DECAYED);
                   a scheduled case -> an optax schedule lr(count) = lr * lr_factor(count)
                   (timm's corrected_weight_decay also gets base_lr = the case's lr)
  Keras            exclude_from_weight_decay(var_names=...) -> weight_decay_mask (the names
                   re.search'ed in each path's last component, as Keras does)
  TF Addons        the case's own arguments (the exclusions are regexes of the paths)
"""

from __future__ import annotations

import re
from typing import Any

import cases
import jax
import jax.numpy as jnp
import numpy as np
import optax
import problem
from helpers import fast_compile as _fast_compile

import optax_lamb
from optax_lamb import compat
from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend

CONSTRUCTORS = {
  "apex": compat.apex_fused_lamb,
  "deepspeed": compat.deepspeed_fused_lamb,
  "timm": compat.timm_lamb,
  "torch_optimizer": compat.torch_optimizer_lamb,
  "keras": compat.keras_lamb,
  "tfa": compat.tfa_lamb,
}
# Tiny launches: 16-element chunks, 4 leaves per launch (two launches for the problem's five),
# pass 2 in XLA for leaves of 48 elements or more in tx.update (encoder/kernel), kernels else.
PALLAS = PallasTritonBackend(
  block_sizes=BlockSizes(
    block=16, max_leaves_per_call=4, num_warps=4, sum_block=16, xla_pass2_min_size=48
  ),
  interpret=True,
)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}
_TORCH_DEFAULT_LR = 1e-3
_KERAS_DEFAULT_LR = 0.001


def lr_factor(count):
  """problem.lr_factor on a step count that may be traced."""
  return jnp.minimum(1.0, (count + 1) / 5)


def _schedule(base: float):
  return lambda count: base * lr_factor(count)


def compat_kwargs(library: str, case: str) -> dict[str, Any]:
  """The compat constructor's arguments for the library's case."""
  kwargs = dict(cases.CASES[library][case])
  scheduled = case in cases.SCHEDULED.get(library, ())
  if library in cases.TORCH_LIBRARIES:
    kwargs["weight_decay_mask"] = {name: name in problem.DECAYED for name in problem.NAMES}
    if scheduled:
      base = kwargs.get("lr", _TORCH_DEFAULT_LR)
      kwargs["lr"] = _schedule(base)
      if kwargs.get("corrected_weight_decay"):
        kwargs["base_lr"] = base
  elif library == "keras":
    excluded = re.compile("|".join(problem.NOT_DECAYED_KERAS_NAMES))
    kwargs["weight_decay_mask"] = {
      name: not excluded.search(name.rsplit("/", 1)[-1]) for name in problem.NAMES
    }
    if scheduled:
      kwargs["learning_rate"] = _schedule(kwargs.get("learning_rate", _KERAS_DEFAULT_LR))
  return kwargs


def initial_params() -> dict[str, jax.Array]:
  return {name: jnp.asarray(p) for name, p in problem.initial_params().items()}


def stacked_gradients() -> dict[str, jax.Array]:
  """problem.gradients() as one array per leaf with a leading axis of problem.STEPS."""
  steps = problem.gradients()
  return {name: jnp.asarray(np.stack([g[name] for g in steps])) for name in problem.NAMES}


def trajectory(tx: optax.GradientTransformation, *, fused: bool = False) -> dict[str, dict]:
  """{'step1', 'final'}: the params after the first and the last of problem.STEPS steps.

  One jitted function runs every step (a scan); `fused` steps with
  optax_lamb.update_and_apply instead of tx.update + optax.apply_updates.
  """

  def run(params, grads):
    def step(carry, g):
      p, s = carry
      if fused:
        p, s = optax_lamb.update_and_apply(tx, g, s, p)
      else:
        updates, s = tx.update(g, s, p)
        p = optax.apply_updates(p, updates)
      return (p, s), p

    _, ps = jax.lax.scan(step, (params, tx.init(params)), grads)
    return jax.tree.map(lambda x: x[0], ps), jax.tree.map(lambda x: x[-1], ps)

  first, final = jax.device_get(_fast_compile.jit(run)(initial_params(), stacked_gradients()))
  return {"step1": first, "final": final}
