"""The sharded training step: a mesh over every device, the batch split over it, and optionally
the parameters and optimizer state too (FSDP); gradients accumulated over micro-batches.

Under ``jax.jit`` the arrays are global, so the mean loss's gradient is already all-reduced by
the compiler and every optimizer runs unchanged (no ``axis_name``). The accumulated gradient is
the mean of the micro-batch means, which is the full batch's mean because every sequence has the
same number of masked positions (``data.mask_tokens``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb
from optax_lamb_recipes import model as model_lib
from optax_lamb_recipes import train
from optax_lamb_recipes.data import MLMBatch
from optax_lamb_recipes.pretrain import model as pretrain_model

AXIS = "data"


def make_mesh(devices: list | None = None) -> Mesh:
  """A one-axis mesh over ``devices`` (default: every device of every process)."""
  devices = jax.devices() if devices is None else devices
  # Grouped by process: each process's devices hold a contiguous block of the batch, the rows
  # it reads (``global_batch``).
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return Mesh(np.asarray(devices), (AXIS,))


def sharding_rule(mesh: Mesh, fsdp: bool) -> Callable[[Any], NamedSharding]:
  """A leaf's sharding from its shape: replicated, or (FSDP) split along its largest dimension
  that the device count divides. Params and their Adam moments have the same shape, so the
  moments land where their params are."""
  n = mesh.size

  def rule(leaf: Any) -> NamedSharding:
    dims = [d for d, size in enumerate(leaf.shape) if size % n == 0] if fsdp and n > 1 else []
    if not dims:
      return NamedSharding(mesh, P())
    spec = [None] * len(leaf.shape)
    spec[max(dims, key=lambda d: leaf.shape[d])] = AXIS
    return NamedSharding(mesh, P(*spec))

  return rule


def abstract_with(tree: Any, shardings: Any) -> Any:
  """``jax.ShapeDtypeStruct`` leaves with shardings (a restore target)."""
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
  )


@dataclasses.dataclass
class Model:
  """The model's structure, its initial parameters' shardings and how to make them."""

  graphdef: Any
  abstract: Any  # ShapeDtypeStruct leaves with shardings
  init: Callable[[], Any]

  @property
  def shardings(self) -> Any:
    return jax.tree.map(lambda a: a.sharding, self.abstract)


def make_model(
  cfg: model_lib.BertConfig, dtype: Any, seed: int, rule: Callable, remat: bool = False
) -> Model:
  """The model (``pretrain.model.ScannedBert``: stacked layers, ``remat`` per layer), its
  parameters initialised by one jitted program straight into their shardings."""
  box = {}

  def make() -> Any:
    box["graphdef"], params = pretrain_model.init_params(cfg, seed, dtype, remat)
    return params

  shapes = jax.eval_shape(make)
  shardings = jax.tree.map(rule, shapes)
  return Model(
    box["graphdef"], abstract_with(shapes, shardings), jax.jit(make, out_shardings=shardings)
  )


@dataclasses.dataclass
class Step:
  """One phase's optimizer, state shardings and jitted programs."""

  tx: optax.GradientTransformation
  state_abstract: Any
  init: Callable  # params -> opt_state
  carry: Callable  # (params, previous phase's opt_state) -> opt_state (moments kept)
  update: Callable  # (params, opt_state, batch, phase step) -> (params, opt_state, metrics)
  batch_sharding: NamedSharding
  evaluate: Callable  # (params, batch) -> {"eval/loss", "eval/accuracy"} over every micro-batch


def make_step(
  model: Model, tx: optax.GradientTransformation, schedule, mesh: Mesh, rule, ratios: bool
) -> Step:
  """The jitted programs of one phase with learning rate ``schedule`` (reported, from the
  phase's step) and optimizer ``tx``; ``ratios``: report LAMB's trust ratios."""
  shapes = jax.eval_shape(tx.init, model.abstract)
  state_sh = jax.tree.map(rule, shapes)
  p_sh = model.shardings
  batch_sh = NamedSharding(mesh, P(None, AXIS))  # [micro-batches, batch, ...]
  decayed = np.asarray(jax.tree.leaves(train.decay_mask(model.abstract)))
  replicated = all(a.sharding.is_fully_replicated for a in jax.tree.leaves(model.abstract))
  local_mesh = mesh if replicated else None  # per-device accumulation needs whole parameters

  def update(params, state, batch, t) -> tuple:
    params, state, metrics = _update(
      model.graphdef, tx, params, state, batch, decayed, ratios, local_mesh
    )
    return params, state, {**metrics, "lr": schedule(t)}

  update = jax.jit(
    update,
    in_shardings=(p_sh, state_sh, batch_sh, None),
    out_shardings=(p_sh, state_sh, None),
    donate_argnums=(0, 1),
  )
  evaluate = jax.jit(
    functools.partial(_evaluate, model.graphdef),
    in_shardings=(p_sh, batch_sh),
    out_shardings=None,
  )
  return Step(
    tx=tx,
    state_abstract=abstract_with(shapes, state_sh),
    init=jax.jit(tx.init, in_shardings=(p_sh,), out_shardings=state_sh),
    carry=jax.jit(
      lambda p, old: train.carry_over_moments(old, tx.init(p)),
      out_shardings=state_sh,
      donate_argnums=(1,),
    ),
    update=update,
    batch_sharding=batch_sh,
    evaluate=evaluate,
  )


