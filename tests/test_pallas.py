"""The Pallas kernels of lamb: each equal to its jnp reference, and the whole step equal to the XLA path.

`TestPallasGPU` runs the kernels compiled and skips itself unless the default
backend is a GPU; `TestPallasInterpret` runs the same tests in Pallas interpret
mode (the CPU CI). Block sizes are tiny (128 elements, 3 leaves per launch) so
chunk tails, stacked slices, several launches, both kinds of pass 2 (the kernel
and the XLA computation of leaves of at least 256 elements) are all exercised on
the small tree of `option_cases`. The launch configuration is passed as a
`PallasBackend` object (``lamb(..., implementation=backend)``). Inputs come from
a fixed seed (printed in failure messages; PALLAS_TEST_SEED=n runs another).

In interpret mode a masked-out tail read of a `pl.ds` window returns the
`other` value and an unmasked one reads a shifted window, so a missing mask
shows up as a value mismatch; outputs that a program forgets to write start
as NaN, hence the all-finite checks.
"""

import collections
import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from option_cases import CASES, LR, build, by_path, make_grads, make_params, numpy_lamb

import optax_lamb
from optax_lamb import _leaf, _plan
from optax_lamb.backends.pallas import BlockSizes, PallasBackend, common, pass1, pass2, slice_sums

SEED = int(os.environ.get("PALLAS_TEST_SEED", "0"))
STEPS = 3
BLOCK_SIZES = BlockSizes(
  block=128, max_leaves_per_call=3, num_warps=4, sum_block=16, xla_pass2_min_size=256
)
# update_and_apply is compared with update + apply in these cases (each costs a compile).
FUSED_CASES = ("stacked_axes", "moments_bfloat16", "combined")


def update_then_apply(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def assert_close(a, b, rtol=1e-5, atol=1e-7, msg=""):
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol, err_msg=msg
    ),
    a,
    b,
  )


def assert_finite(tree, msg=""):
  for x in jax.tree.leaves(tree):
    assert np.isfinite(np.asarray(x, np.float64)).all(), msg


def assert_equal(a, b, msg=""):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y, err_msg=msg), a, b)


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


