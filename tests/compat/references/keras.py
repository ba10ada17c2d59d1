"""keras.optimizers.Lamb (Keras 3) as float64 NumPy.

Transcribed from keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60 (the files
are identical in the keras 3.15.1 wheel):
  keras/src/optimizers/lamb.py            lines 38-72 (__init__), 89-132 (update_step)
  keras/src/optimizers/base_optimizer.py  lines 68-138 (BaseOptimizer.__init__: one clip option
                                          at most), 168-193 (learning_rate: float, schedule or
                                          callable), 466-533 (apply), 535-594 (the order: clip,
                                          decay, update), 777-786 (the current learning rate),
                                          870-881 (_clip_gradients), 883-959 (weight decay and
                                          its exclusions), 1108-1119 (_clip_by_norm),
                                          1181-1197 (clip_by_global_norm)
  keras/src/backend/jax/optimizer.py      lines 15-85 (JaxOptimizer: the same order under jax)

Per call of apply(grads), with t = iterations + 1 and lr the learning rate at `iterations`
(a LearningRateSchedule is called with the 0-based iteration count; here: a callable(step)):

  clip (at most one): clipnorm: g <- g c / max(||g||, c) per variable;
                      global_clipnorm: g <- g min(1, c / ||g||_global); clipvalue: clip(g, -c, c)
  decay (weight_decay not None, variable not excluded):  p <- p - p weight_decay lr
                      (every variable first, before any update: outside the trust ratio, and
                      ||p|| below is the decayed one)
  m  <- m + (g - m)(1 - beta_1),   v <- v + (g^2 - v)(1 - beta_2)
  u   = (m / (1 - beta_1^t)) / (sqrt(v / (1 - beta_2^t)) + epsilon)    the powers take beta cast
        to the variable's dtype (float32: 0.999 -> 0.99900001), the moments the Python float; so
        for float32 variables 1 - beta_2^1 is 1.3e-5 off 1 - beta_2, and the first update of a
        leaf 6e-6 off. This reference keeps each variable's dtype for that cast only.
  r   = ||p|| / ||u|| (1 if either is 0)       every variable adapts
  p  <- p - r lr u

exclude_from_weight_decay(var_list, var_names): var_names are joined into one regex
'|'.join(set(var_names)) and re.search'ed in the variable's *name* (its last path component:
'bias', not 'dense/bias'); var_list excludes variables by identity (here: by path). It must be
called before the optimizer is built (ValueError). Refused: a learning_rate that is neither a
float, a schedule nor a callable (an int: ValueError); more than one clip option (ValueError);
an unknown keyword (ValueError, not TypeError). `decay` is accepted, warned about and ignored.
"""

from __future__ import annotations

import re
import warnings

import numpy as np

# BaseOptimizer arguments this reference leaves out.
_UNMODELLED = {
  "use_ema",
  "ema_momentum",
  "ema_overwrite_frequency",
  "loss_scale_factor",
  "gradient_accumulation_steps",
}


class Lamb:
  """keras.optimizers.Lamb on `variables`, a dict path -> array (names: the last component).

  Computes in float64; each variable's own dtype only rounds the betas of the bias corrections.
  """

  def __init__(self, variables, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
               weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, name=None,
               **kwargs):  # fmt: skip
    if kwargs.pop("decay", None) is not None:
      warnings.warn("Argument `decay` is no longer supported and will be ignored.", stacklevel=2)
    unmodelled = _UNMODELLED & kwargs.keys()
    if unmodelled:
      raise NotImplementedError(f"this reference does not model {sorted(unmodelled)}")
    if kwargs:
      raise ValueError(f"Argument(s) not recognized: {kwargs}")
    if not callable(learning_rate) and not isinstance(learning_rate, float):
      raise ValueError(
        "Argument `learning_rate` should be float, or an instance of LearningRateSchedule, "
        f"or a callable. Received instead: learning_rate={learning_rate}"
      )
    if sum(a is not None for a in (clipnorm, clipvalue, global_clipnorm)) > 1:
      raise ValueError(
        "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
        f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
      )
    self._learning_rate = learning_rate
    self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
    self.weight_decay = weight_decay
    self.clipnorm, self.clipvalue, self.global_clipnorm = clipnorm, clipvalue, global_clipnorm
    self.params = {name: np.array(value, np.float64) for name, value in variables.items()}
    self.dtypes = {name: np.asarray(value).dtype for name, value in variables.items()}
    self.iterations = 0
    self.built = False
    self._excluded_paths: set[str] = set()
    self._excluded_pattern = None

  @property
  def learning_rate(self) -> float:
    if callable(self._learning_rate):
      return float(self._learning_rate(self.iterations))
    return self._learning_rate

  def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
    """var_list: paths excluded by identity; var_names: substrings/regexes of variable names."""
    if self.built:
      raise ValueError(
        "`exclude_from_weight_decay()` can only be configured before the optimizer is built."
      )
    self._excluded_paths = set(var_list or ())
    self._excluded_pattern = re.compile("|".join(set(var_names))) if var_names else None

  def _use_weight_decay(self, path: str) -> bool:
    if path in self._excluded_paths:
      return False
    name = path.rsplit("/", 1)[-1]
    return not (self._excluded_pattern is not None and self._excluded_pattern.search(name))

  def _clip_gradients(self, grads):
    if self.clipnorm and self.clipnorm > 0:
      return {
        n: g * self.clipnorm / max(np.linalg.norm(g), self.clipnorm) for n, g in grads.items()
      }
    if self.global_clipnorm and self.global_clipnorm > 0:
      norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
      with np.errstate(divide="ignore"):
        scale = self.global_clipnorm * min(1.0 / norm, 1.0 / self.global_clipnorm)
      return {n: g * scale for n, g in grads.items()}
    if self.clipvalue and self.clipvalue > 0:
      return {n: np.clip(g, -self.clipvalue, self.clipvalue) for n, g in grads.items()}
    return grads

  def apply(self, grads: dict) -> None:
    """One optimizer step: clip, decay every variable, then each variable's LAMB update."""
    if not self.built:
      self.m = {n: np.zeros_like(p) for n, p in self.params.items()}
      self.v = {n: np.zeros_like(p) for n, p in self.params.items()}
      self.built = True
    grads = self._clip_gradients({n: np.asarray(g, np.float64) for n, g in grads.items()})
    lr = self.learning_rate
    if self.weight_decay is not None:
      for name, p in self.params.items():
        if self._use_weight_decay(name):
          p -= p * self.weight_decay * lr
    t = self.iterations + 1
    for name, g in grads.items():
      p, m, v = self.params[name], self.m[name], self.v[name]
      m += (g - m) * (1 - self.beta_1)
      v += (g * g - v) * (1 - self.beta_2)
      # ops.power(ops.cast(beta, variable.dtype), t): the powers use beta in the variable's dtype
      beta_1, beta_2 = (float(np.asarray(b, self.dtypes[name])) for b in (self.beta_1, self.beta_2))
      update = (m / (1.0 - beta_1**t)) / (np.sqrt(v / (1.0 - beta_2**t)) + self.epsilon)
      w_norm, g_norm = np.linalg.norm(p), np.linalg.norm(update)
      ratio = w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0
      p -= ratio * lr * update
    self.iterations += 1
