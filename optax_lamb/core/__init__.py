"""The math every implementation shares, written once: one leaf's step (`_leaf`), the norms and
trust ratios (`_ratios`), the typed options and scalars of a step (`_options`), and how a moment
is stored (`_moment_storage`, 8-bit block-wise: `_quantize`). Imports nothing else of the
package but `optax_lamb._interop`. Private: the public names are in `optax_lamb`."""
