"""The training step reduces the gradients once per step, not once per micro-batch."""

import re

import jax
import numpy as np
import pytest

pytest.importorskip("flax")

from optax_lamb_recipes import data, model
from optax_lamb_recipes.pretrain import optim, step


def computations_with(hlo: str, op: str) -> list[str]:
  """The names of the HLO computations in which ``op`` occurs."""
  found, comp = [], None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      comp = line.split("(")[0].replace("ENTRY", "").strip()
    if f" {op}(" in line or f" {op}-start(" in line:
      found.append(comp)
  return found


@pytest.mark.slow  # compiles the whole step on 4 devices (about 2 min on 2 busy cores)
@pytest.mark.skipif(jax.device_count() < 2, reason="needs several devices (conftest forces 8)")
def test_one_gradient_reduction_per_accumulated_step():
  cfg = model.BertConfig(vocab_size=128, hidden=32, layers=1, heads=2, mlp=64, max_len=16)
  mesh = step.make_mesh(jax.devices()[:4])
  rule = step.sharding_rule(mesh, False)
  net = step.make_model(cfg, None, 0, rule)
  tx = optim.build("lamb", lambda t: 1e-3, {})
  st = step.make_step(net, tx, lambda t: 1e-3, mesh, rule, True)
  rng = np.random.default_rng(0)
  seqs = rng.integers(5, 128, (16, 16)).astype(np.int32)
  local = data.mask_tokens(seqs, rng, mask_id=4, vocab_size=128)
  batch = step.global_batch(local, 2, st.batch_sharding)  # 2 micro-batches of 8, 2 a device
  params = net.init()
  state = st.init(params)
  hlo = st.update.lower(params, state, batch, np.int32(0)).compile().as_text()
  loops = re.findall(r"body=(%[\w.\-]+)", hlo)
  reduced = computations_with(hlo, "all-reduce")
  assert loops and reduced  # the accumulation loop, and a reduction
  assert not set(reduced) & set(loops)  # none inside the loop: once per step
  # The same mean gradient as XLA's partitioning of the global mean (a reduction per
  # micro-batch) and as one device's.
  grads, loss = jax.jit(lambda p, b: step.mean_gradient(net.graphdef, p, b, mesh))(params, batch)
  whole = jax.device_get(batch)
  want_g, want_l = jax.jit(lambda p, b: step.mean_gradient(net.graphdef, p, b, None))(
    jax.device_get(params), whole
  )
  np.testing.assert_allclose(loss, want_l, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  flat = data.MLMBatch(*(x.reshape(-1, *x.shape[2:]) for x in whole))
  np.testing.assert_allclose(
    loss, model.loss_fn(net.graphdef, jax.device_get(params), flat), rtol=1e-5
  )
