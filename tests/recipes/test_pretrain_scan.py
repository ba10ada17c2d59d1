"""The pretraining model's stacked, scanned layers (``pretrain.model.ScannedBert``) against the
laptop recipe's Python loop over the same weights (``model.Bert``): the forward pass, remat's
loss and gradients, and one optimizer step with one trust ratio per layer."""

import jax
import numpy as np
import optax
import pytest

pytest.importorskip("flax")

from flax import nnx
from helpers import fast_compile
from helpers.jaxprs import dot_flops

import optax_lamb
from optax_lamb_recipes import data, model
from optax_lamb_recipes.pretrain import checkpoint, config, optim, step
from optax_lamb_recipes.pretrain import model as pmodel

CFG = model.BertConfig(vocab_size=128, hidden=32, layers=3, heads=2, mlp=64, max_len=32)


def a_batch(cfg=CFG, rows=4, seq_len=32, seed=0) -> data.MLMBatch:
  rng = np.random.default_rng(seed)
  seqs = rng.integers(5, cfg.vocab_size, (rows, seq_len)).astype(np.int32)
  return data.mask_tokens(seqs, rng, mask_id=4, vocab_size=cfg.vocab_size)


@pytest.fixture(scope="module")
def scanned():
  """The scanned model's structure and weights, and the loop model's with the same weights."""
  graphdef, params = pmodel.init_params(CFG, seed=0)
  loop_graphdef, _ = model.init_params(CFG, seed=0)
  return graphdef, params, loop_graphdef, pmodel.unstack_layers(params)


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_scanned_forward_equals_the_python_loop(scanned):
  graphdef, params, loop_graphdef, loop_params = scanned
  batch = a_batch()
  logits = lambda g, p: nnx.merge(g, p)(batch.inputs, batch.positions)  # noqa: E731
  got = fast_compile.jit(logits, static_argnums=0)(graphdef, params)
  want = fast_compile.jit(logits, static_argnums=0)(loop_graphdef, loop_params)
  assert got.shape == (4, data.num_predictions(32), CFG.vocab_size)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert jax.tree.leaves(params["layers"])[0].shape[0] == CFG.layers


def test_the_program_holds_one_layer_whatever_the_depth():
  """Compile time independent of depth: 2 and 8 layers trace to the same number of equations,
  and a scan of ``layers`` iterations."""

  def program(layers: int):
    cfg = model.BertConfig(**{**vars(CFG), "layers": layers})
    built = step.make_model(
      cfg, None, 0, step.sharding_rule(step.make_mesh(jax.devices()[:1]), False)
    )
    batch = a_batch()
    return jax.make_jaxpr(lambda p: model.loss_fn(built.graphdef, p, batch))(built.abstract).jaxpr

  shallow, deep = program(2), program(8)
  assert len(shallow.eqns) == len(deep.eqns)
  scans = [e.params["length"] for e in deep.eqns if e.primitive.name == "scan"]
  assert scans == [8]


def test_per_layer_params_convert_to_stacked_and_back(scanned):
  """``stack_layers`` reads the loop model's params (a checkpoint from before the layers were
  stacked, whose keys orbax gives back as strings): the scanned model then computes the same."""
  graphdef, params, loop_graphdef, _ = scanned
  _, old = model.init_params(CFG, seed=3)
  as_restored = {**old, "layers": {str(k): v for k, v in old["layers"].items()}}
  stacked = pmodel.stack_layers(as_restored)
  assert jax.tree.structure(stacked) == jax.tree.structure(params)
  assert_trees_close(pmodel.unstack_layers(stacked), old, rtol=0, atol=0)
  batch = a_batch()
  np.testing.assert_allclose(
    model.loss_fn(graphdef, stacked, batch), model.loss_fn(loop_graphdef, old, batch), rtol=1e-5
  )


def test_remat_gives_the_same_loss_and_gradients_and_recomputes_only_the_layers(scanned):
  _, params, _, _ = scanned
  batch = a_batch(rows=8)
  out, flops, temp = {}, {}, {}
  for remat in (False, True):
    graphdef, _ = pmodel.init_params(CFG, seed=0, remat=remat)
    loss = lambda p, g=graphdef: model.loss_fn(g, p, batch)  # noqa: E731
    compiled = fast_compile.jit(jax.value_and_grad(loss)).lower(params).compile()
    out[remat] = compiled(params)
    temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    flops[remat] = dot_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-6)
  assert_trees_close(out[True][1], out[False][1], rtol=1e-5, atol=1e-8)
  # The backward pass runs each layer's forward again, and nothing else (the head is not
  # rematerialized): the layers' forward FLOPs, counted by the FLOP model's formula.
  n_pred = data.num_predictions(32)
  layers_forward = pmodel.forward_flops(CFG, 32, n_pred) - n_pred * (
    2 * CFG.hidden**2 + 2 * CFG.hidden * CFG.vocab_size
  )
  assert flops[True] - flops[False] == 8 * layers_forward
  assert temp[True] < temp[False], temp  # activations recomputed, not stored


