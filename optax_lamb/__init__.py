"""optax_lamb: the LAMB optimizer for JAX, as Optax transformations."""

from optax_lamb import (
  _interop,
  compat,  # other libraries' LAMB: optax_lamb.compat.timm_lamb, ...
)
from optax_lamb import backends as backends  # its xla module comes with the package, as before
from optax_lamb.core._options import RatioLayout, ScaleByTrustRatioState
from optax_lamb.core._quantize import QuantizedMoment
from optax_lamb.faults._loss_scale import UnscaleGradientsState, unscale_gradients
from optax_lamb.faults._skip import SkipCounts, SkipNonFiniteState, skip_counts, skip_nonfinite
from optax_lamb.faults._spikes import SkipSpikesState, SpikeRule, SpikeStats, spike_stats
from optax_lamb.memory._mixed_precision import (
  MasterWeightsState,
  master_weights,
  with_master_weights,
)
from optax_lamb.memory._offload import offload
from optax_lamb.stages._adam import scale_by_adam
from optax_lamb.stages._clipping import clip_by_global_norm
from optax_lamb.stages._decay import add_decayed_weights
from optax_lamb.stages._trust_ratio import scale_by_trust_ratio, trust_ratios
from optax_lamb.step._lamb import lamb
from optax_lamb.step._update_and_apply import update_and_apply

# flax.serialization saves the static layout as nothing and keeps the target's (see _interop).
_interop.register_layout_with_flax(RatioLayout)
# ... and refuses a plain array where an 8-bit moment is expected (see _interop).
_interop.register_quantized_moment_with_flax(QuantizedMoment)

__version__ = "0.2.0"

__all__ = (
  "MasterWeightsState",
  "QuantizedMoment",
  "RatioLayout",
  "ScaleByTrustRatioState",
  "SkipCounts",
  "SkipNonFiniteState",
  "SkipSpikesState",
  "SpikeRule",
  "SpikeStats",
  "UnscaleGradientsState",
  "add_decayed_weights",
  "clip_by_global_norm",
  "compat",
  "lamb",
  "master_weights",
  "offload",
  "scale_by_adam",
  "scale_by_trust_ratio",
  "skip_counts",
  "skip_nonfinite",
  "spike_stats",
  "trust_ratios",
  "unscale_gradients",
  "update_and_apply",
  "with_master_weights",
)
