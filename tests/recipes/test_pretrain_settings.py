"""Every setting of ``python -m optax_lamb_recipes.pretrain`` is checked before anything is
written or compiled: a bad one is refused with a line naming it and its value, and --out stays
as it was (absent, or an earlier run's directory untouched)."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")

from optax_lamb_recipes.pretrain import __main__ as cli
from optax_lamb_recipes.pretrain import checkpoint, config, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (setting, the text the refusal must name): each one failed late or not at all before.
REFUSED = [
  ("phase1.lr=-0.1", "phase1.lr=-0.1"),  # trained by gradient ascent, exit 0
  ("phase2.lr=inf", "phase2.lr=inf"),
  ("phase1.lr=nan", "phase1.lr=nan"),
  ("phase1.batch=abc", "phase1.batch='abc'"),  # failed inside the schedule code
  ("phase1.batch=0", "phase1.batch=0"),
  ("phase1.batch=12.5", "phase1.batch=12.5"),
  ("phase2.micro_batch=-8", "phase2.micro_batch=-8"),
  ("phase1.warmup=-1", "phase1.warmup=-1"),
  ("phase1.steps=0", "phase1.steps=0"),
  ("phase1.seq_len=4096", "phase1.seq_len=4096"),
  ("phases=0", "phases=0"),  # max() arg is an empty sequence
  ("phases=3", "phases=3"),
  ("phase3.lr=0.1", "phase3.lr=0.1"),
  ("log_every=0", "log_every=0"),  # ZeroDivisionError after 28 s, checkpoints/ written
  ("checkpoint_every=-5", "checkpoint_every=-5"),
  ("eval_every=0", "eval_every=0"),
  ("dtype=float8", "dtype='float8'"),
  ("seed=-1", "seed=-1"),
]


def fake_checkpoint(directory: str, preset: str) -> None:
  """A checkpoint whose metadata is ``preset``'s run (its arrays are never read)."""
  ckpt = checkpoint.Checkpoints(os.path.join(directory, "checkpoints"))
  meta = {"step": 8, "config": config.PRESETS[preset].to_json(), "corpus": "0" * 16}
  ckpt.save(8, {"params": {"w": jnp.zeros(3)}}, meta)
  ckpt.close()


def tree_listing(directory: str) -> list[tuple[str, int, int]]:
  """Every path under ``directory`` with its size and modification time."""
  out = []
  for root, dirs, files in os.walk(directory):
    for name in sorted(dirs + files):
      path = os.path.join(root, name)
      st = os.stat(path)
      out.append((os.path.relpath(path, directory), st.st_size, st.st_mtime_ns))
  return sorted(out)


@pytest.mark.parametrize(("setting", "named"), REFUSED)
def test_a_bad_setting_is_refused_before_anything_is_written(tmp_path, capsys, setting, named):
  out = tmp_path / "run"
  status = cli.main(["--set", setting, "--out", str(out), "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2
  assert len(err) == 1 and named in err[0], err
  assert not out.exists()


def test_a_bad_optimizer_argument_is_refused_by_name(tmp_path, capsys):
  out = tmp_path / "run"
  assert cli.main(["--opt-arg", "weight_decay=-1", "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "weight_decay=-1" in err[0]
  assert not out.exists()


def test_validate_accepts_every_preset():
  for name, cfg in config.PRESETS.items():
    assert config.validate(cfg) is cfg, name
  ok = config.override(config.PRESETS["smoke"], [("phases", 1), ("phase1.lr", 1)])
  assert config.validate(ok).phases[0].lr == 1


def test_another_runs_checkpoint_is_refused_by_name_before_the_restore(tmp_path, capsys):
  """``--preset base --out <a smoke run>``: the documented refusal, not orbax's 82 KB dump of
  the two trees, and the smoke run's files untouched."""
  fake_checkpoint(str(tmp_path), "smoke")
  before = tree_listing(str(tmp_path))
  with pytest.raises(SystemExit) as refused:
    cli.main(["--preset", "base", "--out", str(tmp_path), "--no-progress"])
  message = str(refused.value.code)
  assert "the checkpoint's run differs in" in message and "'model'" in message
  assert "use another --out" in message and len(message) < 200
  assert tree_listing(str(tmp_path)) == before
  assert np.array_equal(checkpoint.load(str(tmp_path / "checkpoints"))[0]["params"]["w"],
                        np.zeros(3))  # fmt: skip


def cli_run(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
  cmd = [sys.executable, "-m", "optax_lamb_recipes.pretrain", "--no-progress", *args]
  return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # subprocesses (a few seconds each: importing jax): CI runs them
@pytest.mark.parametrize("setting", ["phase1.lr=-0.1", "phase1.batch=abc", "phases=0",
                                     "log_every=0"])  # fmt: skip
def test_the_command_refuses_a_bad_setting(tmp_path, setting):
  out = tmp_path / "run"
  done = cli_run("--set", setting, "--out", str(out))
  assert done.returncode == 2, done.stdout + done.stderr
  lines = done.stderr.strip().splitlines()
  name, value = setting.split("=")
  assert len(lines) == 1 and f"error: {name}=" in lines[0] and value in lines[0], lines
  assert not out.exists()


@pytest.mark.slow  # a subprocess: CI runs it
def test_the_command_refuses_another_runs_checkpoint(tmp_path):
  fake_checkpoint(str(tmp_path), "smoke")
  before = tree_listing(str(tmp_path))
  done = cli_run("--preset", "base", "--out", str(tmp_path))
  assert done.returncode == 1, done.stdout + done.stderr
  assert "the checkpoint's run differs in" in done.stderr and "use another --out" in done.stderr
  assert len(done.stderr) < 2000  # the refusal, not orbax's structure dump
  assert tree_listing(str(tmp_path)) == before


def test_data_that_cannot_serve_the_run_is_refused_before_anything_is_written(tmp_path, capsys):
  out = tmp_path / "run"
  missing = ["--data", str(tmp_path / "nowhere"), "--out", str(out), "--no-progress"]
  assert cli.main(missing) == 2
  assert "no prepared data" in capsys.readouterr().err and not out.exists()
  prepare.prepare(str(tmp_path / "d"), None, seq_lens=(32,), held_out_every=0)
  short = ["--data", str(tmp_path / "d"), "--out", str(out), "--no-progress"]  # no length 128
  assert cli.main(short) == 2
  assert "--seq-len 128" in capsys.readouterr().err and not out.exists()
  both = [*short, "--corpus", str(tmp_path / "d" / "index.json"), "--set", "phases=1"]
  assert cli.main(both) == 2
  assert "drop --corpus" in capsys.readouterr().err and not out.exists()
