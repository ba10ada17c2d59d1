"""The package's import graph: module-level imports between optax_lamb's modules, read with ast.

An edge A -> B means module A imports module B when A is imported: a statement at
module level (inside an ``if``/``try`` there too, not inside a function; an
``if TYPE_CHECKING:`` block does not count). ``from pkg import name`` is an edge
to ``pkg.name`` where that is a module, else to ``pkg``. Importing a module also
runs its packages' ``__init__``; those implicit edges are not drawn (the
package's ``__init__`` is an ordinary node with its own imports).

Prints the modules, the edges, the cycles (strongly connected components of more
than one module) and the longest import chain, counted in modules. From the
repository root:

    python tests/tools/import_graph.py            # optax_lamb/
    python tests/tools/import_graph.py --edges    # and every edge
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = "optax_lamb"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_names(root: Path = ROOT) -> dict[str, Path]:
  """Dotted module name -> file, for every .py file under the package."""
  names = {}
  for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    names[".".join(parts)] = path
  return names


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
  """Import statements run when the module is imported (not in functions or classes)."""
  found: list[ast.Import | ast.ImportFrom] = []
  pending: list[ast.stmt] = list(tree.body)
  while pending:
    node = pending.pop()
    if isinstance(node, ast.Import | ast.ImportFrom):
      found.append(node)
    elif isinstance(node, ast.If):
      pending.extend(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
    elif isinstance(node, ast.Try):
      pending.extend(node.body + node.orelse + node.finalbody)
      for handler in node.handlers:
        pending.extend(handler.body)
    elif isinstance(node, ast.With):
      pending.extend(node.body)
  return found


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
  """The absolute module a (possibly relative) ``from X import`` names."""
  if not node.level:
    return node.module or ""
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  base = package[: len(package) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
  """Module -> the package's modules it imports at module level."""
  modules = module_names(root)
  graph: dict[str, set[str]] = {name: set() for name in modules}
  for name, path in modules.items():
    for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      else:
        source = _resolve(name, path, node)
        targets = [
          f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
          for alias in node.names
        ]
      graph[name] |= {t for t in targets if t in modules and t != name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(found)


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
  """The longest import chain (modules, importer first) that enters no module twice: every
  simple path walked (milliseconds at the package's size)."""
  best: list[str] = []

  def walk(path: list[str], seen: set[str]) -> None:
    nonlocal best
    if len(path) > len(best):
      best = list(path)
    for w in sorted(graph[path[-1]] - seen):
      walk([*path, w], seen | {w})

  for v in sorted(graph):
    walk([v], {v})
  return best


def top_level_modules(root: Path = ROOT) -> list[str]:
  """The .py files directly in the package's folder."""
  return sorted(p.name for p in root.glob("*.py"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--edges", action="store_true", help="print every edge")
  args = parser.parse_args()
  graph = import_graph()
  edges = sorted((a, b) for a, targets in graph.items() for b in targets)
  print(f"modules: {len(graph)} ({len(top_level_modules())} at the top of {PACKAGE}/)")
  print(f"import edges: {len(edges)}")
  found = cycles(graph)
  print(f"cycles: {len(found)}")
  for component in found:
    print("  " + " <-> ".join(component))
  chain = longest_chain(graph)
  print(f"longest chain: {len(chain)} modules")
  print("  " + " -> ".join(chain))
  if args.edges:
    for a, b in edges:
      print(f"{a} -> {b}")


if __name__ == "__main__":
  main()
