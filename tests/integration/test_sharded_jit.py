"""Every implementation under ``jax.jit`` over sharded arrays, on the 8 CPU devices of conftest.

Each layout of `LAYOUTS` (replicated, FSDP, the stacked layer axis, data x model), on a
mesh of Auto axes and one of Explicit axes, for ``xla``, ``reference`` and ``pallas`` (the
kernels in interpret mode, tiny blocks): the jitted update (4 leaves, one of them
scan-stacked; weight decay on some, global-norm clipping active) from a state with non-zero
moments must

* equal the single-device XLA update, its moments and trust ratios (rtol 1e-5);
* keep the params' shardings on the moments and updates, through ``init`` and
  ``update`` (bytes per device);
* compile to a program that moves no param-sized array between devices: no
  all-gather, all-to-all or collective-permute whose result has as many
  elements as the smallest leaf (read from ``compiled.as_text()``; the
  trust ratios of a stacked leaf sharded on its layer axis are gathered, a few
  floats).

Then master weights, ``pmap`` and ``shard_map`` as before, a one-device mesh
(the kernels compiled where a GPU is at hand), and the fallbacks: each says why.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fast_compile as _fast_compile
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lamb
from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend

N_DEVICES = 8
SHAPES = {"bias": (32,), "embed": (64, 16), "head": (16, 8), "layers": (8, 16, 16)}
STACKED_AXES = {"bias": 0, "embed": 0, "head": 0, "layers": 1}
DECAY_MASK = {"bias": False, "embed": True, "head": True, "layers": True}
MAX_GRAD_NORM = 0.5
SMALLEST_LEAF = min(math.prod(s) for s in SHAPES.values())
RTOL, ATOL = 1e-5, 1e-7

# The layouts users shard with: (mesh shape, mesh axes, each leaf's PartitionSpec).
LAYOUTS = {
  "replicated": ((8,), ("data",), {k: P() for k in SHAPES}),
  "fsdp": (  # each leaf sharded on its first (per-layer) axis
    (8,),
    ("data",),
    {"bias": P("data"), "embed": P("data"), "head": P("data"), "layers": P(None, "data")},
  ),
  "stacked-layer-axis": (  # the stacked leaf sharded on its layer axis, beside replicated leaves
    (8,),
    ("data",),
    {"bias": P(), "embed": P(), "head": P(), "layers": P("data")},
  ),
  "2d-data-model": (  # layers on data, weights on model, a leaf over both axes in one dim
    (4, 2),
    ("data", "model"),
    {
      "bias": P(("data", "model")),
      "embed": P("data", "model"),
      "head": P(None, "model"),
      "layers": P("data", None, "model"),
    },
  ),
}
MESH_KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
# Tiny blocks keep interpret mode fast and still give several chunks and buckets per leaf.
PALLAS = PallasTritonBackend(
  block_sizes=BlockSizes(block=64, sum_block=16, max_leaves_per_call=2, xla_pass2_min_size=1024),
  interpret=True,
)
IMPLEMENTATIONS = {"xla": "xla", "reference": "reference", "pallas": PALLAS}
# conftest sets 8 host CPU devices; on a GPU host only the one-device test runs.
eight_devices = pytest.mark.skipif(
  jax.device_count() < N_DEVICES, reason=f"needs {N_DEVICES} devices (tests/conftest.py)"
)


def make_tx(implementation, **kwargs):
  return optax_lamb.lamb(
    1e-2,
    weight_decay=0.01,
    mask=DECAY_MASK,
    max_grad_norm=MAX_GRAD_NORM,
    stacked_axes=STACKED_AXES,
    implementation=implementation,
    **kwargs,
  )


def host_arrays(seed: int, positive: bool = False) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  draw = lambda s: np.abs(rng.normal(size=s)) if positive else rng.normal(size=s)
  return {k: draw(s).astype(np.float32) for k, s in SHAPES.items()}


PARAMS, GRADS = host_arrays(0), host_arrays(1)
MU, NU = host_arrays(2), host_arrays(3, positive=True)


def with_moments(state, mu, nu):
  """lamb's state with these moments (non-zero moments exercise the whole moment update)."""
  adam = state[1]._replace(mu=mu, nu=nu)
  return (state[0], adam, *state[2:])


@pytest.fixture(scope="module")
def single_device():
  """(updates, state) of the XLA update on one device: what every sharded run must give."""
  device = jax.devices()[0]
  put = lambda t: jax.device_put(t, device)
  tx = make_tx("xla")
  state = with_moments(tx.init(put(PARAMS)), put(MU), put(NU))
  updates, state = jax.jit(tx.update)(put(GRADS), state, put(PARAMS))
  return jax.tree.map(np.asarray, updates), state


