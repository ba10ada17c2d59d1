"""tensorflow_addons.optimizers.LAMB as float64 NumPy.

Transcribed from tensorflow/addons at commit d208d752e98c310280938efa939117bf635a60a8 (0.23.0,
the last release; LAMB unchanged since 339159fc):
  tensorflow_addons/optimizers/lamb.py   lines 40-112 (__init__), 122-142 (_prepare_local),
                                         144-181 (_resource_apply_dense), 243-254 (the two masks)
  tensorflow_addons/optimizers/utils.py  lines 67-75 (is_variable_matched_by_regexes)
and the base class it runs on, tf.keras.optimizers.legacy.Optimizer, from keras-team/keras at
tag v2.15.0 (commit 601488fd4c1468ae7872e132e0f1c9843df54182):
  keras/optimizers/legacy/optimizer_v2.py  lines 371-393 (allowed kwargs, refusals), 411-416
                                           (decay), 434-443 (clip options), 554-566 (clip
                                           order), 1183-1193 (_decayed_lr)
  keras/optimizers/utils.py                lines 91-143 (tf.clip_by_norm, tf.clip_by_global_norm)

Per call of apply(grads), with t = iterations + 1:

  clip: clipvalue: clip(g, -c, c), then clipnorm: g c / max(||g||, c) per variable, then
        global_clipnorm: g min(1, c / ||g||_global) (clipnorm and global_clipnorm: ValueError)
  lr_t = learning_rate(iterations) for a schedule (here: a callable(step)), then
         / (1 + decay iterations)                                   (legacy `decay`, default 0)
  m  <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
  u   = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + epsilon)
  u  <- u + weight_decay p     unless the name matches exclude_from_weight_decay (inside the ratio)
  r   = ||p|| / ||u|| (1 if either is 0), unless the name matches exclude_from_layer_adaptation
        (r = 1); exclude_from_layer_adaptation None or empty: the exclude_from_weight_decay list
  p  <- p - r lr_t u

The regexes are re.search'ed in the TF variable name, 'encoder/bias:0' for the path
'encoder/bias' (the ':0' is not stripped). `lr` is the old name of learning_rate and
`weight_decay_rate` of weight_decay. Refused: epsilon=0 or None (the code means to fall back
to Keras' backend epsilon, `epsilon or tf.backend_config.epsilon()`, but TensorFlow 2.15 has no
tf.backend_config: AttributeError); any other keyword (TypeError); a negative clipnorm,
clipvalue, lr, decay or global_clipnorm (ValueError).
"""

from __future__ import annotations

import re
import warnings

import numpy as np

_ALLOWED_KWARGS = {"clipnorm", "clipvalue", "lr", "decay", "global_clipnorm"}


def _matched(path: str, regexes) -> bool:
  return bool(regexes) and any(re.search(r, f"{path}:0") for r in regexes)


class LAMB:
  """tensorflow_addons.optimizers.LAMB on `variables`, a dict path -> array."""

  def __init__(self, variables, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
               weight_decay=0.0, exclude_from_weight_decay=None,
               exclude_from_layer_adaptation=None, name="LAMB", **kwargs):  # fmt: skip
    if "weight_decay_rate" in kwargs:
      warnings.warn(
        "weight_decay_rate has been renamed to weight_decay", DeprecationWarning, stacklevel=2
      )
      weight_decay = kwargs.pop("weight_decay_rate")
    for key, value in kwargs.items():
      if key not in _ALLOWED_KWARGS:
        raise TypeError(f"Unexpected keyword argument passed to optimizer: {key}.")
      if value is not None and value < 0:
        raise ValueError(f"Expected {key} >= 0, received: {value}")
    self.clipnorm = kwargs.get("clipnorm")
    self.global_clipnorm = kwargs.get("global_clipnorm")
    if self.clipnorm is not None and self.global_clipnorm is not None:
      raise ValueError("Cannot accept both `clipnorm` and `global_clipnorm`.")
    self.clipvalue = kwargs.get("clipvalue")
    self.decay = kwargs.get("decay", 0.0)
    self._learning_rate = kwargs.get("lr", learning_rate)
    self.beta_1, self.beta_2, self.weight_decay = beta_1, beta_2, weight_decay
    if not epsilon:
      raise AttributeError(
        f"epsilon={epsilon!r}: TF Addons falls back to tf.backend_config.epsilon(), "
        "which TensorFlow 2.15 does not have"
      )
    self.epsilon = epsilon
    self.exclude_from_weight_decay = exclude_from_weight_decay
    self.exclude_from_layer_adaptation = exclude_from_layer_adaptation or exclude_from_weight_decay
    self.params = {n: np.array(value, np.float64) for n, value in variables.items()}
    self.m = {n: np.zeros_like(p) for n, p in self.params.items()}
    self.v = {n: np.zeros_like(p) for n, p in self.params.items()}
    self.iterations = 0

  def _lr_t(self) -> float:
    lr = self._learning_rate
    lr = float(lr(self.iterations)) if callable(lr) else lr
    if self.decay > 0.0:
      lr = lr / (1.0 + self.decay * self.iterations)
    return lr

  def _transform_gradients(self, grads):
    if self.clipvalue is not None:
      grads = {n: np.clip(g, -self.clipvalue, self.clipvalue) for n, g in grads.items()}
    if self.clipnorm is not None:
      grads = {
        n: g * self.clipnorm / max(np.linalg.norm(g), self.clipnorm) for n, g in grads.items()
      }
    if self.global_clipnorm is not None:
      norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
      with np.errstate(divide="ignore"):
        scale = self.global_clipnorm * min(1.0 / norm, 1.0 / self.global_clipnorm)
      grads = {n: g * scale for n, g in grads.items()}
    return grads

  def apply(self, grads: dict) -> None:
    """One optimizer step (apply_gradients)."""
    grads = self._transform_gradients({n: np.asarray(g, np.float64) for n, g in grads.items()})
    lr_t, t = self._lr_t(), self.iterations + 1
    for name, g in grads.items():
      p, m, v = self.params[name], self.m[name], self.v[name]
      m[...] = m * self.beta_1 + g * (1 - self.beta_1)
      v[...] = v * self.beta_2 + (g * g) * (1 - self.beta_2)
      m_hat, v_hat = m / (1.0 - self.beta_1**t), v / (1.0 - self.beta_2**t)
      update = m_hat / (np.sqrt(v_hat) + self.epsilon)
      if not _matched(name, self.exclude_from_weight_decay):
        update = update + self.weight_decay * p
      ratio = 1.0
      if not _matched(name, self.exclude_from_layer_adaptation):
        w_norm, g_norm = np.linalg.norm(p), np.linalg.norm(update)
        ratio = w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0
      p -= ratio * lr_t * update
    self.iterations += 1
