"""The Pallas kernels themselves: each equal to its jnp reference, their launches, lowering and limits.

The whole step on the kernels is checked by the conformance suite
(`test_conformance.py`: `TestPallasInterpret` on the CPU, `TestPallasCompiled`
on a GPU). Here, `TestKernelsCompiled` runs each kernel compiled and skips
itself unless the default backend is a GPU; `TestKernelsInterpret` runs the
same in Pallas interpret mode (the CPU CI). Block sizes are tiny (128
elements, 3 leaves per launch) so chunk tails, stacked slices and several
launches are exercised on small leaves. The module-level tests lower the
kernels to Triton for CUDA without a GPU, and check the chunk tables and limits.

In interpret mode a masked-out tail read of a `pl.ds` window returns the
`other` value and an unmasked one reads a shifted window, so a missing mask
shows up as a value mismatch; outputs that a program forgets to write start
as NaN, hence the all-finite checks.
"""

import builtins
import collections
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.asserts import assert_trees_close
from helpers.implementations import PALLAS_BLOCKS
from helpers.options import CASES, LR, build
from helpers.trees import by_path, make_params
from runs import update_then_apply

import optax_lamb
from optax_lamb.backends.gpu import passes
from optax_lamb.backends.gpu import tables as gpu_tables
from optax_lamb.backends.pallas_triton import (
  BlockSizes,
  PallasTritonBackend,
  pass1,
  pass2,
  slice_sums,
)
from optax_lamb.core._options import LambOptions, StepScalars
from optax_lamb.step import _plan

BLOCK_SIZES = PALLAS_BLOCKS


def leaf_plan(shape, *, index=0, stacked_axes=0, adapt=True, decay=True, narrow=False, offset=0):
  return _plan.LeafPlan(index, tuple(shape), decay, adapt, stacked_axes, None, offset, narrow)


def random_leaf_plans(rng, n):
  """Plans of `n` random leaves (some stacked, narrow moments, not adapted, not decayed)."""
  shapes = [tuple(int(d) for d in rng.integers(1, 9, size=rng.integers(1, 4))) for _ in range(n)]
  shapes[0] = (3, 300)  # several chunks per slice
  axes = [int(rng.integers(0, len(s))) for s in shapes]
  offsets = np.cumsum([0] + [int(np.prod(s[:k])) for s, k in zip(shapes, axes, strict=True)])
  flags = rng.random((n, 3)) < 0.5
  plans = [
    leaf_plan(shape, index=i, stacked_axes=k, adapt=not f[0], decay=f[1], narrow=f[2], offset=o)
    for i, (shape, k, f, o) in enumerate(zip(shapes, axes, flags, offsets[:-1], strict=True))
  ]
  return shapes, plans, int(offsets[-1])