def assert_matches(updates, state, want):
  want_updates, want_state = want
  for name, got, ref in (
    ("updates", updates, want_updates),
    ("mu", state[1].mu, want_state[1].mu),
    ("nu", state[1].nu, want_state[1].nu),
    ("trust ratios", optax_lamb.trust_ratios(state), optax_lamb.trust_ratios(want_state)),
  ):
    for k in SHAPES:
      np.testing.assert_allclose(
        np.asarray(got[k]), np.asarray(ref[k]), rtol=RTOL, atol=ATOL, err_msg=f"{name}[{k}]"
      )


# ------------------------------------------------------------------------- what moves


def moved_arrays(hlo_text: str, min_elements: int) -> list[str]:
  """The all-gathers, all-to-alls and collective-permutes with a result of `min_elements` or more.

  Async forms (``all-gather-start``, a tuple result) count by their largest array.
  """
  found = []
  pattern = r"=\s*(.+?)\s+(all-gather|all-to-all|collective-permute)(-start)?\("
  for line in hlo_text.splitlines():
    match = re.search(pattern, line)
    if match is None:
      continue
    sizes = [
      math.prod(int(d) for d in dims.split(",") if d)
      for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", match.group(1))
    ]
    if sizes and max(sizes) >= min_elements:
      found.append(line.strip()[:160])
  return found


@eight_devices
def test_moved_arrays_finds_a_gather():
  """The check can fail: a sharded array made replicated is one param-sized all-gather."""
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  x = jax.device_put(np.ones((64, 16), np.float32), NamedSharding(mesh, P("data")))
  gather = jax.jit(lambda x: 2 * x, out_shardings=NamedSharding(mesh, P()))
  text = gather.lower(x).compile().as_text()
  assert len(moved_arrays(text, 64 * 16)) == 1, text
  assert moved_arrays(text, 64 * 16 + 1) == []


def per_device_elements(spec: P, shape, mesh) -> int:
  """How many elements of a leaf of `shape` sharded by `spec` over `mesh` each device holds."""
  split = 1
  for entry in spec:
    for axis in (entry,) if isinstance(entry, str) else entry or ():
      split *= mesh.shape[axis]
  return math.prod(shape) // split


def assert_sharded_like_params(trees: dict, specs: dict, mesh):
  for name, tree in trees.items():
    for k, spec in specs.items():
      x = tree[k]
      want = per_device_elements(spec, SHAPES[k], mesh) * x.dtype.itemsize
      shards = x.addressable_shards
      assert len(shards) == N_DEVICES, (name, k)
      assert all(s.data.nbytes == want for s in shards), (name, k, x.sharding, want)


# ------------------------------------------------------------------------- the table


@eight_devices
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("mesh_kind", list(MESH_KINDS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jitted_update_on_sharded_leaves(single_device, layout, mesh_kind, implementation):
  mesh_shape, axes, specs = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(MESH_KINDS[mesh_kind],) * len(axes))
  tx = make_tx(IMPLEMENTATIONS[implementation])
  put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("error", "(?s).*optax_lamb")  # no fallback (the later filter wins)
    warnings.filterwarnings("ignore", "(?s).*Pallas interpret mode")
    params, grads = put(PARAMS), put(GRADS)
    state = tx.init(params)
    assert_sharded_like_params({"init mu": state[1].mu, "init nu": state[1].nu}, specs, mesh)
    if mesh_kind == "explicit":  # the types carry the shardings: a plain jit of init keeps them
      jitted = jax.jit(tx.init)(params)
      assert_sharded_like_params({"jit(init) mu": jitted[1].mu}, specs, mesh)
    state = with_moments(state, put(MU), put(NU))
    compiled = _fast_compile.jit(tx.update).lower(grads, state, params).compile()
    updates, state = compiled(grads, state, params)

  assert_matches(updates, state, single_device)
  trees = {"updates": updates, "mu": state[1].mu, "nu": state[1].nu}
  assert_sharded_like_params(trees, specs, mesh)
  text = compiled.as_text()
  assert moved_arrays(text, SMALLEST_LEAF) == []
  assert ("moments_and_norms" in text) == (implementation == "pallas")  # the kernels ran


def test_the_problem_clips_and_adapts(single_device):
  """The global norm of the gradients is above max_grad_norm, and no trust ratio is 1."""
  norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in GRADS.values()))
  assert norm > 2 * MAX_GRAD_NORM
  ratios = jax.tree.leaves(optax_lamb.trust_ratios(single_device[1]))
  assert all(np.all(np.abs(np.asarray(r) - 1) > 1e-3) for r in ratios)


