"""The package's import graph (tests/tools/import_graph.py): no cycle, short chains, layers.

Module-level imports only. The subpackages are layers: a module imports only from its own
subpackage or from one listed after its own in `LAYERS` (docs/architecture.md draws them).
"""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
  "import_graph", Path(__file__).resolve().parents[1] / "tools" / "import_graph.py"
)
import_graph = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(import_graph)

MAX_LEVELS = 10  # imports in the longest chain (its modules less one): the 'levels'
MAX_TOP_LEVEL = 12  # .py files directly in optax_lamb/

# Top to bottom; modules of one row import nothing from each other's subpackages.
LAYERS = [
  {"optax_lamb"},  # the package's __init__: the public names
  {"compat", "backends"},
  {"step"},
  {"stages", "memory"},
  {"faults"},
  {"core"},
  {"_interop", "_nnx"},  # at the top of the folder, imported by every layer, importing none
]


def _layer(module: str) -> int:
  part = module.split(".")[1] if "." in module else module
  return next(i for i, names in enumerate(LAYERS) if part in names)


GRAPH = import_graph.import_graph()


def test_the_graph_reads_the_package():
  assert len(GRAPH) > 40 and "optax_lamb.step._transform" in GRAPH["optax_lamb.step._lamb"]


def test_no_import_cycle():
  assert import_graph.cycles(GRAPH) == []


def test_import_chains_are_short():
  chain = import_graph.longest_chain(GRAPH)
  assert len(chain) - 1 <= MAX_LEVELS, " -> ".join(chain)


def test_few_modules_at_the_top():
  top = import_graph.top_level_modules()
  assert len(top) <= MAX_TOP_LEVEL, top


def test_imports_flow_down_the_layers():
  subpackage = lambda module: module.split(".")[:2]
  upward = [
    (a, b)
    for a, targets in GRAPH.items()
    for b in targets
    if subpackage(a) != subpackage(b) and _layer(a) >= _layer(b)
  ]
  assert not upward, upward


def test_the_checks_find_what_they_look_for():
  """The tool's own answers on small graphs: a cycle, and the longest chain of a DAG."""
  cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert import_graph.cycles(cyclic) == [["a", "b", "c"]]
  dag = {"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set()}
  assert import_graph.cycles(dag) == []
  assert import_graph.longest_chain(dag) == ["a", "b", "c"]
