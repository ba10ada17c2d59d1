"""The implementations of one lamb step; `optax_lamb.step._registry` names them and picks one per call.

Each backend computes from the step plan (`optax_lamb.step._plan.StepPlan`: options,
scalars, per-leaf plans) and the leaves' arrays, returns a `StepResult` (updates
or new params, new moments, the ratio vector), and says through the
`optax_lamb.step._registry.Backend` protocol where ``auto`` takes it (`auto_reason`)
and which steps it cannot take (`unsupported_reason`): `xla.XlaBackend` (runs
everywhere), and the GPU backends on the shared driver `gpu` (each a kernel set:
`pallas_triton.PallasTritonBackend`, Triton kernels, and
`pallas_mosaic_gpu.PallasMosaicGpuBackend`, Mosaic GPU kernels; imported only
when used), whose step `per_device` runs on each device's shards under
``jax.jit`` (a ``pallas_call`` is opaque to XLA's partitioner). A configured
instance may be passed as ``lamb(..., implementation=backend)``.

A backend imports `optax_lamb.core`, the plan's types (`optax_lamb.step._plan`) and
`optax_lamb._interop`; the registry loads each by its module's name (``_LOADERS``), so the step
does not import the backends, and ``auto`` imports no GPU backend where jax's default backend is
not a GPU. The XLA backend, which runs everywhere, is imported with the package (here).
"""

from optax_lamb.backends import xla as xla
