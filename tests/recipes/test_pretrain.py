"""``python -m optax_lamb_recipes.pretrain``: end to end, kill and resume, devices and processes.

The runs are the smoke preset (24 + 8 steps of a tiny BERT) on 60 lines of the King James Bible
with the committed vocabulary, each in a subprocess with its own device count and XLA:CPU's
fast-compile options (helpers/fast_compile.py): every one-device run has the same programs, so
they come from the persistent compilation cache after the first.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("tensorboardX")

from helpers import fast_compile
from helpers.jaxprs import dot_flops

from optax_lamb_recipes import data, model
from optax_lamb_recipes.pretrain import __main__ as cli
from optax_lamb_recipes.pretrain import bench, checkpoint, config, metrics, optim, shards, step
from optax_lamb_recipes.pretrain import data as pdata
from optax_lamb_recipes.pretrain import model as pmodel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(ROOT, "optax_lamb_recipes", data.TOKENIZER_FILE)
SMALL = ["--set", "checkpoint_every=6", "--set", "log_every=1", "--no-progress", "--vocab", VOCAB,
         "--held-out-every", "5"]  # fmt: skip
TIMEOUT_S = 240


def env(devices: int) -> dict[str, str]:
  """This environment with its own device count and the repository on the path."""
  out = dict(os.environ)
  flags = [f for f in out.get("XLA_FLAGS", "").split() if "device_count" not in f]
  fast = [f"--{k}={str(v).lower()}" for k, v in fast_compile.options().items()]
  out["XLA_FLAGS"] = " ".join([*flags, *fast, f"--xla_force_host_platform_device_count={devices}"])
  out["JAX_PLATFORMS"] = "cpu"
  out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, out.get("PYTHONPATH", "")) if p)
  return out


def pretrain(*args: str, devices: int = 1) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "optax_lamb_recipes.pretrain", "--preset", "smoke", *args]
  return subprocess.run(
    cmd, env=env(devices), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S
  )


def final_params(out_dir, step: int | None = None) -> tuple[int, list[np.ndarray]]:
  state, meta = checkpoint.load(os.path.join(out_dir, "checkpoints"), step)
  return meta["step"], jax.tree.leaves(state["params"])


def losses(out_dir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in metrics.read_metrics(out_dir)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("corpus") / "kjv60.txt"
  path.write_text("\n".join(data.kjv_text().split("\n")[:60]))
  return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> str:
  """The small run, uninterrupted, on one device."""
  out = str(tmp_path_factory.mktemp("reference"))
  done = pretrain(*SMALL, "--corpus", corpus, "--out", out)
  assert done.returncode == 0, done.stdout + done.stderr
  return out


@pytest.mark.slow  # a recipe job end to end (23 s): CI runs it
def test_smoke_preset_end_to_end(tmp_path):
  """The documented command, as it is: the King James Bible, both phases, every output."""
  done = pretrain("--out", str(tmp_path), "--no-progress")
  assert done.returncode == 0, done.stdout + done.stderr
  records = metrics.read_metrics(str(tmp_path))
  cfg = config.PRESETS["smoke"]
  assert [r["step"] for r in records] == list(range(4, cfg.total_steps + 1, 4))
  assert [r["phase"] for r in records][-1] == 1
  assert all(np.isfinite(r["loss"]) and r["trust_ratio/q50"] > 0 for r in records)
  assert records[-1]["loss"] < records[0]["loss"]
  assert "tokens_per_s_per_device" in records[-1] and "mfu" not in records[-1]  # no CPU peak
  assert os.listdir(tmp_path / "tb")
  assert final_params(tmp_path)[0] == cfg.total_steps
  evals = [r for r in records if "eval/loss" in r]  # held-out, every eval_every and phase end
  assert [r["step"] for r in evals] == list(range(cfg.eval_every, cfg.total_steps + 1, 8))
  assert all(np.isfinite(r["eval/loss"]) and 0 <= r["eval/accuracy"] <= 1 for r in evals)
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
  assert all(r["step_s"] > 0 for r in records[1:])  # the first window is the compile's
  assert any("checkpoint_s" in r for r in records)  # saves timed apart from the steps


@pytest.mark.slow  # a subprocess: CI runs it (pytest -m slow)
def test_held_out_evaluation_is_reproducible(tmp_path, corpus, reference):
  """A second run of the same command gives the same held-out loss and accuracy, bit for bit."""
  done = pretrain(*SMALL, "--corpus", corpus, "--out", str(tmp_path))
  assert done.returncode == 0, done.stdout + done.stderr

  def evals(out):
    return {r["step"]: (r["eval/loss"], r["eval/accuracy"]) for r in metrics.read_metrics(out)
            if "eval/loss" in r}  # fmt: skip

  assert sorted(evals(reference)) == [8, 16, 24, 32]
  assert evals(str(tmp_path)) == evals(reference)


@pytest.mark.slow  # subprocesses: CI runs it (pytest -m slow)
def test_sigterm_and_hard_kill_resume_bit_identically(tmp_path, corpus, reference):
  """SIGTERM saves and stops (exit 143); a SIGKILL loses what followed the last checkpoint;
  each restart continues, and the run ends where the uninterrupted one does, bit for bit."""
  args = [*SMALL, "--corpus", corpus, "--out", str(tmp_path)]
  term = pretrain(*args, "--kill-at", "7:TERM")
  assert term.returncode == checkpoint.EXIT_TERMINATED, term.stdout + term.stderr
  assert checkpoint.load(tmp_path / "checkpoints")[1]["step"] == 7
  kill = pretrain(*args, "--kill-at", "27:KILL")  # phase 2: 24 (phase 1's end) may be unwritten
  assert kill.returncode == -signal.SIGKILL
  assert "resuming from step 7" in kill.stdout
  rest = pretrain(*args)
  assert rest.returncode == 0, rest.stdout + rest.stderr
  assert "resuming from step 18" in rest.stdout or "resuming from step 24" in rest.stdout
  assert losses(tmp_path) == losses(reference)  # every step, bit for bit
  step, got = final_params(tmp_path)
  want = final_params(reference)[1]
  assert step == 32 and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.slow  # subprocesses: CI runs it (pytest -m slow)
def test_eight_devices_with_sharded_params_match_one_device(tmp_path, corpus, reference):
  done = pretrain(*SMALL, "--corpus", corpus, "--out", str(tmp_path), "--fsdp", devices=8)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "1 process(es), 8 device(s)" in done.stdout
  n = len(jax.tree.leaves(abstract_model(pmodel.bert_config("tiny", 2048))[1]))  # 25: stacked
  assert f"parameter arrays split over the devices: {n} of {n}" in done.stdout
  got, want = losses(tmp_path), losses(reference)
  assert sorted(got) == list(range(1, 33))
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=2e-5)
  for a, b in zip(final_params(tmp_path)[1], final_params(reference)[1], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.slow  # subprocesses: CI runs it (pytest -m slow)
def test_phase_two_from_another_runs_phase_one(tmp_path, corpus, reference):
  """Phase 1 alone (phases=1), then phase 2 in another --out from its checkpoint: the same
  losses and final parameters as the run of both phases, bit for bit; a mismatched phase 1 is
  refused before anything is written."""
  first, second = str(tmp_path / "phase1"), str(tmp_path / "phase2")
  done = pretrain(*SMALL, "--corpus", corpus, "--out", first, "--set", "phases=1")
  assert done.returncode == 0, done.stdout + done.stderr
  done = pretrain(*SMALL, "--corpus", corpus, "--out", second, "--init-from", first)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "resuming from step 24" in done.stdout
  got = {**losses(first), **losses(second)}
  assert got == losses(reference)
  step, params = final_params(second)
  want = final_params(reference)[1]
  assert step == 32 and all(np.array_equal(a, b) for a, b in zip(params, want, strict=True))
  other = str(tmp_path / "other")
  refused = pretrain(*SMALL, "--corpus", corpus, "--out", other, "--init-from", first,
                     "--set", "phase1.lr=0.001")  # fmt: skip
  assert refused.returncode == 2 and "phase1" in refused.stderr
  assert not os.path.exists(os.path.join(other, "checkpoints"))


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # subprocesses: CI runs it (pytest -m slow)
def test_two_processes_match_one_device(tmp_path, corpus, reference):
  """Two jax.distributed processes of two CPU devices each, sharded params, one checkpoint."""
  coordinator = f"127.0.0.1:{free_port()}"
  base = [sys.executable, "-m", "optax_lamb_recipes.pretrain", "--preset", "smoke", *SMALL]
  base += ["--set", "phases=1"]  # 24 steps (one program to compile: a cluster compiles slowly)
  base += ["--corpus", corpus, "--out", str(tmp_path), "--fsdp", "--coordinator", coordinator]
  procs = [
    subprocess.Popen(
      [*base, "--num-processes", "2", "--process-id", str(i)],
      env=env(2),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )  # fmt: skip
    for i in range(2)
  ]
  deadline = time.monotonic() + TIMEOUT_S
  try:
    outs = [p.communicate(timeout=max(1, deadline - time.monotonic()))[0] for p in procs]
  finally:
    for p in procs:  # bounded: kill a worker left waiting for its peer
      if p.poll() is None:
        p.kill()
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
  assert "2 process(es), 4 device(s)" in outs[0]
  got, want = losses(tmp_path), losses(reference)
  assert sorted(got) == list(range(1, 25))
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=2e-5)
  step, params = final_params(tmp_path)
  assert step == 24
  for a, b in zip(params, final_params(reference, 24)[1], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


# --- pieces ------------------------------------------------------------------------------


def abstract_model(cfg, dtype=None):
  """The model's structure and parameter shapes (nothing computed: no compile)."""
  built = step.make_model(
    cfg, dtype, 0, step.sharding_rule(step.make_mesh(jax.devices()[:1]), False)
  )
  return built.graphdef, built.abstract