class TestKernelsCompiled:
  """Each kernel compiled by Triton; skipped unless the default backend is a GPU."""

  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas kernels need a GPU (TestKernelsInterpret runs them on the CPU)")
    self.pallas = PallasTritonBackend(block_sizes=BLOCK_SIZES, interpret=self.INTERPRET)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*interpret mode")
      yield

  @pytest.mark.parametrize("clip", [False, True])
  @pytest.mark.parametrize("apply", [False, True])
  def test_kernels_equal_their_references(self, clip, apply, rng):
    shapes, plans, slots = random_leaf_plans(rng, 7)
    sizes, interpret = BLOCK_SIZES, self.INTERPRET
    draw = lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)
    narrow = lambda leaf: jnp.bfloat16 if passes.from_grads(leaf) and leaf.adapt else jnp.float32
    leaves = [
      {
        "p": draw(leaf.size),
        "g": draw(leaf.size),
        "m": 0.1 * draw(leaf.size, narrow(leaf)),
        "v": jnp.abs(draw(leaf.size, narrow(leaf))),
      }
      for leaf in plans
    ]
    runtime = lambda x: jnp.asarray(x, jnp.float32)
    options, h = (
      LambOptions(),
      StepScalars(
        bc1=runtime(0.1),
        bc2=runtime(0.01),
        weight_decay=runtime(0.05),
        step_size=runtime(-LR),
        clip_factor=runtime(0.7) if clip else None,
      ),
    )
    scalars, scalar_layout = gpu_tables.scalar_operands(h)
    launch = dict(
      options=options, scalar_layout=scalar_layout, block_sizes=sizes, interpret=interpret
    )
    tables = gpu_tables.buckets([leaf for leaf in plans if leaf.adapt], sizes)
    parts = []
    for table in tables:
      operands = [leaves[c.leaf.index] for c in table]
      written, launch_parts = pass1.moments_and_norms(scalars, operands, table=table, **launch)
      for c, moments, x in zip(table, written, operands, strict=True):
        want_moments, want_parts = passes.pass1_reference(options, h, x, c, sizes.block)
        if moments:
          assert_trees_close((moments["m"], moments["v"]), want_moments)
        span = slice(c.first, c.first + c.programs)
        assert_trees_close(launch_parts[:, span], want_parts)
      parts.append(launch_parts)
    starts, counts = gpu_tables.slot_ranges(tables, slots)
    joined = jnp.concatenate(parts, axis=1)
    sums = slice_sums.slice_sums(
      *gpu_tables.slot_operands(starts, counts), joined, block_sizes=sizes, interpret=interpret
    )
    assert_trees_close(sums, passes.slice_sums_reference(starts, counts, joined))
    ratios = jnp.asarray(rng.uniform(0.5, 2.0, slots), jnp.float32)
    for table in gpu_tables.buckets(plans, sizes):
      operands = [{k: leaves[c.leaf.index][k] for k in passes.input_names(c.leaf)} for c in table]
      results = pass2.updates(scalars, ratios, operands, table=table, apply=apply, **launch)
      for c, x, got in zip(table, operands, results, strict=True):
        want = passes.pass2_reference(options, h, c.leaf, x, ratios, apply=apply)
        assert set(got) == set(want)
        assert_trees_close(got, want)

  def test_donated_update_and_apply_aliases_params_and_moments(self, seed):
    if self.INTERPRET:
      pytest.skip("interpret mode does not model the kernels' aliasing (docs/KERNELS.md)")
    shapes = [(1024, 256), (256, 1024), (512, 512), (1024,), (256,), (4, 256, 64)]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    params = {
      f"p{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
    }
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tx = optax_lamb.lamb(LR, weight_decay=0.01, implementation=self.pallas)
    state = tx.init(params)
    for fused in (True, False):
      step = (lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p)) if fused else (
        lambda p, s, g: update_then_apply(tx, p, s, g)
      )  # fmt: skip
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grads cannot be reused for the outputs
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
      memory = compiled.memory_analysis()
      print(f"fused={fused} alias {memory.alias_size_in_bytes} temp {memory.temp_size_in_bytes}")
      assert memory.alias_size_in_bytes >= 3 * param_bytes  # p, m and v written in place
      assert memory.temp_size_in_bytes < param_bytes / 4  # no param-sized temporary

  def test_update_then_apply_fuses_pass2_with_the_apply(self, seed):
    """tx.update + apply_updates: the big leaf's p is written by one fusion reading p, m, v."""
    if self.INTERPRET:
      pytest.skip("the fusion structure is the GPU compiler's")
    params = {"w": jax.random.normal(jax.random.PRNGKey(seed), (512, 1024))}
    tx = optax_lamb.lamb(LR, weight_decay=0.01, implementation=self.pallas)
    state = tx.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      step = jax.jit(functools.partial(update_then_apply, tx), donate_argnums=(0, 1))
      hlo = step.lower(params, state, params).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    big = [line for line in entry.splitlines()
           if "=" in line and line.split("=", 1)[1].strip().startswith("f32[512,1024]")]  # fmt: skip
    fusions = [line for line in big if " fusion(" in line]
    assert len(fusions) == 1, "\n".join(big)


@pytest.mark.slow  # interpreted kernels: for their developers (CI runs them)
class TestKernelsInterpret(TestKernelsCompiled):
  """The same tests in Pallas interpret mode (any backend; the CPU CI)."""

  INTERPRET = True


# ------------------------------------------------- backend-independent: plans, lowering, fallbacks


def test_chunk_tables_cover_every_element_once(rng):
  shapes, plans, slots = random_leaf_plans(rng, 9)
  tables = gpu_tables.buckets(plans, BLOCK_SIZES)
  assert [len(t) for t in tables] == [3, 3, 3]
  starts, counts = gpu_tables.slot_ranges(tables, slots)
  block, base = BLOCK_SIZES.block, 0
  for table in tables:
    first = 0
    for c in table:
      assert c.first == first
      first += c.programs
      covered = np.zeros(c.leaf.size, int)
      for program in range(c.programs):
        s, k = divmod(program, c.chunks)
        lo, hi = k * block, min(k * block + block, c.leaf.length)
        covered[s * c.leaf.length + lo : s * c.leaf.length + hi] += 1
        # the program's partial sum is counted in its slot's range
        slot = c.leaf.ratio_offset + s
        assert starts[slot] <= base + c.first + program < starts[slot] + counts[slot]
      assert (covered == 1).all(), c
    base += first


