"""The Pallas kernels of lamb: equal to the XLA path for every option, deterministic, same state.

`TestPallasGPU` runs the kernels compiled and skips itself unless the default
backend is a GPU; `TestPallasInterpret` runs the same tests in Pallas interpret
mode (the CPU CI). Block sizes are tiny (128 elements, 3 leaves per call) so
chunking, tails, stacked slices and several buckets are all exercised on small
trees. Inputs are fresh random numbers each run (the seed is printed in
failure messages; set PALLAS_TEST_SEED to replay one).

In interpret mode a masked-out tail read of a `pl.ds` window returns the
`other` value and an unmasked one reads a shifted window, so a missing mask
shows up as a value mismatch; outputs that a program forgets to write start
as NaN, hence the all-finite checks.
"""

import dataclasses
import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lamb
from optax_lamb import _pallas, _xla

SEED = int(os.environ.get("PALLAS_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
STEPS = 3
LR = 1e-2
BLOCK_SIZES = _pallas.BlockSizes(block=128, max_leaves_per_call=3, num_warps=4)
SHAPES = {
  "kernel": (5, 37),  # 185 elements: one full chunk and a tail
  "bias": (37,),  # zero-initialised: ratio exactly 1
  "scalar": (),
  "empty": (0, 3),  # skipped by the kernels
  "stacked": (3, 70),  # stacked_axes=1: three slices, each one chunk with a tail
  "stacked2": (2, 3, 130),  # stacked_axes=2: six slices of two chunks
  "vector": (300,),  # three chunks
  "tiny": (1,),
}
STACKED = {name: {"stacked": 1, "stacked2": 2}.get(name, 0) for name in SHAPES}


def make_params(seed, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(SHAPES))
  return {
    name: (
      jnp.zeros(shape, dtype)
      if name == "bias"
      else (0.5 * jax.random.normal(k, shape)).astype(dtype)
    )
    for k, (name, shape) in zip(keys, SHAPES.items(), strict=True)
  }


def make_grads(params, seed, scale=1.0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
    treedef,
    [
      (scale * jax.random.normal(k, jnp.shape(x))).astype(x.dtype)
      for k, x in zip(keys, leaves, strict=True)
    ],
  )


decay_mask_fn = lambda p: jax.tree.map(lambda x: jnp.ndim(x) > 1, p)
adapt_mask = {name: name not in ("vector", "tiny") for name in SHAPES}
lr_schedule = optax.linear_schedule(LR, LR / 10, STEPS)
wd_schedule = optax.linear_schedule(0.1, 0.01, STEPS)

# lamb keyword arguments and the scale of the gradients
CASES = {
  "defaults": ({}, 1.0),
  "decay_mask": ({"weight_decay": 0.05, "mask": decay_mask_fn}, 1.0),
  "trust_ratio_mask": ({"trust_ratio_mask": adapt_mask}, 1.0),
  "trust_ratio_clamps": ({"min_trust_ratio": 0.4, "max_trust_ratio": 0.6}, 1.0),
  "no_bias_correction_eps_root": ({"bias_correction": False, "eps_root": 1e-4, "eps": 1e-3}, 1.0),
  "eps_zero": ({"eps": 0.0}, 1.0),  # 0/0 in masked-out lanes must not reach the norms
  "max_grad_norm": ({"max_grad_norm": 0.5}, 3.0),
  "stacked_axes": ({"stacked_axes": STACKED, "weight_decay": 0.01}, 1.0),
  "schedules": ({"learning_rate": lr_schedule, "weight_decay": wd_schedule}, 1.0),
  "combined": (
    {
      "learning_rate": lr_schedule,
      "weight_decay": wd_schedule,
      "mask": decay_mask_fn,
      "trust_ratio_mask": adapt_mask,
      "min_trust_ratio": 0.05,
      "max_trust_ratio": 0.6,
      "max_grad_norm": 1.0,
      "stacked_axes": STACKED,
      "b1": 0.8,
      "b2": 0.99,
    },
    2.0,
  ),
}
# update_and_apply is compared with update + apply in these cases (each costs a compile).
FUSED_CASES = ("stacked_axes", "combined")


def build(kwargs, implementation):
  kwargs = dict(kwargs)
  lr = kwargs.pop("learning_rate", LR)
  return optax_lamb.lamb(lr, implementation=implementation, **kwargs)


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


class TestPallasGPU:
  """Compiled Triton kernels; skipped unless the default backend is a GPU."""

  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas kernels need a GPU (TestPallasInterpret runs them on the CPU)")
    with _pallas.options(block_sizes=BLOCK_SIZES, interpret=self.INTERPRET):
      yield

  def _steps(self, kwargs, scale, params, seeds, fused=True):
    """(xla, pallas update + apply[, pallas update_and_apply]) after len(seeds) steps.

    One jitted step advances all of them, so each case compiles once.
    """
    xla, pallas = build(kwargs, "xla"), build(kwargs, "pallas")

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
    kwargs, scale = CASES[case]
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

  def test_deterministic_with_donated_buffers(self):
    kwargs, scale = CASES["combined"]
    tx = build(kwargs, "pallas")
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
    kwargs, scale = CASES["combined"]
    xla, pallas = build(kwargs, "xla"), build(kwargs, "pallas")
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
    kwargs, _ = CASES["schedules"]
    tx = build(kwargs, "pallas")
    params = make_params(SEED)
    grads = make_grads(params, SEED + 1)
    step = jax.jit(functools.partial(update_then_apply, tx))
    p, s = params, tx.init(params)
    for _ in range(3):
      p, s = step(p, s, grads)
    assert step._cache_size() == 1
    # A learning rate injected as an array: new values, the same executable.
    injected = optax.inject_hyperparams(optax_lamb.lamb)(
      learning_rate=LR, weight_decay=0.01, implementation="pallas"
    )
    step = jax.jit(functools.partial(update_then_apply, injected))
    p, s = params, injected.init(params)
    for lr in (1e-2, 3e-3, 1e-3):
      s.hyperparams["learning_rate"] = jnp.asarray(lr)
      p, s = step(p, s, grads)
    assert step._cache_size() == 1
    assert_finite(p)

  def test_mixed_precision_params_with_float32_moments(self):
    kwargs = {"weight_decay": 0.01, "mu_dtype": jnp.float32, "nu_dtype": jnp.float32}
    dtypes = {name: (jnp.bfloat16, jnp.float16)[i % 2] for i, name in enumerate(SHAPES)}
    params = {name: x.astype(dtypes[name]) for name, x in make_params(SEED).items()}
    seeds = [SEED + 1 + t for t in range(STEPS)]
    (p_xla, s_xla), (p_pl, s_pl) = self._steps(kwargs, 1.0, params, seeds, fused=False)
    msg = f"PALLAS_TEST_SEED={SEED}"
    assert jax.tree.map(lambda x: x.dtype, p_pl) == jax.tree.map(lambda x: x.dtype, params)
    assert_finite((p_pl, s_pl), msg)
    # The same expressions in the same dtypes: within a rounding step of the narrow type.
    assert_close(p_pl, p_xla, rtol=1e-2, atol=1e-3, msg=msg)
    assert_close(s_pl[1], s_xla[1], rtol=1e-5, atol=1e-7, msg=msg)

  def test_sharded_leaves_psum_the_norms(self):
    # 8 host devices on the CPU (tests/conftest.py); on one GPU a 1-device mesh still runs the
    # kernels inside shard_map with manual axes.
    devices = np.array(jax.devices()[:8])
    if devices.size not in (1, 2, 4, 8):
      pytest.skip(f"needs 1, 2, 4 or 8 devices, has {devices.size}")
    mesh = jax.sharding.Mesh(devices, ("d",))
    spec = jax.sharding.PartitionSpec("d")
    k = jax.random.split(jax.random.PRNGKey(SEED), 2)
    params = {"w": jax.random.normal(k[0], (64, 40)), "v": jax.random.normal(k[1], (8, 96))}
    grads = [make_grads(params, SEED + 1 + t) for t in range(2)]
    kwargs = {"weight_decay": 0.01, "max_grad_norm": 1.0, "min_trust_ratio": 0.1}
    xla = optax_lamb.lamb(LR, **kwargs)
    p_want, s_want = params, xla.init(params)
    for g in grads:
      p_want, s_want = update_then_apply(xla, p_want, s_want, g)
    tx = optax_lamb.lamb(LR, axis_name="d", implementation="pallas", **kwargs)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    def sharded(params, *grads):
      state = tx.init(params)
      for g in grads:
        params, state = optax_lamb.update_and_apply(tx, g, state, params)
      return params

    got = sharded(params, *grads)
    assert_finite(got)
    assert_close(got, p_want, msg=f"PALLAS_TEST_SEED={SEED}")

  def test_donated_update_and_apply_aliases_params_and_moments(self):
    if self.INTERPRET:
      pytest.skip("interpret mode does not model the kernels' aliasing (KERNEL.md)")
    shapes = [(1024, 256), (256, 1024), (512, 512), (1024,), (256,), (4, 256, 64)]
    keys = jax.random.split(jax.random.PRNGKey(SEED), len(shapes))
    params = {
      f"p{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
    }
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tx = optax_lamb.lamb(LR, weight_decay=0.01, implementation="pallas")
    state = tx.init(params)
    step = lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # grads cannot be reused for the outputs
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
    memory = compiled.memory_analysis()
    print(
      f"alias {memory.alias_size_in_bytes} temp {memory.temp_size_in_bytes} params {param_bytes}"
    )
    assert memory.alias_size_in_bytes >= 3 * param_bytes  # p, m and v written in place
    assert memory.temp_size_in_bytes < param_bytes / 4  # no param-sized temporary


class TestPallasInterpret(TestPallasGPU):
  """The same tests in Pallas interpret mode (any backend; the CPU CI)."""

  INTERPRET = True


# ------------------------------------------------- backend-independent: plan, options, fallbacks


def test_chunk_table_covers_every_element_once():
  shapes = list(SHAPES.values())
  axes = list(STACKED.values())
  names = list(SHAPES)
  buckets = _pallas.leaf_chunks(shapes, axes, [True] * 8, [True] * 8, BLOCK_SIZES)
  assert [len(indices) for indices, _ in buckets] == [3, 3, 1]  # the empty leaf is skipped
  assert names.index("empty") not in [i for indices, _ in buckets for i in indices]
  block = BLOCK_SIZES.block
  for indices, table in buckets:
    first = 0
    for i, leaf in zip(indices, table, strict=True):
      assert leaf.first == first
      first += leaf.programs
      covered = np.zeros(int(np.prod(shapes[i])), int)
      for program in range(leaf.programs):
        s, c = divmod(program, leaf.chunks)
        lo = c * block
        hi = min(lo + block, leaf.length)
        covered[s * leaf.length + lo : s * leaf.length + hi] += 1
      assert (covered == 1).all(), names[i]


def _lower_for_cuda(step, *args, donate=()):
  """StableHLO text of `step` lowered for a CUDA GPU: runs the Triton lowering without a GPU."""
  with _pallas.options(block_sizes=BLOCK_SIZES, interpret=False), warnings.catch_warnings():
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
  """Every primitive in the kernels has a Triton lowering; two kernels per bucket; p, m, v aliased."""
  kwargs, _ = CASES["combined"]
  params = make_params(SEED)
  tx = build(kwargs, "pallas")
  if fused_apply:
    step = lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p)
  else:
    step = functools.partial(update_then_apply, tx)
  hlo = _lower_for_cuda(step, params, tx.init(params), params, donate=(0, 1))
  calls = _triton_calls(hlo)
  buckets = _pallas.leaf_chunks(
    list(SHAPES.values()), list(STACKED.values()), [True] * 8, [True] * 8, BLOCK_SIZES
  )
  assert len(calls) == 2 * len(buckets), "\n".join(calls)
  aliases = sum(line.count("output_operand_alias<") for line in calls)
  leaves = sum(len(indices) for indices, _ in buckets)
  assert aliases == (3 if fused_apply else 2) * leaves  # m and v in pass 1, p in pass 2


def test_leaf_over_two_gigabytes_lowers_for_cuda():
  """A 2.4 GB float32 leaf: the chunk table and the Triton lowering use int32 element offsets."""
  big = {"w": jax.ShapeDtypeStruct((600_000_000,), jnp.float32)}
  tx = optax_lamb.lamb(LR, implementation="pallas")
  state = jax.eval_shape(tx.init, big)
  hlo = _lower_for_cuda(lambda p, s, g: optax_lamb.update_and_apply(tx, g, s, p), big, state, big)
  grid = sorted({int(x) for x in re.findall(r"grid_x = (\d+)", hlo)})
  assert grid == [-(-600_000_000 // BLOCK_SIZES.block)], grid


def test_leaves_over_two_gigabytes_use_int32_element_offsets():
  block = _pallas.BlockSizes().block
  # 600M float32 elements = 2.4 GB: every element offset still fits int32.
  (indices, (leaf,)), *_ = _pallas.leaf_chunks(
    [(600_000_000,)], [0], [True], [True], _pallas.BlockSizes()
  )
  assert leaf.chunks * block < 2**31 - 1
  # 2^31 elements do not: such a leaf is refused by the planner and falls back to XLA.
  with pytest.raises(ValueError, match="elements"):
    _pallas.leaf_chunks([(2**31,)], [0], [True], [True], _pallas.BlockSizes())
  huge = jax.ShapeDtypeStruct((2**31,), jnp.float32)
  config = _config()
  reason = _pallas.unsupported_reason(config, [huge], [huge], [huge], [huge], _pallas.BlockSizes())
  assert "2**31" in reason


def _config(**kwargs):
  fields = dict(
    learning_rate=LR,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    eps_root=0.0,
    weight_decay=0.0,
    mask=None,
    bias_correction=True,
    trust_ratio_mask=None,
    min_trust_ratio=None,
    max_trust_ratio=None,
    max_grad_norm=None,
    stacked_axes=None,
    axis_name=None,
  )
  fields.update(kwargs)
  return _xla.LambConfig(**fields)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"block": 100}, "block=100 must be a power of two"),
    ({"num_warps": 3}, "num_warps=3"),
    ({"max_leaves_per_call": 0}, "max_leaves_per_call=0"),
  ],
)
def test_block_sizes_validate(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _pallas.BlockSizes(**kwargs)


def test_mismatched_leaf_shapes_raise_with_the_shapes():
  params = {"w": jnp.ones((4, 8))}
  tx = optax_lamb.lamb(LR, implementation="pallas")
  state = tx.init(params)
  state = (state[0], state[1]._replace(mu={"w": jnp.ones((33,))}), *state[2:])
  with _pallas.options(block_sizes=BLOCK_SIZES, interpret=True):
    with pytest.raises(ValueError, match=r"m.shape=\(33,\) must equal p.shape=\(32,\)"):
      tx.update(params, state, params)


def test_narrow_moments_fall_back_to_xla_with_a_warning():
  params = make_params(SEED)
  grads = make_grads(params, SEED + 1)
  kwargs = {"mu_dtype": jnp.bfloat16, "weight_decay": 0.01}
  xla, pallas = build(kwargs, "xla"), build(kwargs, "pallas")
  _pallas._WARNED.clear()
  with pytest.warns(UserWarning, match="moments stored as mu=bfloat16"):
    got = update_then_apply(pallas, params, pallas.init(params), grads)
  want = update_then_apply(xla, params, xla.init(params), grads)
  assert_equal(got, want)


def test_options_the_kernels_do_not_know_fall_back():
  """An option added to lamb later (e.g. skip_nonfinite) is not silently ignored by the kernels."""
  extended = dataclasses.make_dataclass(
    "ExtendedConfig", [("skip_nonfinite", bool, False)], bases=(_xla.LambConfig,), frozen=True
  )
  x = [jnp.ones(3)]
  config = extended(**dataclasses.asdict(_config()), skip_nonfinite=True)
  reason = _pallas.unsupported_reason(config, x, x, x, x, BLOCK_SIZES)
  assert "skip_nonfinite" in reason
  config = extended(**dataclasses.asdict(_config()), skip_nonfinite=False)
  assert _pallas.unsupported_reason(config, x, x, x, x, BLOCK_SIZES) is None


def test_pallas_without_a_gpu_warns_once_that_it_interprets():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the kernels compile")
  params = {"w": jnp.ones((3, 5))}
  tx = optax_lamb.lamb(LR, implementation="pallas")
  _pallas._WARNED.clear()
  with pytest.warns(UserWarning, match="interpret mode"):
    tx.update(params, tx.init(params), params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update(params, tx.init(params), params)


def test_auto_is_the_xla_path():
  params = make_params(SEED)
  grads = make_grads(params, SEED + 1)
  got = update_then_apply(build({}, "auto"), params, build({}, "auto").init(params), grads)
  want = update_then_apply(build({}, "xla"), params, build({}, "xla").init(params), grads)
  assert_equal(got, want)