@pytest.mark.parametrize("seq_len", [32, 128])
def test_flop_count_matches_the_programs(seq_len):
  """The formula against the jaxpr's matmuls (exactly, forward and training) and XLA's count
  (which adds LayerNorm, GELU and softmax: a few percent more)."""
  cfg = pmodel.bert_config("tiny", 2048)
  graphdef, params = abstract_model(cfg)
  rng = np.random.default_rng(0)
  seqs = rng.integers(5, 2048, (3, seq_len)).astype(np.int32)
  batch = data.mask_tokens(seqs, rng, mask_id=4, vocab_size=2048)
  forward = lambda p: model.loss_fn(graphdef, p, batch)
  want = 3 * pmodel.forward_flops(cfg, seq_len, data.num_predictions(seq_len))
  assert dot_flops(jax.make_jaxpr(forward)(params).jaxpr) == want
  assert dot_flops(jax.make_jaxpr(jax.grad(forward))(params).jaxpr) == 3 * want
  assert 3 * pmodel.train_flops(cfg, seq_len, data.num_predictions(seq_len)) == 3 * want
  # XLA's cost analysis counts a loop's body once, whatever its trip count: its count is taken
  # of the same weights in the Python-loop model (the layers unrolled; the same matmuls).
  loop_graphdef, _ = model.init_params(cfg)
  unrolled = lambda p: model.loss_fn(loop_graphdef, pmodel.unstack_layers(p), batch)
  cost = jax.jit(unrolled).lower(params).cost_analysis()
  assert want <= cost["flops"] <= 1.1 * want
  assert pmodel.parameter_count(cfg) == sum(np.prod(x.shape) for x in jax.tree.leaves(params))


