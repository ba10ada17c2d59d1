"""The GPU driver shared by the GPU backends, and what each backend brings: a kernel set.

`driver.GpuBackend` is the step (buckets, slice sums, the ratio vector, pass 2
in the kernel or in XLA, per-device handling, the leaves every GPU backend
declines, whether it runs interpreted) over a `driver.KernelSet`: one backend's
launches of the passes, its block configuration and compiler parameters, and
the leaves its kernels decline. `tables` lays out the launches, `passes` says
what each pass computes (per chunk in a kernel, and as jnp twins), `arrays`
flattens a leaf's operands. A GPU backend is one module: its kernel set and a
`GpuBackend` subclass (`optax_lamb.backends.pallas_triton`,
`optax_lamb.backends.pallas_mosaic_gpu`), plus its line in `optax_lamb.step._registry`.
"""

from optax_lamb.backends.gpu.driver import GpuBackend, KernelSet

__all__ = ["GpuBackend", "KernelSet"]