def _accumulate(graphdef, params, batch: MLMBatch, zero=0.0) -> tuple[Any, jax.Array]:
  """The mean gradient and loss (float32) over the ``[k, ...]`` micro-batches, one at a time
  (``zero``: the loss's initial value, of the loss's kind inside ``shard_map``)."""
  grad_fn = jax.value_and_grad(model_lib.loss_fn, argnums=1)

  def micro(carry, mb) -> tuple:
    grads, loss = carry
    mb_loss, mb_grads = grad_fn(graphdef, params, MLMBatch(*mb))
    return (jax.tree.map(jnp.add, grads, mb_grads), loss + mb_loss), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.asarray(zero, jnp.float32)), tuple(batch))
  k = batch.inputs.shape[0]
  return jax.tree.map(lambda g: g / k, grads), loss / k


def mean_gradient(graphdef, params, batch: MLMBatch, mesh: Mesh | None) -> tuple[Any, jax.Array]:
  """The batch's mean gradient and loss with one all-reduce per step: each device accumulates
  its own micro-batches' gradients (``shard_map``), and their mean is taken once at the end.

  (Under plain ``jit`` the replicated accumulator makes XLA all-reduce every micro-batch's
  gradient inside the loop: ``k`` reductions a step.) ``mesh`` None (sharded parameters, FSDP):
  plain ``jit``, XLA's reduce-scatters per micro-batch. Every device holds equally many
  sequences with equally many masked positions, so the mean of the means is the batch's mean.
  """
  if mesh is None or mesh.size == 1:
    return _accumulate(graphdef, params, batch)

  def local(params, batch):
    vary = lambda x: jax.lax.pcast(x, AXIS, to="varying")  # noqa: E731
    params = jax.tree.map(vary, params)  # per device: no reduction in the backward pass
    grads, loss = _accumulate(graphdef, params, batch, vary(jnp.zeros(())))  # not reduced
    return jax.lax.pmean((grads, loss), AXIS)  # the one reduction

  return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P())(
    params, batch
  )


def _update(graphdef, tx, params, state, batch: MLMBatch, decayed, ratios, mesh) -> tuple:
  """The mean gradient over the micro-batches (float32), then one optimizer step."""
  grads, loss = mean_gradient(graphdef, params, batch, mesh)
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
  if ratios:  # the weight matrices' ratios (the others are 1 by BERT's rule)
    leaves = jax.tree.leaves(optax_lamb.trust_ratios(state))
    keep = decayed if len(leaves) == len(decayed) else [True] * len(leaves)  # several stages
    metrics["trust_ratios"] = jnp.concatenate(
      [jnp.ravel(r) for r, d in zip(leaves, keep, strict=True) if d]
    )
  return params, state, metrics


def _evaluate(graphdef, params, batch: MLMBatch) -> dict[str, jax.Array]:
  """Mean masked-LM loss and accuracy (the argmax is the target) over ``[m, b, ...]`` examples."""
  model = nnx.merge(graphdef, params)

  def micro(carry, mb) -> tuple:
    mb = MLMBatch(*mb)
    logits = model(mb.inputs, mb.positions).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, mb.targets)
    right = jnp.argmax(logits, axis=-1) == mb.targets
    return (carry[0] + loss.sum(), carry[1] + right.sum()), None

  zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
  (loss, right), _ = jax.lax.scan(micro, zero, tuple(batch))
  count = batch.targets.size
  return {"eval/loss": loss / count, "eval/accuracy": right / count}


def global_batch(
  local: MLMBatch, accumulation: int, sharding: NamedSharding,
  process_index: int = 0, process_count: int = 1,
) -> MLMBatch:  # fmt: skip
  """Global ``[k, B / k, ...]`` arrays from each process's contiguous slice of the ``B`` rows.

  Row ``r`` of the global batch goes to micro-batch ``r % k``, column ``r // k``: process
  ``p``'s rows ``[p B / P, (p + 1) B / P)`` fill columns ``[p B / (k P), (p + 1) B / (k P))``,
  which its devices hold (the mesh groups the devices by process), so no process needs another's
  rows.
  """
  k = accumulation

  def put(x: np.ndarray) -> jax.Array:
    x = np.asarray(x)
    cols = x.shape[0] // k
    block = x.reshape(cols, k, *x.shape[1:]).swapaxes(0, 1)  # [k, cols, ...]
    shape = (k, cols * process_count, *x.shape[1:])
    first = process_index * cols

    def rows_here(index: tuple) -> np.ndarray:
      start, stop, _ = index[1].indices(shape[1])
      if start < first or stop > first + cols:
        raise ValueError(
          f"process {process_index}'s devices hold batch columns [{start}, {stop}), outside "
          f"the [{first}, {first + cols}) it read: the mesh must group devices by process"
        )
      return block[(index[0], slice(start - first, stop - first), *index[2:])]

    return jax.make_array_from_callback(shape, sharding, rows_here)

  return MLMBatch(*(put(x) for x in local))