def test_mfu_and_trust_ratio_quantiles():
  ratios = np.array([0.5, 2.0, 1.0, 4.0, 3.0])
  raw = {"loss": 2.0, "grad_norm": 1.5, "trust_ratios": ratios}
  raw["lr"] = 1e-3
  out = metrics.summarize(raw, tokens=8000, seconds=2.0, flops=4e12, devices=4, peak=1e12)
  assert out["tokens_per_s_per_device"] == 1000.0 and out["mfu"] == 0.5
  assert [out[f"trust_ratio/q{q}"] for q in ("00", "50", "100")] == [0.5, 2.0, 4.0]
  assert metrics.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert metrics.peak_flops("NVIDIA H100 PCIe") == 756e12
  assert metrics.peak_flops("cpu") is None and metrics.peak_flops("cpu", 2.0) == 2e12


def test_batches_are_a_function_of_seed_phase_and_step():
  """The sampler's batches (rows and sample numbers, which key the masks) depend only on the
  seed, the phase and the step: a sampler restored at step 3 gives step 3's batch."""

  def sampler(seed=0, phase=0, state=None):
    s = shards.Sampler(10, 4, seed, phase)
    if state is not None:
      s.restore(state)
    return s

  a, b = sampler(), sampler()
  steps_a = [a.take() for _ in range(5)]
  steps_b = [b.take() for _ in range(5)]
  for x, y in zip(steps_a, steps_b, strict=True):
    np.testing.assert_array_equal(x[0], y[0])
    np.testing.assert_array_equal(x[1], y[1])
  for t in (3, 0, 4):  # any order: the state of step t is (epoch, position) = divmod(4 t, 10)
    epoch, position = divmod(4 * t, 10)
    again = sampler(state={"seed": 0, "phase": 0, "epoch": epoch, "position": position}).take()
    np.testing.assert_array_equal(again[0], steps_a[t][0])
    np.testing.assert_array_equal(again[1], steps_a[t][1])
  epoch = np.concatenate([rows for rows, _ in steps_a])  # 20 rows: two epochs of 10
  assert sorted(epoch[:10]) == list(range(10)) and sorted(epoch[10:]) == list(range(10))
  other = sampler(seed=1).take()
  assert not np.array_equal(steps_a[0][0], other[0])
  assert not np.array_equal(steps_a[0][0], sampler(phase=1).take()[0])


