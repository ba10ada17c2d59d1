"""The trees a benchmark steps on: named leaf shapes, random float32 arrays of them, their buffers."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def bert_shapes(
  hidden: int, layers: int, ffn: int, vocab: int = 30522, positions: int = 512
) -> dict:
  """Leaf shapes of a BERT encoder with pooler (Devlin et al. 2019), as in Hugging Face's BertModel."""
  h = hidden
  tree = {
    "embeddings": {
      "word_embeddings": (vocab, h),
      "position_embeddings": (positions, h),
      "token_type_embeddings": (2, h),
      "LayerNorm": {"scale": (h,), "bias": (h,)},
    }
  }
  for i in range(layers):
    tree[f"layer_{i:02d}"] = {
      "attention": {
        **{name: {"kernel": (h, h), "bias": (h,)} for name in ("query", "key", "value")},
        "output": {"kernel": (h, h), "bias": (h,)},
        "LayerNorm": {"scale": (h,), "bias": (h,)},
      },
      "intermediate": {"kernel": (h, ffn), "bias": (ffn,)},
      "output": {"kernel": (ffn, h), "bias": (h,)},
      "LayerNorm": {"scale": (h,), "bias": (h,)},
    }
  tree["pooler"] = {"kernel": (h, h), "bias": (h,)}
  return tree


def many_leaves(count: int, size: int) -> dict:
  return {f"leaf_{i:04d}": (size,) for i in range(count)}


# Every tree a benchmark can name; built on demand (the names are cheap, the shapes are not).
NAMED_TREES: dict[str, Callable[[], dict]] = {
  "bert-tiny": lambda: bert_shapes(32, 1, 128, vocab=1000, positions=64),
  "bert-mini": lambda: bert_shapes(64, 2, 256, vocab=2000, positions=64),
  "30x1000": lambda: many_leaves(30, 1000),
  "huge-256K": lambda: {"w": (512, 512)},
  "bert-base": lambda: bert_shapes(768, 12, 3072),
  "bert-large": lambda: bert_shapes(1024, 24, 4096),
  "1000x1000": lambda: many_leaves(1000, 1000),
  "huge-64M": lambda: {"w": (8192, 8192)},
}
QUICK_CASES = ("bert-tiny", "bert-mini", "30x1000", "huge-256K")  # seconds on a CPU
FULL_CASES = ("bert-base", "bert-large", "1000x1000", "huge-64M")
LARGE_CASES = frozenset({"bert-mini", "bert-large"})  # left out by --skip-large


def cases(quick: bool = False, skip_large: bool = False) -> dict[str, dict]:
  """The trees a run of the step benchmark times, by name, in order."""
  return {name: NAMED_TREES[name]() for name in case_names(quick, skip_large)}


def case_names(quick: bool = False, skip_large: bool = False) -> list[str]:
  """The cases a run times, in order."""
  names = QUICK_CASES if quick else FULL_CASES
  return [n for n in names if not (skip_large and n in LARGE_CASES)]


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def leaf_shapes(shapes: dict) -> list[tuple[int, ...]]:
  return jax.tree.leaves(shapes, is_leaf=_is_shape)


def param_count(shapes: dict) -> int:
  return sum(math.prod(s) for s in leaf_shapes(shapes))


def random_tree(shapes: dict, seed: int, scale: float) -> dict:
  """Normal(0, scale) float32 leaves of the given shapes (never zeros)."""
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  make = jax.jit(
    lambda k, shape: scale * jax.random.normal(k, shape, jnp.float32), static_argnums=1
  )
  return jax.tree.unflatten(treedef, [make(k, s) for k, s in zip(keys, leaves, strict=True)])


def random_params(shapes: dict) -> dict:
  return random_tree(shapes, 0, 0.02)


def random_grads(shapes: dict) -> dict:
  return random_tree(shapes, 1, 1e-3)


def alive(tree) -> bool:
  """Whether no buffer of `tree` was deleted (a donating call that failed may have taken them)."""
  return not any(x.is_deleted() for x in jax.tree.leaves(tree))


def delete(tree) -> None:
  """Free the device buffers of `tree` now, not when the garbage collector gets to them."""
  for x in jax.tree.leaves(tree):
    if not x.is_deleted():
      x.delete()
