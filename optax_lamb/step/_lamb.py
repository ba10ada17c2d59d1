"""The LAMB optimizer: clipping, Adam, decoupled weight decay, trust ratio, learning rate."""

from __future__ import annotations

import optax
from jax.typing import DTypeLike

from optax_lamb.core._config import PerLeafAxes, PerLeafAxisNames, PerLeafMask
from optax_lamb.faults import _check_args
from optax_lamb.faults._spikes import SpikeRule
from optax_lamb.step._registry import Implementation
from optax_lamb.step._transform import build


def lamb(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-6,
  eps_root: float = 0.0,
  weight_decay: optax.ScalarOrSchedule = 0.0,
  mask: PerLeafMask = None,
  *,
  bias_correction: bool = True,
  trust_ratio_mask: PerLeafMask = None,
  min_trust_ratio: float | None = None,
  max_trust_ratio: float | None = None,
  max_grad_norm: float | None = None,
  stacked_axes: PerLeafAxes = None,
  mu_dtype: DTypeLike | None = None,
  nu_dtype: DTypeLike | None = None,
  axis_name: PerLeafAxisNames = None,
  implementation: Implementation = "auto",
  skip_nonfinite: bool = False,
  grad_scale: optax.ScalarOrSchedule | None = None,
  master_weights: bool = False,
  skip_spikes: SpikeRule | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""The LAMB optimizer (You et al. 2019), a drop-in for :func:`optax.lamb`.

  The update, for each leaf (or each stacked layer slice of a leaf); the stages
  :func:`clip_by_global_norm`, :func:`scale_by_adam`, :func:`add_decayed_weights`
  and :func:`scale_by_trust_ratio` compute its lines, and every implementation
  computes all of it:

  .. math::
    g &\leftarrow g \cdot \min(1, c / \|g\|_{global})  \quad \text{(if max\_grad\_norm = c)} \\
    m &\leftarrow b_1 m + (1 - b_1) g, \qquad v \leftarrow b_2 v + (1 - b_2) g^2 \\
    u &= \frac{m / (1 - b_1^t)}{\sqrt{v / (1 - b_2^t) + \epsilon_{root}} + \epsilon} + \lambda p \\
    r &= \mathrm{clip}(\|p\| / \|u\|, r_{min}, r_{max}) \quad (r = 1 \text{ if either norm is } 0) \\
    p &\leftarrow p - \eta_t \, r \, u

  With the defaults this computes what ``optax.lamb(learning_rate)`` computes.
  Its state is the tuple of the stage states, in order: clipping
  (:class:`optax.EmptyState`), :class:`optax.ScaleByAdamState`, weight decay,
  :class:`optax_lamb.ScaleByTrustRatioState` and the learning rate.

  Args:
    learning_rate: a finite float >= 0, a scalar array or an optax schedule.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the Adam denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    weight_decay: decoupled weight decay (float or schedule), added to the
      Adam direction and so inside the trust-ratio norm.
    mask: weight-decay mask, as in optax: a pytree of bools (a prefix of the
      params; a ``None`` entry decays) or callable(params) returning one.
    bias_correction: ``False`` gives u = m / (sqrt(v) + eps), as Google's code.
    trust_ratio_mask: pytree of bools (a prefix of the params) or callable(params):
      the leaves that get layer adaptation; the others use ratio 1. ``None`` (or a
      ``None`` entry): every leaf.
    min_trust_ratio: lower clamp of the ratio, applied when both norms are non-zero.
    max_trust_ratio: upper clamp of the ratio, applied when both norms are non-zero.
    max_grad_norm: clip the gradients to this global norm before the moments.
    stacked_axes: int, pytree of ints or callable(params): leading axes of a leaf
      that index stacked layers (``nn.scan``/``nnx.scan``); each slice gets its
      own trust ratio.
    mu_dtype: storage dtype of the first moment (default: param dtype);
      ``jnp.int8``: 8-bit block-wise quantized (a signed dynamic map), never a cast.
    nu_dtype: storage dtype of the second moment (default: param dtype);
      ``jnp.uint8``: 8-bit block-wise quantized (an unsigned dynamic map). A quantized
      leaf is a ``QuantizedMoment(codes, scales)``: codes of the param's shape, one
      float32 scale per block of 256 along the last axis (2.03 bytes a parameter for
      both moments); leaves under 4,096 elements stay float32 (docs/quantized_moments.md).
    axis_name: mapped axis name(s) over which leaves are sharded inside
      ``shard_map``/``pmap``; the squared norms (global clipping norm, trust-ratio
      norms) are ``psum``'d over them. A name or tuple of names for every leaf,
      or per leaf a pytree prefix / callable(params) of those with ``None`` for
      replicated leaves. ``None`` (default): no leaf is sharded, as under
      ``pmap`` with replicated params or ``jit`` with ``NamedSharding``.
    implementation: ``"auto"`` (the Pallas kernels on one GPU or inside
      ``shard_map``, else the XLA path; the rules are in ``optax_lamb/step/_registry.py``),
      ``"xla"`` (two fused passes over memory per leaf), ``"pallas_triton"``
      (alias ``"pallas"``: Triton kernels over buckets of leaves; without a GPU
      they run in Pallas interpret mode, slowly), ``"pallas_mosaic_gpu"`` (the same
      passes as Mosaic GPU kernels, for Hopper GPUs), ``"reference"`` (the stages'
      plain math, leaf by leaf, slower), or a configured backend object such as
      ``optax_lamb.backends.pallas_triton.PallasTritonBackend(block_sizes=...)``.
      Same values and state. ``"pallas"`` is a permanent alias of exactly one backend,
      ``"pallas_triton"`` (not deprecated: no warning); a later GPU backend (Mosaic GPU)
      takes a name of its own.
    skip_nonfinite: skip a step whose (unscaled) gradients hold a NaN or an Inf:
      zero updates, state unchanged, counted (:func:`optax_lamb.skip_counts`).
    grad_scale: divide the gradients by this loss scale before anything else: a
      positive float, an array, or a schedule on the number of updates. A dynamic
      scale can instead be passed each step as ``update(..., grad_scale=s)``; inside
      ``optax.chain`` it is divided out once, by the first stage that divides by it
      (so after :func:`optax_lamb.unscale_gradients` lamb takes its gradients as
      unscaled).
    master_weights: keep float32 master copies of the params in the state and run
      the LAMB math on them (:func:`optax_lamb.with_master_weights`), for
      bfloat16/float16 params.
    skip_spikes: with ``skip_nonfinite=True``, also skip a step whose global gradient
      norm (unscaled), or loss passed as ``update(..., value=loss)``, exceeds a
      multiple of its running average: an :class:`optax_lamb.SpikeRule`, as
      ``skip_nonfinite(tx, spikes=...)`` takes it, but fused into the step (no copy
      of the state). The state is then :class:`optax_lamb.SkipSpikesState`
      (:func:`optax_lamb.spike_stats`). :func:`optax_lamb.update_and_apply` passes
      no loss: there the rule judges the norm alone.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; its updates have the
    params' dtypes. Its state is the stage tuple, wrapped (outermost first) in the
    grad-scale schedule state, :class:`optax_lamb.SkipNonFiniteState` and
    :class:`optax_lamb.MasterWeightsState` when those options are on. Integer,
    boolean and complex leaves, empty trees and mismatched shapes raise errors.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lamb
    >>> params = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
    >>> tx = optax_lamb.lamb(1e-3, weight_decay=0.01)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> print([round(x, 4) for x in params["w"][0].tolist()])
    [0.999, 0.999, 0.999]
    >>> ratios = optax_lamb.trust_ratios(state)  # ||p|| / ||u||; 1 where ||p|| = 0
    >>> print({name: round(float(r), 4) for name, r in ratios.items()})
    {'b': 1.0, 'w': 0.9901}

    8-bit moments (the 3x3 and 3-element leaves above would stay float32):

    >>> tx = optax_lamb.lamb(1e-3, mu_dtype=jnp.int8, nu_dtype=jnp.uint8)
    >>> mu = tx.init({"w": jnp.ones((64, 512))})[1].mu["w"]
    >>> mu.codes.dtype, mu.codes.shape, mu.scales.dtype, mu.scales.shape
    (dtype('int8'), (64, 512), dtype('float32'), (64, 2))

  References:
    You et al., `Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes <https://arxiv.org/abs/1904.00962>`_, 2020
  """
  config = _check_args.lamb_config(
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    weight_decay=weight_decay,
    mask=mask,
    bias_correction=bias_correction,
    trust_ratio_mask=trust_ratio_mask,
    min_trust_ratio=min_trust_ratio,
    max_trust_ratio=max_trust_ratio,
    max_grad_norm=max_grad_norm,
    stacked_axes=stacked_axes,
    axis_name=axis_name,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
  )
  return build(
    config,
    implementation=implementation,
    skip_nonfinite=skip_nonfinite,
    grad_scale=grad_scale,
    master_weights=master_weights,
    skip_spikes=skip_spikes,
  )