COMPILED = PallasTritonBackend(block_sizes=BLOCK_SIZES, interpret=False)


def _lower_for_cuda(step, *args, donate=()):
  """StableHLO text of `step` lowered for a CUDA GPU: runs the Triton lowering without a GPU."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return (
      jax.jit(step, donate_argnums=donate)
      .trace(*args)
      .lower(lowering_platforms=("cuda",))
      .as_text()
    )


def _triton_calls(hlo):
  return [
    line
    for line in hlo.splitlines()
    if "custom_call @__gpu$xla.gpu.triton" in line or "custom_call @triton_kernel_call" in line
  ]


@pytest.mark.parametrize("fused_apply", [False, True])
def test_kernels_lower_to_triton_for_cuda(fused_apply, seed):
  """Every primitive has a Triton lowering; launches per bucket, one for the sums; aliases."""
  kwargs, _, _ = CASES["combined"]
  params = make_params(seed)
  tx = build(kwargs, "pallas-compiled")
  if fused_apply:
    step = lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p)
  else:
    step = functools.partial(update_then_apply, tx)
  hlo = _lower_for_cuda(step, params, tx.init(params), params, donate=(0, 1))
  calls = _triton_calls(hlo)
  sizes = [x.size for x in jax.tree.leaves(params) if x.size]
  adapted = [v for k, v in by_path(kwargs["trust_ratio_mask"]).items() if k != "['empty']"]
  pass1 = -(-sum(adapted) // BLOCK_SIZES.max_leaves_per_call)
  pass2_leaves = len(sizes) if fused_apply else sum(n < 256 for n in sizes)
  pass2 = -(-pass2_leaves // BLOCK_SIZES.max_leaves_per_call)
  assert len(calls) == pass1 + 1 + pass2, "\n".join(calls)
  # pass 1 writes m, v of its (float32-moment) leaves in place; update_and_apply writes p too
  aliases = sum(line.count("output_operand_alias<") for line in calls)
  assert aliases == 2 * sum(adapted) + (len(sizes) if fused_apply else 0) + 2 * (
    len(sizes) - sum(adapted)
  )


def test_lowering_for_cuda_finds_the_triton_dialect_module(monkeypatch, seed):
  """MLIR's Python bindings look for the Triton dialect's module at every op they build and do
  not remember a miss; the backend's search prefix (`common`) makes the first look succeed."""
  failed = collections.Counter()
  real_import = builtins.__import__

  def counting_import(name, *args, **kwargs):
    try:
      return real_import(name, *args, **kwargs)
    except ImportError:
      failed[name] += 1
      raise

  params = make_params(seed)
  tx = optax_lamb.lamb(LR, weight_decay=0.01, implementation=COMPILED)
  step = functools.partial(update_then_apply, tx)
  monkeypatch.setattr(builtins, "__import__", counting_import)
  hlo = _lower_for_cuda(step, params, tx.init(params), params, donate=(0, 1))
  monkeypatch.undo()
  assert _triton_calls(hlo)
  misses = {name: n for name, n in failed.items() if name.rsplit(".", 1)[-1] == "tt"}
  assert sum(misses.values()) <= 3, misses  # at most the first search, one miss per prefix


