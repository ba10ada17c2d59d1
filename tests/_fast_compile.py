"""The name tests/compat/ and tests/test_sharded_jit.py import, until they move: helpers.fast_compile."""

from helpers.fast_compile import jit, options  # noqa: F401