class TestPallasGPU:
  """Compiled Triton kernels; skipped unless the default backend is a GPU."""

  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas kernels need a GPU (TestPallasInterpret runs them on the CPU)")
    self.pallas = PallasBackend(block_sizes=BLOCK_SIZES, interpret=self.INTERPRET)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*interpret mode")
      yield

  def _steps(self, kwargs, scale, params, seeds, fused=True):
    """(xla, pallas update + apply[, pallas update_and_apply]) after len(seeds) steps.

    One jitted step advances all of them, so each case compiles once.
    """
    xla, pallas = build(kwargs, "xla"), build(kwargs, self.pallas)

    @jax.jit
    def step(runs, g):
      out = [update_then_apply(xla, *runs[0], g), update_then_apply(pallas, *runs[1], g)]
      if fused:
        p, s = runs[2]
        out.append(optax_lamb.update_and_apply(pallas, g, s, p))
      return out

    runs = [(params, xla.init(params))] * (3 if fused else 2)
    for seed in seeds:
      runs = step(runs, make_grads(params, seed, scale))
    return runs

  @pytest.mark.parametrize("case", list(CASES))
  def test_matches_xla_path(self, case):
    kwargs, _, scale = CASES[case]
    params = make_params(SEED)
    seeds = [SEED + 1 + t for t in range(STEPS)]
    (p_xla, s_xla), (p_pl, s_pl), *fused = self._steps(
      kwargs, scale, params, seeds, fused=case in FUSED_CASES
    )
    msg = f"case={case} PALLAS_TEST_SEED={SEED}"
    assert_finite((p_pl, s_pl, fused), msg)
    assert jax.tree.structure(s_pl) == jax.tree.structure(s_xla)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), (p_pl, s_pl)) == jax.tree.map(
      lambda x: (x.shape, x.dtype), (p_xla, s_xla)
    )
    assert_close(p_pl, p_xla, msg=msg)
    assert_close(s_pl, s_xla, msg=msg)
    if fused:
      # update_and_apply adds p + u in the kernel; the compiler may contract it into an FMA.
      assert_close(fused[0], (p_pl, s_pl), rtol=1e-6, atol=1e-8, msg=msg)

  @pytest.mark.parametrize("case", ["combined", "moments_bfloat16"])
  def test_matches_numpy_float64(self, case):
    kwargs, opts, scale = CASES[case]
    params = make_params(SEED)
    grads = [make_grads(params, SEED + 1 + t, scale) for t in range(STEPS)]
    tx = build(kwargs, self.pallas)
    step = jax.jit(functools.partial(update_then_apply, tx))
    p, s = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    want, want_ratios = numpy_lamb(params, grads, opts)
    got, got_ratios = by_path(p), by_path(optax_lamb.trust_ratios(s))
    for name in want:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
      np.testing.assert_allclose(got_ratios[name], want_ratios[name], rtol=1e-5, err_msg=name)

  @pytest.mark.parametrize("clip", [False, True])
  @pytest.mark.parametrize("apply", [False, True])
  def test_kernels_equal_their_references(self, clip, apply):
    rng = np.random.default_rng(SEED)
    shapes, plans, slots = random_leaf_plans(rng, 7)
    sizes, interpret = BLOCK_SIZES, self.INTERPRET
    draw = lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)
    narrow = lambda leaf: jnp.bfloat16 if pass2.from_grads(leaf) and leaf.adapt else jnp.float32
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
    h = _leaf.Hyperparams(
      bc1=runtime(0.1),
      bc2=runtime(0.01),
      weight_decay=runtime(0.05),
      step_size=runtime(-LR),
      clip_factor=runtime(0.7) if clip else None,
    )
    scalars, constants = common.scalar_operands(h)
    launch = dict(constants=constants, block_sizes=sizes, interpret=interpret)
    msg = f"PALLAS_TEST_SEED={SEED}"
    tables = common.buckets([leaf for leaf in plans if leaf.adapt], sizes)
    parts = ([], [])
    for table in tables:
      operands = [leaves[c.leaf.index] for c in table]
      written, p_part, u_part = pass1.moments_and_norms(scalars, operands, table=table, **launch)
      for c, moments, x in zip(table, written, operands, strict=True):
        ref = pass1.reference(h, x, c, sizes.block)
        if moments:
          assert_close((moments["m"], moments["v"]), ref[:2], msg=msg)
        span = slice(c.first, c.first + c.programs)
        assert_close((p_part[span], u_part[span]), ref[2:], rtol=1e-5, atol=1e-6, msg=msg)
      parts[0].append(p_part)
      parts[1].append(u_part)
    starts, counts = slice_sums.slot_ranges(tables, slots)
    p_all, u_all = (jnp.concatenate(x) for x in parts)
    sums = slice_sums.slice_sums(
      *slice_sums.slot_operands(starts, counts),
      p_all,
      u_all,
      block_sizes=sizes,
      interpret=interpret,
    )
    assert_close(sums, slice_sums.reference(starts, counts, p_all, u_all), msg=msg)
    ratios = jnp.asarray(rng.uniform(0.5, 2.0, slots), jnp.float32)
    for table in common.buckets(plans, sizes):
      operands = [{k: leaves[c.leaf.index][k] for k in pass2.input_names(c.leaf)} for c in table]
      results = pass2.updates(scalars, ratios, operands, table=table, apply=apply, **launch)
      for c, x, got in zip(table, operands, results, strict=True):
        want = pass2.reference(h, c.leaf, x, ratios, apply=apply)
        assert set(got) == set(want)
        assert_close(got, want, msg=msg)

  def test_deterministic_with_donated_buffers(self):
    kwargs, _, scale = CASES["combined"]
    tx = build(kwargs, self.pallas)
    params = make_params(SEED)
    grads = make_grads(params, SEED + 1, scale)
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # donated buffers the backend cannot reuse
      first = step(copy(params), copy(state), grads)
      second = step(copy(params), copy(state), grads)
    assert_finite(first)
    assert_equal(first, second, f"PALLAS_TEST_SEED={SEED}")
    assert_close(first, update_then_apply(build(kwargs, "xla"), params, state, grads))

  def test_state_interchangeable_with_xla(self):
    kwargs, _, scale = CASES["combined"]
    xla, pallas = build(kwargs, "xla"), build(kwargs, self.pallas)
    params = make_params(SEED)
    grads = [make_grads(params, SEED + 1 + t, scale) for t in range(4)]
    step = {
      name: jax.jit(functools.partial(update_then_apply, tx))
      for name, tx in (("xla", xla), ("pallas", pallas))
    }
    p_all, s_all = params, xla.init(params)
    for g in grads:
      p_all, s_all = step["xla"](p_all, s_all, g)
    p, s = params, xla.init(params)
    for name, g in zip(("xla", "pallas", "pallas", "xla"), grads, strict=True):
      p, s = step[name](p, s, g)
    assert_close((p, s), (p_all, s_all), msg=f"PALLAS_TEST_SEED={SEED}")

  def test_schedules_and_injected_hyperparams_do_not_recompile(self):
    kwargs, _, _ = CASES["schedules"]
    tx = build(kwargs, self.pallas)
    params = make_params(SEED)
    grads = make_grads(params, SEED + 1)
    step = jax.jit(functools.partial(update_then_apply, tx))
    p, s = params, tx.init(params)
    for _ in range(3):
      p, s = step(p, s, grads)
    assert step._cache_size() == 1
    # A learning rate injected as an array: new values, the same executable.
    injected = optax.inject_hyperparams(optax_lamb.lamb)(
      learning_rate=LR, weight_decay=0.01, implementation=self.pallas
    )
    step = jax.jit(functools.partial(update_then_apply, injected))
    p, s = params, injected.init(params)
    for lr in (1e-2, 3e-3, 1e-3):
      s.hyperparams["learning_rate"] = jnp.asarray(lr)
      p, s = step(p, s, grads)
    assert step._cache_size() == 1
    assert_finite(p)

  def test_mixed_precision_params(self):
    """bf16/fp16 params with float32 moments, and with moments in the param dtype (the default)."""
    dtypes = {name: (jnp.bfloat16, jnp.float16)[i % 2] for i, name in enumerate(make_params())}
    params = {name: jax.tree.map(lambda x, d=dtypes[name]: x.astype(d), x)
              for name, x in make_params(SEED).items()}  # fmt: skip
    seeds = [SEED + 1 + t for t in range(STEPS)]
    msg = f"PALLAS_TEST_SEED={SEED}"
    for kwargs in ({"weight_decay": 0.3, "mu_dtype": jnp.float32, "nu_dtype": jnp.float32},
                   {"weight_decay": 0.3}):  # fmt: skip
      (p_xla, s_xla), (p_pl, s_pl) = self._steps(kwargs, 1.0, params, seeds, fused=False)
      assert jax.tree.map(lambda x: x.dtype, p_pl) == jax.tree.map(lambda x: x.dtype, params)
      assert_finite((p_pl, s_pl), msg)
      # The same float32 math: the params within a rounding step of the narrow type.
      assert_close(p_pl, p_xla, rtol=1e-2, atol=1e-3, msg=msg)
      assert_close(optax_lamb.trust_ratios(s_pl), optax_lamb.trust_ratios(s_xla), msg=msg)

  @pytest.mark.parametrize("per_leaf_names", [False, True])
  def test_sharded_leaves_psum_the_norms(self, per_leaf_names):
    # 8 host devices on the CPU (tests/conftest.py); on one GPU a 1-device mesh still runs the
    # kernels inside shard_map with manual axes.
    devices = np.array(jax.devices()[:8])
    if devices.size not in (1, 2, 4, 8):
      pytest.skip(f"needs 1, 2, 4 or 8 devices, has {devices.size}")
    mesh = jax.sharding.Mesh(devices, ("d",))
    sharded_spec, replicated = jax.sharding.PartitionSpec("d"), jax.sharding.PartitionSpec()
    k = jax.random.split(jax.random.PRNGKey(SEED), 3)
    params = {
      "w": jax.random.normal(k[0], (64, 40)),
      "v": jax.random.normal(k[1], (8, 96)),
      "b": jax.random.normal(k[2], (40,)),
    }
    grads = [make_grads(params, SEED + 1 + t) for t in range(2)]
    kwargs = {"weight_decay": 0.01, "max_grad_norm": 1.0, "min_trust_ratio": 0.1}
    xla = optax_lamb.lamb(LR, **kwargs)
    p_want, s_want = params, xla.init(params)
    for g in grads:
      p_want, s_want = update_then_apply(xla, p_want, s_want, g)
    if per_leaf_names:  # b is replicated: its norms must not be psum'd
      axis_name = {"w": "d", "v": "d", "b": None}
      spec = {"w": sharded_spec, "v": sharded_spec, "b": replicated}
    else:
      axis_name, spec = "d", {"w": sharded_spec, "v": sharded_spec, "b": sharded_spec}
    tx = optax_lamb.lamb(LR, axis_name=axis_name, implementation=self.pallas, **kwargs)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    def sharded(params, *grads):
      state = tx.init(params)
      for g in grads:
        params, state = optax_lamb.update_and_apply(tx, g, state, params)
      return params

    with warnings.catch_warnings():
      warnings.filterwarnings("error", message=".*xla path")  # the kernels, no fallback
      got = sharded(params, *grads)
    assert_finite(got)
    assert_close(got, p_want, msg=f"PALLAS_TEST_SEED={SEED}")

  def test_donated_update_and_apply_aliases_params_and_moments(self):
    if self.INTERPRET:
      pytest.skip("interpret mode does not model the kernels' aliasing (docs/KERNELS.md)")
    shapes = [(1024, 256), (256, 1024), (512, 512), (1024,), (256,), (4, 256, 64)]
    keys = jax.random.split(jax.random.PRNGKey(SEED), len(shapes))
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

  def test_update_then_apply_fuses_pass2_with_the_apply(self):
    """tx.update + apply_updates: the big leaf's p is written by one fusion reading p, m, v."""
    if self.INTERPRET:
      pytest.skip("the fusion structure is the GPU compiler's")
    params = {"w": jax.random.normal(jax.random.PRNGKey(SEED), (512, 1024))}
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


