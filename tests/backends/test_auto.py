"""implementation="auto" where the kernels do not run (the CPU): the XLA path's step, bit for bit."""

import jax.numpy as jnp
import numpy as np

import optax_lamb


def test_auto_on_a_cpu_computes_the_xla_step(rng):
  params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
  auto, xla = optax_lamb.lamb(1e-2), optax_lamb.lamb(1e-2, implementation="xla")
  got, _ = auto.update(params, auto.init(params), params)
  want, _ = xla.update(params, xla.init(params), params)
  np.testing.assert_array_equal(got["w"], want["w"])
