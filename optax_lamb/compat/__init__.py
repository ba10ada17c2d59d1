"""Other libraries' LAMB, exactly: one constructor per library, with its argument names and defaults.

Each constructor returns an Optax transformation built on the same core as
:func:`optax_lamb.lamb` (so every ``implementation``, ``update_and_apply``,
``trust_ratios``, ``axis_name`` and checkpointing work with it) that computes
what that library computes. ``docs/which_lamb.md`` tabulates where the LAMBs
differ; each docstring here cites the source it follows.

=========================  ==========================================================
constructor                library
=========================  ==========================================================
``apex_fused_lamb``        ``apex.optimizers.FusedLAMB`` (the NVIDIA BERT recipe's)
``deepspeed_fused_lamb``   ``deepspeed.ops.lamb.FusedLamb``
``timm_lamb``              ``timm.optim.Lamb``
``torch_optimizer_lamb``   ``torch_optimizer.Lamb``
``keras_lamb``             ``keras.optimizers.Lamb`` (Keras 3)
``tfa_lamb``               ``tensorflow_addons.optimizers.LAMB``
``onnxruntime_lamb``       ONNX Runtime training's ``LambOptimizer`` op
=========================  ==========================================================

Shared rules:

* torch parameter groups map to ``weight_decay_mask``: a pytree prefix of bools
  (``None`` entries count as True) or a callable(params) returning one, like
  ``lamb``'s ``mask``. True where the leaf's group has the constructor's
  ``weight_decay``, False where the group has weight decay 0, with that
  library's consequences (apex and timm then give the leaf no trust ratio).
* A learning rate may be an optax schedule (count -> value) in place of a torch
  scheduler writing ``group['lr']`` or a Keras ``LearningRateSchedule``; both are
  read with the 0-based number of past steps.
* One step count for the whole tree. The torch libraries count per group or
  per parameter; in JAX every leaf has a gradient at every step, so the counts agree.
* An argument the library does not have is a ``TypeError`` (Python's own for
  an unexpected keyword); a value the library refuses is refused with the
  library's exception class, unless stated otherwise. The core's own limits
  also apply (a finite learning rate >= 0, decays in [0, 1)).
* Keyword-only extras of every constructor, as in :func:`optax_lamb.lamb`:
  ``stacked_axes`` (one trust ratio per stacked layer: what a torch model with
  one tensor per layer computes), ``axis_name``, ``implementation``,
  ``skip_nonfinite``, ``grad_scale``, ``master_weights``.

Example:
  >>> import jax.numpy as jnp, optax_lamb
  >>> params = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
  >>> tx = optax_lamb.compat.apex_fused_lamb(lr=1e-3, weight_decay=0.01,
  ...                                        weight_decay_mask={"w": True, "b": False})
  >>> state = tx.init(params)
"""

from optax_lamb.compat.apex import apex_fused_lamb
from optax_lamb.compat.deepspeed import deepspeed_fused_lamb
from optax_lamb.compat.keras import keras_lamb
from optax_lamb.compat.onnxruntime import onnxruntime_lamb
from optax_lamb.compat.tfa import tfa_lamb
from optax_lamb.compat.timm import timm_lamb
from optax_lamb.compat.torch_optimizer import torch_optimizer_lamb

__all__ = (
  "apex_fused_lamb",
  "deepspeed_fused_lamb",
  "keras_lamb",
  "onnxruntime_lamb",
  "tfa_lamb",
  "timm_lamb",
  "torch_optimizer_lamb",
)
