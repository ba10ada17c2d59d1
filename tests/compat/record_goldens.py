"""Records the real libraries' LAMB trajectories on the problem into tests/compat/goldens/.

For every case of cases.RECORDED's libraries it runs problem.STEPS steps and writes, per
library, <library>.npz (float32 params after step 1 and at the end, keys
'<case>/<step1|final>/<path>') and <library>.json (the library's version, the cases' kwargs as
recorded, the environment). The tests read these files; nothing here runs in the test suite,
and CI does not run this script: torch, timm, torch_optimizer and keras take about 2 minutes to
install, TF Addons needs an environment of its own, and CI's 15 minutes are mostly taken by the
suite. test_references.py checks instead that the goldens were recorded from the current
cases.py; re-record (and commit the goldens) when cases.py or a pinned version changes.

  timm, torch_optimizer, keras:  pip install -e ".[compat-record]"   (torch's CPU wheel)
                                 python tests/compat/record_goldens.py
  tfa:  TF Addons needs TensorFlow < 2.16 with Keras 2 and NumPy < 2, which cannot share an
        environment with this project's jax: in a separate venv,
        pip install -r tests/compat/requirements-tfa.txt
        python tests/compat/record_goldens.py --library tfa

timm is loaded without its package (whose __init__ imports torchvision and the model zoo):
timm/optim/lamb.py and its two helpers (_helpers.py, _types.py) are imported by file path.
Keras runs on the jax backend.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases  # noqa: E402
import problem  # noqa: E402

GOLDENS = Path(__file__).resolve().parent / "goldens"
_TORCH_DEFAULT_LR = 1e-3  # every torch library's default lr


def _trajectory(make_step, read_params) -> dict[str, dict[str, np.ndarray]]:
  """Runs make_step(t, grads) for every step; snapshots read_params() after step 1 and at the end."""
  snapshots = {}
  for t, grads in enumerate(problem.gradients()):
    make_step(t, grads)
    if t == 0:
      snapshots["step1"] = read_params()
  snapshots["final"] = read_params()
  return snapshots


# --- torch libraries --------------------------------------------------------------------------


def _load_timm_lamb():
  """timm.optim.lamb.Lamb, imported by file path with only torch (no timm/__init__)."""
  spec = importlib.util.find_spec("timm")  # locates the package without importing it
  if spec is None:
    raise ImportError("timm is not installed: pip install -e '.[compat-record]'")
  optim_dir = Path(spec.submodule_search_locations[0]) / "optim"
  package = types.ModuleType("_timm_optim")
  package.__path__ = [str(optim_dir)]
  sys.modules["_timm_optim"] = package
  for name in ("_types", "_helpers", "lamb"):
    file_spec = importlib.util.spec_from_file_location(
      f"_timm_optim.{name}", optim_dir / f"{name}.py"
    )
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[file_spec.name] = module
    file_spec.loader.exec_module(module)
  return sys.modules["_timm_optim.lamb"].Lamb


def _torch_optimizer_class(library: str):
  if library == "timm":
    return _load_timm_lamb()
  import torch_optimizer

  return torch_optimizer.Lamb


def _record_torch(library: str, case: str, kwargs: dict):
  import torch

  optimizer_class = _torch_optimizer_class(library)
  tensors = {n: torch.nn.Parameter(torch.tensor(v)) for n, v in problem.initial_params().items()}
  groups = [{**g, "params": list(g["params"].values())} for g in cases.torch_param_groups(tensors)]
  opt = optimizer_class(groups, **kwargs)
  base_lr = kwargs.get("lr", _TORCH_DEFAULT_LR)

  def make_step(t, grads):
    for name, p in tensors.items():
      p.grad = torch.tensor(grads[name])
    for group in opt.param_groups:
      group["lr"] = cases.scheduled_lr(library, case, base_lr, t)
    opt.step()

  return _trajectory(make_step, lambda: {n: p.detach().numpy().copy() for n, p in tensors.items()})


# --- Keras 3 (jax backend) --------------------------------------------------------------------


def _import_keras():
  os.environ["KERAS_BACKEND"] = "jax"
  import keras

  return keras


def _record_keras(case: str, kwargs: dict):
  keras = _import_keras()

  kwargs = dict(kwargs)
  if case in cases.SCHEDULED["keras"]:
    kwargs["learning_rate"] = _keras_schedule(keras, kwargs.get("learning_rate", 0.001))
  variables = {
    n: keras.Variable(v, name=n.rsplit("/", 1)[-1]) for n, v in problem.initial_params().items()
  }
  opt = keras.optimizers.Lamb(**kwargs)
  opt.exclude_from_weight_decay(var_names=list(problem.NOT_DECAYED_KERAS_NAMES))

  def make_step(t, grads):
    opt.apply([grads[n] for n in variables], list(variables.values()))

  return _trajectory(make_step, lambda: {n: np.array(v.value) for n, v in variables.items()})


def _keras_schedule(keras, base_lr: float):
  factors = np.array([problem.lr_factor(t) for t in range(problem.STEPS)], np.float32)

  class Warmup(keras.optimizers.schedules.LearningRateSchedule):
    def __call__(self, step):
      return base_lr * keras.ops.take(keras.ops.convert_to_tensor(factors), step)

  return Warmup()


# --- TF Addons ----------------------------------------------------------------------------------


def _record_tfa(case: str, kwargs: dict):
  import tensorflow as tf
  import tensorflow_addons as tfa

  variables = {n: tf.Variable(v, name=n) for n, v in problem.initial_params().items()}
  opt = tfa.optimizers.LAMB(**kwargs)

  def make_step(t, grads):
    opt.apply_gradients([(tf.constant(grads[n]), v) for n, v in variables.items()])

  return _trajectory(make_step, lambda: {n: v.numpy().copy() for n, v in variables.items()})


# --- driver -------------------------------------------------------------------------------------


def _refusals(library: str) -> dict[str, str]:
  """The exception class each of cases.REFUSED[library] raises (or 'accepted')."""
  if library in ("timm", "torch_optimizer"):
    import torch

    make = lambda **kw: _torch_optimizer_class(library)([torch.nn.Parameter(torch.zeros(2))], **kw)
  elif library == "keras":
    make = _import_keras().optimizers.Lamb
  else:
    import tensorflow_addons as tfa

    make = tfa.optimizers.LAMB
  found = {}
  for name, kwargs in cases.REFUSED[library].items():
    try:
      make(**kwargs)
      found[name] = "accepted"
    except Exception as error:  # noqa: BLE001 (recording which class each refusal raises)
      found[name] = type(error).__name__
  return found


def _versions(library: str) -> dict[str, str]:
  from importlib.metadata import version

  packages = {
    "timm": ["timm", "torch"],
    "torch_optimizer": ["torch-optimizer", "torch"],
    "keras": ["keras", "jax", "jaxlib"],
    "tfa": ["tensorflow-addons", "tensorflow-cpu", "keras"],
  }[library]
  found = {}
  for package in packages:
    try:
      found[package] = version(package)
    except Exception:  # noqa: BLE001 (e.g. tensorflow instead of tensorflow-cpu)
      found[package] = "not installed"
  return {**found, "numpy": np.__version__, "python": platform.python_version()}


def record(library: str) -> dict[str, float]:
  """Records every case of `library`; returns the seconds each case took."""
  arrays, timings = {}, {}
  for case, kwargs in cases.CASES[library].items():
    start = time.perf_counter()
    if library in ("timm", "torch_optimizer"):
      snapshots = _record_torch(library, case, kwargs)
    elif library == "keras":
      snapshots = _record_keras(case, kwargs)
    else:
      snapshots = _record_tfa(case, kwargs)
    timings[case] = time.perf_counter() - start
    for when, params in snapshots.items():
      for name, value in params.items():
        arrays[f"{case}/{when}/{name}"] = np.asarray(value, np.float32)
  GOLDENS.mkdir(exist_ok=True)
  np.savez_compressed(GOLDENS / f"{library}.npz", **arrays)
  meta = {
    "library": library,
    "versions": _versions(library),
    "steps": problem.STEPS,
    "cases": cases.CASES[library],
    "scheduled": sorted(cases.SCHEDULED.get(library, ())),
    "refused": _refusals(library),
  }
  (GOLDENS / f"{library}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
  return timings


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--library",
    action="append",
    choices=cases.RECORDED,
    help="record only this library (repeatable); default: all but tfa",
  )
  args = parser.parse_args(argv)
  libraries = args.library or [lib for lib in cases.RECORDED if lib != "tfa"]
  for library in libraries:
    start = time.perf_counter()
    timings = record(library)
    total = time.perf_counter() - start
    print(f"{library}: {len(timings)} cases in {total:.1f} s -> {GOLDENS / library}.npz")


if __name__ == "__main__":
  main()