@pytest.fixture(scope="module")
def gradients(scanned):
  """Both models' gradients on one batch: the scanned one's, and the loop's."""
  graphdef, params, loop_graphdef, loop_params = scanned
  grad = fast_compile.jit(jax.grad(model.loss_fn, argnums=1), static_argnums=0)
  batch = a_batch()
  return grad(graphdef, params, batch), grad(loop_graphdef, loop_params, batch)


def test_scanned_gradients_equal_the_python_loops(gradients):
  got, want = gradients
  assert_trees_close(pmodel.unstack_layers(got), want, rtol=1e-4, atol=1e-7)


def one_step(name: str, params, grads, args: dict) -> tuple:
  """The parameters after one step of ``name`` from ``params``, and its trust ratios."""
  tx = optim.build(name, lambda t: 1e-2, args)

  def update(grads, params):
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  new, state = fast_compile.jit(update)(grads, params)
  ratios = optax_lamb.trust_ratios(state) if name != "adamw" else None
  return new, ratios


# The compat LAMBs past the first (apex's) take a minute more on two cores: CI's slow run.
STEP_CASES = [
  n if n in ("lamb", "adamw", optim.COMPAT[0]) else pytest.param(n, marks=pytest.mark.slow)
  for n in optim.NAMES
]


@pytest.mark.parametrize("name", STEP_CASES)
def test_one_step_on_stacked_layers_is_the_per_layer_models(scanned, gradients, name):
  """Same weights and gradients (the loop model's, stacked), one step: the scanned model's
  updated params and (LAMBs) trust ratios are the loop model's, whose every layer is a leaf of
  its own (one ratio per layer there)."""
  _, params, _, loop_params = scanned
  loop_grads = gradients[1]
  new, ratios = one_step(name, params, pmodel.stack_layers(loop_grads), {})
  unstacked = {} if name == "adamw" else {"stacked_axes": None}  # AdamW has no such option
  want_new, want_ratios = one_step(name, loop_params, loop_grads, unstacked)
  assert_trees_close(pmodel.unstack_layers(new), want_new, rtol=1e-6, atol=1e-8)
  if name == "adamw":
    return
  stacked = jax.tree.leaves(ratios["layers"])
  assert {r.shape for r in stacked} == {(CFG.layers,)}  # one ratio per layer and leaf
  assert_trees_close(pmodel.unstack_layers(ratios), want_ratios, rtol=1e-6, atol=0)


def test_without_stacked_axes_a_stacked_leaf_gets_one_ratio_for_all_layers(scanned, gradients):
  """What ``optim.build``'s ``stacked_axes`` prevents (the comparison above can fail)."""
  _, params, _, _ = scanned
  _, merged = one_step("lamb", params, gradients[0], {"stacked_axes": None})
  _, per_layer = one_step("lamb", params, gradients[0], {})
  get = lambda tree: tree["layers"]["mlp_in"]["kernel"]  # noqa: E731
  assert np.shape(get(merged)) == () and np.shape(get(per_layer)) == (CFG.layers,)
  assert not np.allclose(get(per_layer), get(merged), rtol=1e-3)


def test_remat_is_a_setting_of_the_run():
  cfg = config.override(config.PRESETS["large"], [("remat", True)])
  assert config.validate(cfg).remat and not config.PRESETS["large"].remat
  with pytest.raises(ValueError, match="remat=1"):
    config.validate(config.override(cfg, [("remat", 1)]))
  assert config.from_json(cfg.to_json()) == cfg
  mesh = step.make_mesh(jax.devices()[:1])
  built = step.make_model(CFG, None, 0, step.sharding_rule(mesh, False), remat=True)
  assert nnx.merge(built.graphdef, built.abstract).remat


def test_a_checkpoint_with_per_layer_params_is_refused_by_name():
  """A run's checkpoint from before the layers were stacked: its configuration has no
  ``remat``; resuming it or starting phase 2 from it is refused before orbax's restore."""
  cfg = config.PRESETS["smoke"].to_json()
  old = {"config": {k: v for k, v in cfg.items() if k != "remat"}, "corpus": "abc"}
  assert checkpoint.per_layer(old) and not checkpoint.per_layer({"config": cfg})
  with pytest.raises(SystemExit, match="one by one.*stack_layers.*another --out"):
    checkpoint.check_resumable(old, cfg, "abc")
