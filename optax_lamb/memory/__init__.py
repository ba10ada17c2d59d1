"""Where the optimizer's bytes live: `_offload` (the state in host memory between steps) and
`_mixed_precision` (float32 master weights of low-precision params). The moments' own formats
are in `optax_lamb.core` (`_moment_storage`, `_quantize`), which the math of a leaf reads.
Private modules: the public names are in `optax_lamb`."""
