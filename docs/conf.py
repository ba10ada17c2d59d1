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
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_generated/benchmark_tables.md"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebooks are committed executed; CI checks that separately

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Shown by name, not expanded into its union of array types.
autodoc_type_aliases = {"optax.ScalarOrSchedule": "optax.ScalarOrSchedule"}
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = f"optax-lamb {release}"
html_theme_options = {"show_toc_level": 2, "use_download_button": False}


def _generate(app):
  """Copy the notebooks and render the benchmark tables into _generated/ before reading."""
  out = os.path.join(app.srcdir, "_generated")
  shutil.rmtree(out, ignore_errors=True)
  os.makedirs(os.path.join(out, "notebooks", "results"))
  for name in ("quickstart.ipynb", "bert_large_batch.ipynb"):
    shutil.copy(os.path.join(ROOT, "notebooks", name), os.path.join(out, "notebooks", name))
  for name in os.listdir(os.path.join(ROOT, "notebooks", "results")):
    if name.endswith(".png"):
      shutil.copy(
        os.path.join(ROOT, "notebooks", "results", name), os.path.join(out, "notebooks", "results")
      )
  with open(os.path.join(out, "benchmark_tables.md"), "w") as f:
    f.write(_render.benchmark_tables(os.path.join(ROOT, "benchmarks", "results")))


def setup(app):
  app.connect("builder-inited", _generate)


# Broken cross-references fail the build (with -W); references to other packages are not
# checked (no intersphinx: the build runs offline), those to optax_lamb are.
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(optax|jax|jaxlib|numpy|collections|typing|flax|chex)(\..*)?"),
]
