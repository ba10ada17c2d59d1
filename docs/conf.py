"""Sphinx configuration of the optax-lamb documentation (build: see the README's Documentation section).

Pages are Markdown (MyST); the API reference comes from the docstrings (autodoc,
Google style via napoleon); the notebooks are rendered from their committed
outputs (never re-executed here); the benchmark tables are rendered from the
committed result JSON. Both are generated into ``_generated/`` at build time.
"""

import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax_lamb  # noqa: E402
from docs import _render  # noqa: E402

project = "optax-lamb"
author = "the optax-lamb authors"
copyright = "2026, the optax-lamb authors"
release = version = optax_lamb.__version__

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx.ext.intersphinx",
  "sphinx.ext.viewcode",  # [source] links beside the API entries
  # MathJax from a Python package, copied into _static: formulas render without a network.
  "sphinx-mathjax-offline",
]
# \text{max\_grad\_norm} in the docstrings' formulas: MathJax processes macros in text mode only
# with its textmacros package (bundled by sphinx-mathjax-offline).
mathjax3_config = {
  "loader": {"load": ["[tex]/textmacros"]},
  "tex": {"packages": {"[+]": ["textmacros"]}},
}
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_generated/benchmark_tables.md", "_generated/api_summary.md"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebooks are committed executed; CI checks that separately
nb_render_markdown_format = "gfm"  # Markdown outputs (the reports' tables) with tables

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Types only beside documented arguments: a state type's fields are its Attributes, not a second
# "Parameters" list made from its constructor.
autodoc_typehints_description_target = "documented"
# Defaults as written in the source (`dtype=jnp.float32`, not `<class 'jax.numpy.float32'>`).
autodoc_preserve_defaults = True
# Shown by name, not expanded into its union of array types.
autodoc_type_aliases = {"optax.ScalarOrSchedule": "optax.ScalarOrSchedule"}
autodoc_default_options: dict = {}  # no :show-inheritance: ("Bases: object")
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The state types' and backends' fields are described in their docstrings' Attributes; their
# annotations would print private module paths (`...pallas_triton.common.BlockSizes`).
napoleon_attr_annotations = False

html_theme = "sphinx_book_theme"
html_title = f"optax-lamb {release}"
html_theme_options = {"show_toc_level": 2, "use_download_button": False}
html_static_path = ["_static"]
html_css_files = ["custom.css"]


def _generate(app):
  """Copy the notebooks and render the benchmark tables into _generated/ before reading."""
  out = os.path.join(app.srcdir, "_generated")
  shutil.rmtree(out, ignore_errors=True)
  os.makedirs(os.path.join(out, "notebooks", "results"))
  for name in ("quickstart.ipynb", "bert_large_batch.ipynb"):
    _copy_notebook(os.path.join(ROOT, "notebooks", name), os.path.join(out, "notebooks", name))
  for name in os.listdir(os.path.join(ROOT, "notebooks", "results")):
    if name.endswith(".png"):
      shutil.copy(
        os.path.join(ROOT, "notebooks", "results", name), os.path.join(out, "notebooks", "results")
      )
  _notebook_figures(
    os.path.join(ROOT, "notebooks", "bert_large_batch.ipynb"), os.path.join(out, "recipe")
  )
  with open(os.path.join(out, "benchmark_tables.md"), "w") as f:
    f.write(_render.benchmark_tables(os.path.join(ROOT, "benchmarks", "results")))
  with open(os.path.join(out, "api_summary.md"), "w") as f:
    f.write(_render.api_summary(os.path.join(app.srcdir, "api.md")))


def _copy_notebook(source: str, target: str) -> None:
  """Copy a notebook, its printed Markdown tables (a stdout output with a ``|---`` row, as
  `optax_lamb_recipes`' reports print them) turned into Markdown outputs, so that the site shows
  tables rather than pipe text. The committed notebook is not changed."""
  import json

  with open(source) as f:
    notebook = json.load(f)
  for cell in notebook["cells"]:
    for i, output in enumerate(cell.get("outputs", [])):
      text = "".join(output.get("text", ""))
      if (
        output.get("output_type") == "stream" and output.get("name") == "stdout" and "|---" in text
      ):
        cell["outputs"][i] = {
          "output_type": "display_data",
          "data": {"text/markdown": text},
          "metadata": {},
        }
  with open(target, "w") as f:
    json.dump(notebook, f)


def _notebook_figures(notebook: str, out: str) -> None:
  """Write the figures of a notebook's committed outputs as PNG files, each named after the
  heading above it (``## Tuning: which ...`` -> ``tuning-which-....png``), for docs/recipe.md:
  the page shows the notebook's own figures, never a copy that could fall behind it."""
  import base64
  import json
  import re

  os.makedirs(out, exist_ok=True)
  with open(notebook) as f:
    cells = json.load(f)["cells"]
  heading = "figure"
  for cell in cells:
    source = "".join(cell["source"])
    if cell["cell_type"] == "markdown" and source.startswith("#"):
      heading = re.sub(r"[^a-z0-9]+", "-", source.split("\n")[0].lstrip("#").lower()).strip("-")
    for output in cell.get("outputs", []):
      if "image/png" in output.get("data", {}):
        with open(os.path.join(out, f"{heading}.png"), "wb") as f:
          f.write(base64.b64decode(output["data"]["image/png"]))


def _no_bases(app, name, obj, options, bases):
  """No "Bases: NamedTuple" / "Bases: object" line: the entries say what a class is."""
  bases.clear()


def setup(app):
  app.connect("builder-inited", _generate)
  app.connect("autodoc-process-bases", _no_bases)


# optax and jax names link to their documentation through committed inventories (the build runs
# offline): docs/_inventories/make_inventories.py writes them with the names these pages mention.
intersphinx_mapping = {
  "optax": ("https://optax.readthedocs.io/en/latest/", "_inventories/optax.inv"),
  "jax": ("https://docs.jax.dev/en/latest/", "_inventories/jax.inv"),
}

# Broken cross-references fail the build (with -W); references to other packages that the
# inventories do not hold are not checked, those to optax_lamb are.
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(optax|jax|jaxlib|numpy|collections|typing|flax|chex)(\..*)?"),
  # `implementation`'s type: a name ("auto", "xla", "pallas_triton", ...) or a backend object,
  # both described in lamb's entry; the alias itself is private.
  (r"py:class", r"Implementation"),
  # the per-leaf options' types (optax_lamb.core._config, private): each entry's text says what a
  # mask, stacked axes or axis names may be
  (r"py:class", r"PerLeaf(Mask|Axes|AxisNames)|AxisNames|DTypeLike|TypeAliasForwardRef"),
  (r"py:class", r"'optax\..*'"),  # a quoted annotation, as autodoc leaves some
]
