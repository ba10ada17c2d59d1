"""lamb's public stages, each an Optax transformation: `_clipping` (clip_by_global_norm),
`_adam` (scale_by_adam), `_decay` (add_decayed_weights), `_trust_ratio` (scale_by_trust_ratio,
trust_ratios). Private modules: the public names are in `optax_lamb`."""
