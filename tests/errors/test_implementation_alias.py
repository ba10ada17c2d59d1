"""``implementation="pallas"``: a permanent alias of exactly one backend, ``"pallas_triton"``.

The name from before the rename is not deprecated (no ``DeprecationWarning``: the CHANGELOG's
policy is for names that will go, and its rename entry says so), resolves to the Pallas Triton
backend and nothing else (its steps are that backend's, bit for bit; where the kernels decline a
step, the backend named declining is ``pallas_triton``), and lamb's docstring and the CHANGELOG
say the same.
"""

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import optax_lamb
from optax_lamb import compat
from optax_lamb.backends.pallas_triton import PallasTritonBackend

CHANGELOG = pathlib.Path(__file__).resolve().parents[2] / "CHANGELOG.md"


def _step(implementation):
  params = {"w": jnp.linspace(-1.0, 1.0, 15).reshape(3, 5), "b": jnp.ones(5)}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = optax_lamb.lamb(1e-2, weight_decay=0.1, implementation=implementation)
    updates, state = tx.update(grads, tx.init(params), params)
  return (updates, state), caught


def test_pallas_steps_as_pallas_triton_and_is_not_deprecated():
  got, caught = _step("pallas")
  assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
  for want in (_step("pallas_triton")[0], _step(PallasTritonBackend())[0]):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)


def test_where_the_kernels_decline_the_backend_named_is_pallas_triton():
  """ONNX Runtime's per-element rules are not in the Triton kernels: the step falls back to XLA,
  and the warning names the backend that declined."""
  params = {"w": jnp.ones((3, 5))}
  tx = compat.onnxruntime_lamb(1e-2, implementation="pallas")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx.update(params, tx.init(params), params)
  messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
  assert any(
    re.search(r"implementation='pallas'\): pallas_triton: .*it runs on the xla path", m)
    for m in messages
  ), messages
  assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_lamb_docstring_and_changelog_call_it_a_permanent_alias_of_pallas_triton():
  doc = " ".join(optax_lamb.lamb.__doc__.split())
  assert (
    '``"pallas"`` is a permanent alias of exactly one backend, ``"pallas_triton"`` (not '
    "deprecated: no warning)" in doc
  )
  renamed = CHANGELOG.read_text().split("### Renamed", 1)[1].split("###", 1)[0]
  entry = " ".join(next(e for e in renamed.split("\n- ") if "pallas_triton" in e).split())
  assert (
    '`"pallas"` stays, permanently, an alias of exactly `"pallas_triton"`: not deprecated, '
    "so it gives no `DeprecationWarning`" in entry
  )
