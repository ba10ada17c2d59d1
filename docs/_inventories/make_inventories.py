"""Write the intersphinx inventories of optax and jax that the docs build reads offline.

    python docs/_inventories/make_inventories.py   # from the repository root

The build runs without a network, so conf.py's `intersphinx_mapping` points at these committed
files instead of the projects' own objects.inv. Each holds only the names these pages mention,
with the page of the project's documentation that documents it; Sphinx's own inventory writer
(`InventoryFile.dump`) writes them, and `tests/docs` reads them back. Add a name here when a page
links a new one, and rerun.
"""

from __future__ import annotations

import os
import types

from sphinx.util.inventory import InventoryFile

HERE = os.path.dirname(os.path.abspath(__file__))

# project -> (base URL, version, {page: [(name, role)]}); pages relative to the base URL.
INVENTORIES = {
  "optax": (
    "https://optax.readthedocs.io/en/latest/",
    "latest",
    {
      "api/optimizers.html": [("optax.lamb", "function"), ("optax.adamw", "function"),
                              ("optax.adam", "function")],
      "api/transformations.html": [
        ("optax.scale_by_adam", "function"), ("optax.add_decayed_weights", "function"),
        ("optax.scale_by_trust_ratio", "function"), ("optax.clip_by_global_norm", "function"),
        ("optax.GradientTransformation", "class"),
        ("optax.ScaleByAdamState", "class"), ("optax.ScaleByTrustRatioState", "class"),
      ],
      "api/apply_updates.html": [("optax.apply_updates", "function")],
      "api/combining_optimizers.html": [
        ("optax.chain", "function"), ("optax.multi_transform", "function"),
        ("optax.partition", "function"),
      ],
      "api/optimizer_wrappers.html": [
        ("optax.apply_if_finite", "function"), ("optax.ApplyIfFiniteState", "class"),
        ("optax.MultiSteps", "class"), ("optax.masked", "function"),
      ],
      "api/optimizer_schedules.html": [
        ("optax.inject_hyperparams", "function"),
        ("optax.warmup_cosine_decay_schedule", "function"),
      ],
    },
  ),
  "jax": (
    "https://docs.jax.dev/en/latest/",
    "latest",
    {
      f"_autosummary/{name}.html": [(name, "function")]
      for name in (
        "jax.jit", "jax.grad", "jax.value_and_grad", "jax.vmap", "jax.pmap", "jax.shard_map",
        "jax.eval_shape", "jax.jvp", "jax.vjp", "jax.make_mesh", "jax.set_mesh", "jax.device_put", "jax.lax.psum",
        "jax.lax.pmean", "jax.lax.psum_scatter", "jax.lax.cond", "jax.tree.map",
      )
    }
    | {
      "_autosummary/jax.custom_jvp.html": [("jax.custom_jvp", "class")],
      "jax.sharding.html": [
        ("jax.sharding.NamedSharding", "class"), ("jax.sharding.PartitionSpec", "class"),
      ],
    },
  ),
}  # fmt: skip


class _Domain:
  """What `InventoryFile.dump` reads of a Sphinx domain: its name and its objects."""

  name = "py"

  def __init__(self, pages: dict[str, list[tuple[str, str]]]) -> None:
    self.pages = pages

  def get_objects(self):
    for page, names in self.pages.items():
      for name, role in names:
        yield name, name, role, page, name, 1  # anchor = the name, as autodoc writes it


def write(project: str, path: str) -> None:
  """The inventory of `project` at `path`, in Sphinx's format (version 2, zlib-compressed)."""
  _, version, pages = INVENTORIES[project]
  config = types.SimpleNamespace(project=project, version=version)
  domains = types.SimpleNamespace(sorted=lambda: [_Domain(pages)])
  env = types.SimpleNamespace(config=config, domains=domains)
  builder = types.SimpleNamespace(get_target_uri=lambda page: page)
  InventoryFile.dump(path, env, builder)


if __name__ == "__main__":
  for project in INVENTORIES:
    write(project, os.path.join(HERE, f"{project}.inv"))