def test_settings_and_square_root_scaling():
  cfg = config.override(config.PRESETS["large"], [("phase1.batch", 16384), ("seed", 3)])
  assert cfg.phases[0].peak_lr == pytest.approx(6e-3 / 2) and cfg.seed == 3
  assert cfg.phases[1].peak_lr == 4e-3
  assert cfg.phases[0].accumulation(8) == 16384 // (64 * 8)
  assert config.PRESETS["smoke"].phases[0].accumulation(8) == 1  # 4 per device
  with pytest.raises(ValueError, match="micro"):
    config.PRESETS["smoke"].phases[0].accumulation(3)
  assert config.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
  args = cli.parse_args(
    ["--opt", "timm_lamb", "--opt-arg", "betas=(0.9, 0.98)", "--set", "phases=1"]
  )
  cfg = cli.run_config(args)
  assert cfg.opt_args == (("betas", (0.9, 0.98)),) and len(cfg.phases) == 1


@pytest.mark.parametrize("name", optim.NAMES)
def test_every_optimizer_by_name(name):
  params = {"kernel": np.ones((4, 3), np.float32), "bias": np.zeros(3, np.float32)}
  tx = optim.build(name, lambda t: 1e-3, {})
  state = tx.init(params)
  grads = {"kernel": np.full((4, 3), 0.1, np.float32), "bias": np.full(3, 0.1, np.float32)}
  updates, _ = fast_compile.jit(tx.update)(grads, state, params)
  assert all(np.isfinite(u).all() for u in jax.tree.leaves(updates))
  assert optim.has_trust_ratios(tx, params) == (name != "adamw")
  with pytest.raises(TypeError):
    optim.build(name, lambda t: 1e-3, {"no_such_option": 1})


def test_bench_skips_without_a_gpu(tmp_path):
  assert bench.gpu_missing() == "backend is cpu"
  assert bench.main(["--require-gpu", "--json", str(tmp_path / "b.json")]) == 0
  assert json.loads((tmp_path / "b.json").read_text())["skipped"] == "backend is cpu"


def test_bf16_compute_keeps_float32_params_and_loss():
  cfg = model.BertConfig(vocab_size=256, hidden=32, layers=1, heads=2, mlp=64, max_len=32)
  graphdef, params = abstract_model(cfg, jnp.bfloat16)
  rng = np.random.default_rng(0)
  batch = data.mask_tokens(rng.integers(5, 256, (2, 32)).astype(np.int32), rng, mask_id=4,
                           vocab_size=256)  # fmt: skip
  forward = lambda p: model.loss_fn(graphdef, p, batch)
  loss_and_grads = jax.value_and_grad(forward)
  jaxpr = jax.make_jaxpr(forward)(params).jaxpr  # every matmul of the forward pass in bf16
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.02, a.shape), a.dtype), params)
  loss, grads = fast_compile.jit(loss_and_grads)(params)
  assert loss.dtype == jnp.float32 and np.isfinite(loss)
  assert {x.dtype for x in jax.tree.leaves((params, grads))} == {np.dtype(np.float32)}


def test_corpus_with_a_trained_or_a_given_vocabulary(tmp_path, corpus):
  """No --vocab: a WordPiece trained on the corpus, kept for the restarts; a BERT vocab.txt
  gives the ids of the tokenizers JSON it was written from."""
  trained = pdata.load_corpus([corpus], vocab_size=300, out_dir=str(tmp_path))
  assert trained.vocab_size == 300 and (tmp_path / pdata.TOKENIZER_FILE).exists()
  again = pdata.load_corpus([corpus], vocab_size=300, out_dir=str(tmp_path))
  assert again.fingerprint == trained.fingerprint
  vocab = json.loads(open(VOCAB).read())["model"]["vocab"]
  (tmp_path / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
  from_txt = pdata.load_corpus([corpus], vocab=str(tmp_path / "vocab.txt"))
  from_json = pdata.load_corpus([corpus], vocab=VOCAB)
  np.testing.assert_array_equal(from_txt.ids, from_json.ids)
  assert from_json.mask_id == vocab["[MASK]"] and from_json.model_vocab == 2048


def test_a_checkpoint_of_another_run_is_refused():
  cfg = config.PRESETS["smoke"].to_json()
  meta = {"config": cfg, "corpus": "abc"}
  checkpoint.check_resumable(meta, {**cfg, "log_every": 1, "checkpoint_every": 2}, "abc")
  with pytest.raises(SystemExit, match="seed"):
    checkpoint.check_resumable(meta, {**cfg, "seed": 1}, "abc")
  with pytest.raises(SystemExit, match="corpus"):
    checkpoint.check_resumable(meta, cfg, "abd")
