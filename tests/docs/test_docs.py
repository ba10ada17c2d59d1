"""The documentation's promises: every public symbol has an API entry, every example runs.

Every public symbol (``optax_lamb.__all__``, ``optax_lamb.compat.__all__``, the
backend classes) has a docstring example with printed output, and the examples
run as doctests. The Python blocks of the README and of each docs page run in
order in one namespace per page (as a reader would paste them), after a small
preamble defining the names the snippets assume (params, a loss, a batch, a
mesh); a block that defines ``train_step`` is then called. A block that says
what it prints (``# prints: ...`` comments: the README's Quickstart) also runs
alone, without the preamble, and must print exactly that. The README's and the
pages' rendered blocks equal a fresh ``python -m docs._render``; every ratio to
the bandwidth floor that a page states is the committed results' own. The README
stays at most 120 lines. The site itself is built (with warnings as errors) by
``.ci/run``.
"""

import contextlib
import doctest
import glob
import importlib.util
import inspect
import io
import os
import re

import jax
import pytest

import optax_lamb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))]
PREAMBLE = """
import jax, jax.numpy as jnp, numpy as np, optax, optax_lamb
from jax.sharding import NamedSharding, PartitionSpec as P

params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
batch = jnp.ones((8, 4))


def loss_fn(params, batch):
  return jnp.mean((batch @ params["w"] + params["b"]) ** 2)


mesh = jax.make_mesh((jax.device_count(),), ("data",))
param_shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
"""


def public_modules():
  modules = [optax_lamb]
  try:
    from optax_lamb import compat
  except ImportError:  # before the compat module exists
    return modules
  return [*modules, compat]


def test_every_public_symbol_has_an_api_entry():
  with open(os.path.join(ROOT, "docs", "api.md")) as f:
    documented = set(re.findall(r"\.\. auto(?:function|class):: ([\w.]+)", f.read()))
  missing = [
    f"{module.__name__}.{name}"
    for module in public_modules()
    for name in module.__all__
    if not inspect.ismodule(getattr(module, name))  # a module's symbols have their own entries
    and f"{module.__name__}.{name}" not in documented
  ]
  assert not missing, f"no API entry in docs/api.md for {missing}"


def public_symbols():
  """(qualified name, object): every name in the public modules' ``__all__``, and the backend
  classes that ``implementation=`` takes (docs/api.md's Backends section)."""
  from optax_lamb.backends import pallas_mosaic_gpu, pallas_triton, xla

  symbols = [
    (f"{module.__name__}.{name}", getattr(module, name))
    for module in public_modules()
    for name in module.__all__
    if not inspect.ismodule(getattr(module, name))
  ]
  backends = [
    xla.XlaBackend,
    pallas_triton.PallasTritonBackend,
    pallas_triton.BlockSizes,
    pallas_mosaic_gpu.PallasMosaicGpuBackend,
    pallas_mosaic_gpu.MosaicBlockSizes,
  ]
  return symbols + [(f"{b.__module__}.{b.__qualname__}", b) for b in backends]


def docstring_examples():
  """The doctests of every public symbol (only its own docstring: not the members that a
  NamedTuple or dataclass inherits) and of the public modules' docstrings."""
  finder = doctest.DocTestFinder(recurse=False)
  seen, tests = set(), []
  objects = [*public_symbols(), *((m.__name__, m) for m in public_modules())]
  for name, obj in objects:
    for test in finder.find(obj, name):
      if test.examples and id(obj) not in seen:
        tests.append(test)
    seen.add(id(obj))
  return tests


@pytest.mark.parametrize(
  "name,obj", public_symbols(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_every_public_symbol_has_an_example_that_prints(name, obj):
  """As optax's: an ``Example:`` section whose output the doctests check."""
  (test,) = doctest.DocTestFinder(recurse=False).find(obj, name)
  assert any(example.want for example in test.examples), f"{name}: no example with printed output"


@pytest.mark.parametrize("test", docstring_examples(), ids=lambda t: t.name)
def test_docstring_examples_run(test):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  runner.run(test)
  assert runner.failures == 0, f"{test.name}: {runner.failures} failing example(s)"


def python_blocks(page):
  with open(os.path.join(ROOT, page)) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)])
def test_python_blocks_of_a_page_run_in_order(page):
  namespace = {}
  exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
  for i, block in enumerate(python_blocks(page)):
    exec(compile(block, f"{page} block {i + 1}", "exec"), namespace)
    step = namespace.pop("train_step", None)
    if step is not None:  # call it as the page would, with the names it takes
      if "opt_state" not in namespace:
        namespace["opt_state"] = namespace["tx"].init(namespace["params"])
      if "loss_scale" in inspect.signature(step).parameters and "loss_scale" not in namespace:
        raise AssertionError(f"{page} block {i + 1}: train_step needs a loss_scale")
      args = [namespace[name] for name in inspect.signature(step).parameters]
      out = step(*args)
      assert all(bool(jax.numpy.isfinite(x).all()) for x in jax.tree.leaves(out))


def printing_blocks():
  """(page, block number, block) for every Python block whose comments say what it prints."""
  return [
    (page, i + 1, block)
    for page in PAGES
    for i, block in enumerate(python_blocks(page))
    if "# prints: " in block
  ]