class TestPallasInterpret(TestPallasGPU):
  """The same tests in Pallas interpret mode (any backend; the CPU CI)."""

  INTERPRET = True


# ------------------------------------------------- backend-independent: plans, lowering, fallbacks


def test_chunk_tables_cover_every_element_once():
  rng = np.random.default_rng(SEED)
  shapes, plans, slots = random_leaf_plans(rng, 9)
  tables = common.buckets(plans, BLOCK_SIZES)
  assert [len(t) for t in tables] == [3, 3, 3]
  starts, counts = slice_sums.slot_ranges(tables, slots)
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


COMPILED = PallasBackend(block_sizes=BLOCK_SIZES, interpret=False)


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
def test_kernels_lower_to_triton_for_cuda(fused_apply):
  """Every primitive has a Triton lowering; launches per bucket, one for the sums; aliases."""
  kwargs, _, _ = CASES["combined"]
  params = make_params(SEED)
  tx = build(kwargs, COMPILED)
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


def test_many_small_leaves_take_a_few_launches():
  """1,000 leaves: the kernels, and no per-leaf operation between them."""
  params = {f"w{i:04d}": jnp.ones((40,)) for i in range(1000)}
  tx = optax_lamb.lamb(LR, weight_decay=0.01, implementation=COMPILED)
  step = lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p)
  hlo = _lower_for_cuda(step, params, tx.init(params), params, donate=(0, 1))
  per_launch = BLOCK_SIZES.max_leaves_per_call
  assert len(_triton_calls(hlo)) == 2 * -(-1000 // per_launch) + 1
  main = hlo[hlo.index("func.func public @main") :]
  main = main[: main.index("\n  }")]
  ops = re.findall(r"^\s+%\S+ = \"?([a-z_.]+(?: @\w+)?)", main, re.M)
  ops = [re.sub(r"_\d+$", "", op) for op in ops]
  wrappers = ("call @moments_and_norms", "call @slice_sums", "call @updates")
  assert sum(op in wrappers for op in ops) == 2 * -(-1000 // per_launch) + 1  # the launches
  # between the launches: the scalars, the concatenated partial sums, the ratios (no per-leaf op)
  others = [op for op in ops if op not in wrappers]
  assert len(others) < 1000 / 5, collections.Counter(others)


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
  ((c,),) = common.buckets([leaf_plan((600_000_000,))], sizes)
  assert c.chunks * sizes.block < 2**31 - 1
  # 2^31 elements do not: such a leaf is refused (the dispatcher then takes XLA).
  with pytest.raises(ValueError, match="elements"):
    common.buckets([leaf_plan((2**31,))], sizes)


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
  tx = optax_lamb.lamb(LR, implementation=PallasBackend(block_sizes=BLOCK_SIZES, interpret=True))
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