@pytest.mark.slow  # 19 s: lowered for cuda (49 s before the dialect search ended); CI runs it
def test_many_small_leaves_take_a_few_launches():
  """Many leaves: the kernels, and no per-leaf operation between them."""
  n = 500  # 16 launches per pass of 32 leaves
  params = {f"w{i:04d}": jnp.ones((40,)) for i in range(n)}
  tx = optax_lamb.lamb(LR, weight_decay=0.01, implementation=COMPILED)
  step = lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p)
  hlo = _lower_for_cuda(step, params, tx.init(params), params, donate=(0, 1))
  per_launch = BLOCK_SIZES.max_leaves_per_call
  assert len(_triton_calls(hlo)) == 2 * -(-n // per_launch) + 1
  main = hlo[hlo.index("func.func public @main") :]
  main = main[: main.index("\n  }")]
  ops = re.findall(r"^\s+%\S+ = \"?([a-z_.]+(?: @\w+)?)", main, re.M)
  ops = [re.sub(r"_\d+$", "", op) for op in ops]
  wrappers = ("call @moments_and_norms", "call @slice_sums", "call @updates")
  assert sum(op in wrappers for op in ops) == 2 * -(-n // per_launch) + 1  # the launches
  # between the launches: the scalars, the concatenated partial sums, the ratios (no per-leaf op)
  others = [op for op in ops if op not in wrappers]
  assert len(others) < n / 2, collections.Counter(others)  # a per-leaf op would add n


def test_leaf_over_two_gigabytes_lowers_for_cuda():
  """A 2.4 GB float32 leaf: the chunk table and the Triton lowering use int32 element offsets."""
  big = {"w": jax.ShapeDtypeStruct((600_000_000,), jnp.float32)}
  tx = optax_lamb.lamb(LR, implementation=COMPILED)
  state = jax.eval_shape(tx.init, big)
  hlo = _lower_for_cuda(lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p), big, state, big)
  grid = sorted({int(x) for x in re.findall(r"grid_x = (\d+)", hlo)})
  assert grid == [1, -(-600_000_000 // BLOCK_SIZES.block)], grid  # the sums: one slot


def test_leaves_over_two_gigabytes_use_int32_element_offsets():
  sizes = BlockSizes()
  # 600M float32 elements = 2.4 GB: every element offset still fits int32.
  ((c,),) = gpu_tables.buckets([leaf_plan((600_000_000,))], sizes)
  assert c.chunks * sizes.block < 2**31 - 1
  # 2^31 elements do not: such a leaf is refused (the dispatcher then takes XLA).
  with pytest.raises(ValueError, match="elements"):
    gpu_tables.buckets([leaf_plan((2**31,))], sizes)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"block": 100}, "block=100 must be a power of two"),
    ({"num_warps": 3}, "num_warps=3"),
    ({"sum_block": 24}, "sum_block=24"),
    ({"max_leaves_per_call": 0}, "max_leaves_per_call=0"),
    ({"xla_pass2_min_size": -1}, "xla_pass2_min_size=-1"),
  ],
)
def test_block_sizes_validate(kwargs, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**kwargs)


def test_mismatched_leaf_shapes_raise_with_the_shapes():
  params = {"w": jnp.ones((4, 8))}
  tx = optax_lamb.lamb(
    LR, implementation=PallasTritonBackend(block_sizes=BLOCK_SIZES, interpret=True)
  )
  state = tx.init(params)
  state = (state[0], state[1]._replace(mu={"w": jnp.ones((33,))}), *state[2:])
  # caught by the state check of the prologue, before the kernels' own shape check
  with pytest.raises(
    ValueError, match=r"state\[1\]\.mu\['w'\] has shape \(33,\) where .* \(4, 8\)"
  ):
    tx.update(params, state, params)


def test_unsupported_leaves_fall_back_to_xla_with_a_warning():
  """A leaf the kernels cannot take (2^31 elements): traced, never allocated."""
  big = {"w": jax.ShapeDtypeStruct((2**31,), jnp.float32)}
  pallas, xla = (optax_lamb.lamb(LR, implementation=i) for i in ("pallas", "xla"))
  with pytest.warns(UserWarning, match=r"2\*\*31 or more elements.*the xla path"):
    got = jax.eval_shape(pallas.update, big, jax.eval_shape(pallas.init, big), big)
  want = jax.eval_shape(xla.update, big, jax.eval_shape(xla.init, big), big)
  assert jax.tree.structure(got) == jax.tree.structure(want)


def test_pallas_without_a_gpu_warns_when_traced_that_it_interprets():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the kernels compile")
  params = {"w": jnp.ones((3, 5))}
  tx = optax_lamb.lamb(LR, implementation="pallas")
  step = jax.jit(functools.partial(update_then_apply, tx))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(params, tx.init(params), params)
    step(params, tx.init(params), params)  # no new trace, no new warning
  assert [str(w.message) for w in caught if "interpret mode" in str(w.message)] == [
    "optax_lamb.lamb(implementation='pallas') on a backend without a GPU runs its kernels in "
    "Pallas interpret mode, which is slow; use implementation='xla' there."
  ]