@eight_devices
@pytest.mark.parametrize("mesh_kind", list(MESH_KINDS))
def test_update_and_apply_and_master_weights_keep_shardings(single_device, mesh_kind):
  """The fused apply writes sharded params; master weights keep their params' shardings."""
  mesh_shape, axes, specs = LAYOUTS["2d-data-model"]
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(MESH_KINDS[mesh_kind],) * len(axes))
  put = lambda tree, dtype=np.float32: {
    k: jax.device_put(v.astype(dtype), NamedSharding(mesh, specs[k])) for k, v in tree.items()
  }
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("ignore", "(?s).*Pallas interpret mode")
    params, grads = put(PARAMS), put(GRADS)
    tx = make_tx(PALLAS)
    state = with_moments(tx.init(params), put(MU), put(NU))
    apply = _fast_compile.jit(lambda g, s, p: optax_lamb.update_and_apply(tx, g, s, p))
    compiled = apply.lower(grads, state, params).compile()
    new_params, _ = compiled(grads, state, params)
    assert moved_arrays(compiled.as_text(), SMALLEST_LEAF) == []
    assert_sharded_like_params({"new params": new_params}, specs, mesh)
    for k in SHAPES:
      want = PARAMS[k] + single_device[0][k]
      np.testing.assert_allclose(new_params[k], want, rtol=RTOL, atol=1e-6)

    half, half_grads = put(PARAMS, jnp.bfloat16), put(GRADS, jnp.bfloat16)
    tx = make_tx(PALLAS, master_weights=True)
    state = tx.init(half)
    updates, state = _fast_compile.jit(tx.update)(half_grads, state, half)
  assert_sharded_like_params({"master params": state.master, "updates": updates}, specs, mesh)
  assert_sharded_like_params({"mu": state.inner_state[1].mu}, specs, mesh)


# ------------------------------------------------------------------------- pmap, shard_map


@eight_devices
@pytest.mark.skipif(not hasattr(jax, "pmap"), reason="this jax has no jax.pmap")
@pytest.mark.parametrize("implementation", ["reference", "pallas"])
def test_pmap_replicated(single_device, implementation):
  """Classic data parallel: every device updates the whole (replicated) tree.

  (``xla`` under ``pmap``: tests/test_data_parallel.py, where ``auto`` is XLA on the CPU.)
  """
  tx = make_tx(IMPLEMENTATIONS[implementation])
  copies = lambda tree: jax.tree.map(lambda v: np.broadcast_to(v, (N_DEVICES, *v.shape)), tree)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "(?s).*Pallas interpret mode")
    state = with_moments(jax.pmap(tx.init)(copies(PARAMS)), copies(MU), copies(NU))
    args = (copies(GRADS), state, copies(PARAMS))
    lowered = jax.pmap(tx.update, axis_name="d").lower(*args)
    updates, state = lowered.compile(_fast_compile.options() or None)(*args)
  first = lambda tree: jax.tree.map(lambda v: np.asarray(v)[0], tree)
  assert_matches(first(updates), first(state), single_device)


def norm_axes(spec: P, stacked_axes: int):
  """The mesh axes that shard a leaf's non-stacked axes: its axis_name inside shard_map."""
  axes = tuple(
    a for e in tuple(spec)[stacked_axes:] for a in ((e,) if isinstance(e, str) else e or ())
  )
  return axes or None


@eight_devices
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_shard_map_2d_mesh(single_device, implementation):
  """Inside shard_map each leaf names the mesh axes it is sharded on (a tuple on a 2-D mesh).

  The stacked leaf is sharded inside its layers here: one sharded on its layer
  axis would need that axis in the clipping norm's psum but not in the trust
  ratio's, and one `axis_name` cannot say both.
  """
  axes = ("data", "model")
  mesh = jax.make_mesh((4, 2), axes, axis_types=(AxisType.Explicit,) * 2)
  specs = {
    "bias": P(axes),
    "embed": P("data", "model"),
    "head": P(None, "model"),
    "layers": P(None, "data", "model"),
  }
  axis_name = {k: norm_axes(specs[k], STACKED_AXES[k]) for k in SHAPES}
  tx = make_tx(IMPLEMENTATIONS[implementation], axis_name=axis_name)

  def step(grads, mu, nu, params):
    state = with_moments(tx.init(params), mu, nu)
    updates, state = tx.update(grads, state, params)
    return updates, state[1].mu, state[1].nu

  sharded = _fast_compile.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(specs,) * 4, out_specs=(specs,) * 3)
  )
  put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "(?s).*Pallas interpret mode")
    updates, mu, nu = sharded(put(GRADS), put(MU), put(NU), put(PARAMS))
  want_updates, want_state = single_device
  for got, want in ((updates, want_updates), (mu, want_state[1].mu), (nu, want_state[1].nu)):
    for k in SHAPES:
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=RTOL, atol=ATOL)
  assert_sharded_like_params({"updates": updates, "mu": mu}, specs, mesh)


