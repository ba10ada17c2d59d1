"""A backend configuration is checked when it is constructed, every field of every config class.

`XlaBackend`, `PallasTritonBackend` and `BlockSizes` (frozen dataclasses, passed as
``lamb(implementation=...)``) refuse a value of the wrong type or out of range at construction
(also through ``dataclasses.replace``), with an error naming the field and the value; such
values used to pass silently or fail at the first step with an internal error. The table lists
bad values per field, and a test holds it to every field of each class.
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import optax_lamb
from optax_lamb.backends.pallas_triton import BlockSizes, PallasTritonBackend
from optax_lamb.backends.xla import XlaBackend

BAD = {
  XlaBackend: {
    "materialize_u_max_size": [("big", TypeError), (-1, ValueError), (1.5, TypeError),
                               (True, TypeError), (None, TypeError)],
    "joint_small_sums": [("no", TypeError), (0, TypeError), (1, TypeError)],
    "chunked_sums": [(-4096, ValueError), ("64K", TypeError), (65536.0, TypeError),
                     (False, TypeError)],
  },
  PallasTritonBackend: {
    "block_sizes": [(4096, TypeError), ({"block": 1024}, TypeError), (None, TypeError)],
    "interpret": [("yes", TypeError), (1, TypeError)],
  },
  BlockSizes: {
    "block": [(100, ValueError), (-4096, ValueError), (True, TypeError), ("4096", TypeError),
              (4096.0, TypeError)],
    "max_leaves_per_call": [(0, ValueError), (-1, ValueError), (None, TypeError)],
    "num_warps": [(3, ValueError), (0, ValueError), (True, TypeError), (8.0, TypeError)],
    "num_stages": [(0, ValueError), (-2, ValueError), ("1", TypeError)],
    "sum_block": [(24, ValueError), (-1024, ValueError), (False, TypeError)],
    "xla_pass2_min_size": [(-1, ValueError), (1e5, TypeError), (None, TypeError)],
  },
}  # fmt: skip
CASES = [
  pytest.param(cls, name, value, error, id=f"{cls.__name__}({name}={value!r})")
  for cls, fields in BAD.items()
  for name, values in fields.items()
  for value, error in values
]
GOOD = {
  XlaBackend: dict(materialize_u_max_size=np.int64(0), joint_small_sums=np.bool_(True),
                   chunked_sums=0),
  PallasTritonBackend: dict(block_sizes=BlockSizes(block=1024), interpret=False),
  BlockSizes: dict(block=256, max_leaves_per_call=1, num_warps=1, num_stages=1, sum_block=1,
                   xla_pass2_min_size=0),
}  # fmt: skip


@pytest.mark.parametrize("cls", list(BAD))
def test_every_field_has_bad_values_and_good_ones(cls):
  names = {field.name for field in dataclasses.fields(cls)}
  assert set(BAD[cls]) == names
  assert set(GOOD[cls]) == names
  cls(**GOOD[cls])  # accepted


@pytest.mark.parametrize("cls, name, value, error", CASES)
def test_a_bad_field_is_refused_at_construction_naming_it(cls, name, value, error):
  shown = re.escape(f"{name}={value!r}")
  with pytest.raises(error, match=rf"{cls.__name__}\b.*\b{shown}"):
    cls(**{name: value})
  with pytest.raises(error, match=rf"{cls.__name__}\b.*\b{shown}"):
    dataclasses.replace(cls(), **{name: value})


def test_good_values_still_step():
  """The accepted spellings (NumPy integers and bools, None where the backend decides) step as
  the default configuration does."""
  params = {"w": jnp.ones((3, 4))}
  grads = {"w": jnp.full((3, 4), 0.5)}
  default = optax_lamb.lamb(1e-2, implementation="xla")
  want, _ = default.update(grads, default.init(params), params)
  for backend in (XlaBackend(**GOOD[XlaBackend]), XlaBackend(joint_small_sums=None)):
    tx = optax_lamb.lamb(1e-2, implementation=backend)
    got, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
