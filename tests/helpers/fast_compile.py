"""Compiler options that make XLA:CPU compile the tests' many small steps faster.

The new tests compile a step per case (per example for hypothesis); skipping
LLVM's expensive passes and the CPU fusion emitters cuts compile time 2-3x.
Every implementation compared in one test is compiled with the same options.
Options this jax/XLA does not know (or another backend) give plain `jax.jit`.
"""

import functools

import jax
import jax.numpy as jnp

_OPTIONS = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
  "xla_cpu_use_fusion_emitters": False,
}


@functools.cache
def options() -> dict:
  if jax.default_backend() != "cpu":
    return {}
  try:
    jax.jit(lambda x: x + 1, compiler_options=_OPTIONS)(jnp.zeros(2))
  except Exception:  # an XLA without one of these options
    return {}
  return dict(_OPTIONS)


def jit(fun, **kwargs):
  """`jax.jit` with the fast-compile options where they are accepted."""
  return jax.jit(fun, compiler_options=options() or None, **kwargs)