@pytest.mark.parametrize(
  "page,number,block", printing_blocks(), ids=lambda x: x if isinstance(x, str) else None
)
def test_a_block_that_says_what_it_prints_runs_alone_and_prints_it(page, number, block):
  """Such a block (the README's Quickstart) runs as written: no preamble, its own names only,
  and its output is the text after each ``# prints: `` comment, in order."""
  expected = [
    line.split("# prints: ", 1)[1].rstrip() for line in block.splitlines() if "# prints: " in line
  ]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(block, f"{page} block {number}", "exec"), {"__name__": "__main__"})
  assert out.getvalue().splitlines() == expected, f"{page} block {number}"


def _render_module():
  spec = importlib.util.spec_from_file_location("_render", os.path.join(ROOT, "docs", "_render.py"))
  render = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(render)
  return render


@pytest.mark.slow  # 30 s: every rendered block from the committed results; CI runs it
def test_readme_and_recipe_numbers_are_rendered_from_the_committed_results():
  for name, text in _render_module().rendered(ROOT).items():
    with open(os.path.join(ROOT, name)) as f:
      assert f.read() == text, f"{name}: run python -m docs._render"


def test_benchmark_figures_are_rendered_from_the_committed_results():
  """The README's, memory's, benchmarks' and KERNELS' figures (the fast part of the test above)."""
  render = _render_module()
  for name, text in render.rendered(ROOT, render.benchmark_blocks(ROOT)).items():
    with open(os.path.join(ROOT, name)) as f:
      assert f.read() == text, f"{name}: run python -m docs._render"


def test_readme_is_at_most_120_lines():
  with open(os.path.join(ROOT, "README.md")) as f:
    lines = f.read().splitlines()
  assert len(lines) <= 120, f"README.md: {len(lines)} lines"


def _step_reports():
  """The committed step benchmark files (benchmarks/results/*.json with per-tree "cases"; the
  compile-time file, benchmarks.compile_time's, has none)."""
  import json

  reports = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))):
    with open(path) as f:
      report = json.load(f)
    if "cases" in report:
      reports[os.path.basename(path)] = report
  assert len(reports) >= 4, sorted(reports)  # the CPU file and the three GPU files
  return reports


def test_every_stated_floor_ratio_is_the_committed_results_own():
  """One bandwidth floor: the B/param the results files record (`floor_bytes_per_param`, a single
  pass over float32 p, g, m, v). A page that names a floor names that one, and each ratio to it
  ("1.39x the floor") is bytes moved / floor of a committed result, to the digits stated."""
  reports = _step_reports()
  floors = {r["floor_bytes_per_param"] for r in reports.values() if "floor_bytes_per_param" in r}
  assert len(floors) == 1, f"the results files disagree on the floor: {floors}"
  (floor,) = floors
  measured = [
    r["bytes_per_param"] / floor
    for report in reports.values()
    for case in report["cases"].values()
    for r in case["results"].values()
    if "bytes_per_param" in r
  ]
  stated = 0
  for page in [*PAGES, "CHANGELOG.md"]:
    with open(os.path.join(ROOT, page)) as f:
      text = " ".join(f.read().split())  # a sentence may wrap
    for named in re.findall(r"(\d+) B/param (?:single-pass |one-pass )?floor", text):
      assert int(named) == floor, f"{page}: a {named} B/param floor (the results': {floor})"
    for ratio in re.findall(r"(\d+\.\d+)x the (?:\d+ B/param )?(?:single-pass )?floor", text):
      digits = len(ratio.split(".")[1])
      assert any(f"{m:.{digits}f}" == ratio for m in measured), f"{page}: {ratio}x the floor"
      stated += 1
  assert stated, "no page states a ratio to the floor"


def _inventory_names():
  """The names the committed optax and jax inventories hold (docs/_inventories)."""
  from sphinx.util.inventory import InventoryFile

  names = set()
  for path in glob.glob(os.path.join(ROOT, "docs", "_inventories", "*.inv")):
    with open(path, "rb") as f:
      inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    names |= {name for items in dict(inventory).values() for name in items}
  return names


def test_the_committed_inventories_are_what_their_script_writes(tmp_path):
  spec = importlib.util.spec_from_file_location(
    "make_inventories", os.path.join(ROOT, "docs", "_inventories", "make_inventories.py")
  )
  maker = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(maker)
  for project in maker.INVENTORIES:
    maker.write(project, tmp_path / f"{project}.inv")
    with open(os.path.join(ROOT, "docs", "_inventories", f"{project}.inv"), "rb") as f:
      assert (tmp_path / f"{project}.inv").read_bytes() == f.read(), f"rerun {spec.origin}"


def test_every_optax_and_jax_role_links():
  """A MyST role naming an optax or jax object (``{py:func}`optax.apply_updates```) is in the
  committed inventories: the build ignores a missing one (nitpick_ignore), and it would render
  as plain text."""
  known = _inventory_names()
  missing = []
  for page in PAGES:
    with open(os.path.join(ROOT, page)) as f:
      text = f.read()
    for target in re.findall(
      r"\{(?:py:)?(?:func|obj|class|meth|mod)\}`~?((?:optax|jax)\.[\w.]+)`", text
    ):
      if target not in known:
        missing.append(f"{page}: {target}")
  assert not missing, f"not in docs/_inventories (add them to make_inventories.py): {missing}"
