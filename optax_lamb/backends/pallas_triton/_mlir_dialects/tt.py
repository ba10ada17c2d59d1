"""The module MLIR's Python bindings find for the Triton dialect ("tt"): empty on purpose.

The dialect's operations are registered by jaxlib when jax's Pallas Triton lowering imports it;
the bindings only need an importable module of this name to stop searching (`common`).
"""