# ------------------------------------------------------------------------- one device


def test_one_device_mesh(single_device):
  """The shard_map path on a one-device Explicit mesh: the kernels compiled where a GPU is at hand.

  (On a one-device Auto mesh there is nothing to partition: the step runs as on one device.)
  """
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
  tx = make_tx(
    PallasTritonBackend(block_sizes=PALLAS.block_sizes)
  )  # interpreted only without a GPU
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("ignore", "(?s).*Pallas interpret mode")
    params = put(PARAMS)
    state = with_moments(tx.init(params), put(MU), put(NU))
    updates, state = _fast_compile.jit(tx.update)(put(GRADS), state, params)
  assert_matches(updates, state, single_device)


# ------------------------------------------------------------------------- fallbacks


def pallas_update_warns(mesh, specs, transform=lambda f: f) -> tuple[dict, list[str]]:
  """The pallas update's result and its warnings (the interpret-mode one left out)."""
  tx = make_tx(PALLAS)
  put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
  with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params = put(PARAMS)
    state = with_moments(tx.init(params), put(MU), put(NU))
    updates, _ = _fast_compile.jit(transform(tx.update))(put(GRADS), state, params)
  messages = [str(w.message) for w in caught if "interpret mode" not in str(w.message)]
  return updates, messages


@eight_devices
def test_mixed_axis_types_fall_back_to_xla(single_device):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
  updates, messages = pallas_update_warns(mesh, LAYOUTS["fsdp"][2])
  assert len(messages) == 1 and "mixed axis types" in messages[0], messages
  assert messages[0].endswith("it runs on the xla path."), messages
  for k in SHAPES:
    np.testing.assert_allclose(updates[k], single_device[0][k], rtol=RTOL, atol=ATOL)


@eight_devices
def test_vmap_on_an_auto_mesh_falls_back_to_xla(single_device):
  """custom_partitioning has no batching rule: a vmapped step on an Auto mesh runs on XLA."""
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  specs = {k: P() for k in SHAPES}

  def batched(update):  # a batch of one: the same update as unbatched
    one = lambda tree: jax.tree.map(lambda x: x[None], tree)
    return lambda g, s, p: jax.vmap(update)(one(g), one(s), one(p))

  updates, messages = pallas_update_warns(mesh, specs, batched)
  assert len(messages) == 1 and "vmap or differentiation" in messages[0], messages
  for k in SHAPES:
    np.testing.assert_allclose(updates[k][0], single_device[0][k], rtol=RTOL, atol=ATOL)


@eight_devices
def test_uneven_shards_on_an_auto_mesh_take_that_axis_whole():
  """A sharding the compiler picks that does not divide a leaf: the kernels take that axis whole."""
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  x = np.linspace(-1.0, 1.0, 48, dtype=np.float32).reshape(12, 4)

  def update(implementation, x):
    params = {"w": jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))}
    tx = optax_lamb.lamb(1e-2, implementation=implementation)
    return tx.update(params, tx.init(params), params)[0]["w"]

  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("ignore", "(?s).*Pallas interpret mode")
    got = _fast_compile.jit(functools.partial(update, PALLAS))(x)
    want = _fast_compile.jit(functools.partial(update, "xla"))(x)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@eight_devices
def test_auto_on_several_gpus_stays_on_xla(monkeypatch, caplog):
  """Until the GPU figures measure the kernels per device, auto keeps several GPUs on XLA."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
  specs = LAYOUTS["fsdp"][2]
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in PARAMS.items()}
  tx = make_tx("auto")
  with jax.set_mesh(mesh), caplog.at_level(logging.INFO, logger="optax_lamb"):
    jax.eval_shape(tx.update, params, tx.init(params), params)
  lines = [r.getMessage() for r in caplog.records if r.name == "optax_lamb"]
  assert len(lines) == 1 and lines[0].startswith("optax_lamb.lamb: the xla path"), lines
  assert "8 devices" in lines[0] and "not measured" in lines[0], lines
