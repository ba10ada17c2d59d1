"""The package's shape: one update's walk through its modules, module and function sizes.

One ``tx.update`` of lamb on the XLA path crosses at most 9 of the package's
files, top to bottom: a module calls only modules below it in `XLA_PATH`, never
back up (docs/architecture.md draws both paths). The Pallas path keeps the same
rule, with its backend package in place of ``backends/xla/``. The walk is
recorded with ``sys.setprofile`` while the update is traced (its Python runs
once, at trace time).
"""

import ast
import collections
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import optax_lamb
from optax_lamb.backends.xla import XlaBackend

PACKAGE = Path(optax_lamb.__file__).resolve().parent

# Top to bottom: a module may call the ones after it, never one before it.
XLA_PATH = [
  "step/_transform.py",
  "faults/_loss_scale.py",  # the prologue's unscaling (`_loss_scale.divided`, lamb's and the stage's)
  "step/_registry.py",
  "backends/xla/__init__.py",
  "step/_plan.py",
  "faults/_checks.py",
  "backends/xla/_chunked_sums.py",  # 8-bit moments on one CPU device only (`XlaBackend.chunked_sums`)
  "backends/xla/_sums.py",  # passes traced once per leaf shape; the CPU program's ratios
  "core/_ratios.py",
  "core/_leaf.py",
  "core/_moment_storage.py",  # 8-bit moments only (mu_dtype=int8, nu_dtype=uint8)
  "core/_quantize.py",
  "core/_options.py",
  "core/_sharded_views.py",  # arrays whose type shards them (Explicit meshes)
]
PALLAS_BACKEND = [
  "backends/gpu/driver.py",
  "backends/pallas_triton/backend.py",
  "backends/per_device.py",
  "backends/pallas_triton/pass1.py",
  "backends/pallas_triton/slice_sums.py",
  "backends/pallas_triton/pass2.py",
  "backends/pallas_triton/operands.py",
  "backends/pallas_triton/common.py",
  "backends/gpu/passes.py",
  "backends/gpu/tables.py",
  "backends/gpu/arrays.py",
]
PALLAS_PATH = XLA_PATH[:3] + PALLAS_BACKEND + XLA_PATH[4:]


def _walk(implementation: Any, **kwargs) -> tuple[list[str], collections.Counter]:
  """(the package files one traced update enters, the calls between them: caller -> callee)."""
  params = {"w": jnp.ones((16, 300)), "b": jnp.zeros(3), "s": jnp.ones((2, 3, 5))}
  tx = optax_lamb.lamb(
    1e-3, weight_decay=0.01, max_grad_norm=1.0, stacked_axes={"w": 0, "b": 0, "s": 1},
    implementation=implementation, **kwargs,
  )  # fmt: skip
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  jax.jit(tx.update).lower(grads, state, params)  # imports and caches (eval_shape of init)
  if implementation != "pallas_triton":  # the XLA passes are cached traces (`traced_once`)
    jax.clear_caches()  # (the Pallas walk keeps its kernels' traces: interpret mode calls a
    jax.eval_shape(tx.init, params)  # kernel body from common.py, a callback, not a layer)
  files, edges = [], collections.Counter()

  def package_file(frame) -> str | None:
    name = frame.f_code.co_filename
    return os.path.relpath(name, PACKAGE) if name.startswith(str(PACKAGE)) else None

  def profile(frame, event, arg):
    if event != "call" or (callee := package_file(frame)) is None:
      return
    files.append(callee)
    caller = frame.f_back
    while caller is not None and package_file(caller) is None:
      caller = caller.f_back
    if caller is not None and package_file(caller) != callee:
      edges[(package_file(caller), callee)] += 1

  sys.setprofile(profile)
  try:
    jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(grads, state, params)
  finally:
    sys.setprofile(None)
  return sorted(set(files)), edges


@pytest.mark.parametrize("implementation,path", [("xla", XLA_PATH), ("pallas_triton", PALLAS_PATH)])
def test_one_update_walks_down_the_layers(implementation, path):
  files, edges = _walk(implementation)
  assert set(files) <= set(path), sorted(set(files) - set(path))
  if implementation == "xla":
    # 9 since the CPU program's per-leaf ratios got their module (backends/xla/_sums.py:
    # XLA:CPU's compile time, benchmarks/NOTES.md); 8 before
    assert len(files) <= 9, files
  upward = [(a, b) for a, b in edges if path.index(a) >= path.index(b)]
  assert not upward, upward


@pytest.mark.parametrize("chunked", [False, True], ids=["xla", "chunked-sums"])
def test_an_update_with_8bit_moments_walks_down_the_layers(chunked):
  backend = XlaBackend(chunked_sums=1024 if chunked else 0)
  files, edges = _walk(backend, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
  assert {"core/_moment_storage.py", "core/_quantize.py"} <= set(files) <= set(XLA_PATH), files
  assert ("backends/xla/_chunked_sums.py" in files) == chunked, files
  upward = [(a, b) for a, b in edges if XLA_PATH.index(a) >= XLA_PATH.index(b)]
  assert not upward, upward


def _package_modules() -> list[Path]:
  return sorted(PACKAGE.rglob("*.py"))


def test_modules_are_at_most_400_lines():
  """The size guide: 400 formatted lines, a guide rather than a target."""
  long = {
    str(p.relative_to(PACKAGE)): n
    for p in _package_modules()
    if (n := len(p.read_text().splitlines())) > 400
  }
  assert not long, long


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines of a function without its docstring."""
  body = node.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    body = body[1:]
  if not body:
    return 0
  return body[-1].end_lineno - body[0].lineno + 1


def test_functions_are_at_most_60_lines():
  long = {}
  for path in _package_modules():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _body_lines(node) > 60:
        long[f"{path.relative_to(PACKAGE)}:{node.name}"] = _body_lines(node)
  assert not long, long


def test_every_function_has_a_return_annotation():
  missing = []
  for path in _package_modules():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is None:
        missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
  assert not missing, missing
