"""The option sets each library is recorded and checked with: name -> that library's kwargs.

Every case runs on tests/compat/problem.py for problem.STEPS steps, with its two parameter
groups expressed the way each library expresses them:

  torch libraries  [{'params': DECAYED}, {'params': NOT_DECAYED, 'weight_decay': 0.0}]
                   (`torch_param_groups`); the constructor's weight_decay applies to the first
  Keras            opt.exclude_from_weight_decay(var_names=problem.NOT_DECAYED_KERAS_NAMES)
  TF Addons        the case's own exclude_from_weight_decay (a constructor argument)

Cases listed in SCHEDULED[library] follow problem.lr_factor: torch libraries get
group['lr'] = lr * lr_factor(t) before step t (t from 0), as a scheduler would set it; Keras
gets a LearningRateSchedule returning learning_rate * lr_factor(iteration). "defaults" runs
the library's own defaults (its lr included). apex and DeepSpeed need CUDA: their cases run on
the NumPy references only (for DeepSpeed, step() is passed the global gradient norm for every
parameter, see `deepspeed_grad_norms`).
"""

from __future__ import annotations

import problem

LR = 0.01
WD = 0.1

APEX = {
  "defaults": {},
  "decay": {"lr": LR, "weight_decay": WD},
  "l2": {"lr": LR, "weight_decay": WD, "adam_w_mode": False},
  "nvlamb": {"lr": LR, "weight_decay": WD, "use_nvlamb": True},
  "no_averaging": {"lr": LR, "weight_decay": WD, "grad_averaging": False},
  "no_bias_correction_clip5": {"lr": LR, "bias_correction": False, "max_grad_norm": 5.0},
  "clip_zero": {"lr": LR, "max_grad_norm": 0.0},
}

DEEPSPEED = {
  "defaults": {},
  "decay": {"lr": LR, "weight_decay": WD},
  "eps_inside_sqrt": {"lr": LR, "weight_decay": WD, "eps_inside_sqrt": True},
  "no_bias_correction": {"lr": LR, "weight_decay": WD, "bias_correction": False},
  "clip5": {"lr": LR, "max_grad_norm": 5.0},
  "unclamped": {"lr": LR, "weight_decay": WD, "max_coeff": 1e30, "min_coeff": 0.0},
  "tight_clamps": {"lr": LR, "weight_decay": WD, "max_coeff": 0.2, "min_coeff": 0.05},
}

TIMM = {
  "defaults": {},
  "decay": {"lr": LR, "weight_decay": WD},
  "no_clip": {"lr": LR, "weight_decay": WD, "max_grad_norm": None},
  "clip5_no_bias_correction": {"lr": LR, "max_grad_norm": 5.0, "bias_correction": False},
  "no_averaging": {"lr": LR, "weight_decay": WD, "grad_averaging": False},
  "always_adapt_trust_clip": {
    "lr": LR,
    "weight_decay": WD,
    "always_adapt": True,
    "trust_clip": True,
  },
  "caution": {"lr": LR, "weight_decay": WD, "caution": True},
  "decoupled": {"lr": LR, "weight_decay": WD, "decoupled_decay": True},
  "decoupled_corrected_warmup": {
    "lr": LR,
    "weight_decay": WD,
    "decoupled_decay": True,
    "corrected_weight_decay": True,
  },
  "clip_zero": {"lr": LR, "max_grad_norm": 0.0},
}

TORCH_OPTIMIZER = {
  "defaults": {},
  "decay": {"lr": LR, "weight_decay": WD},
  "debias": {"lr": LR, "weight_decay": WD, "debias": True},
  "clamp_1": {"lr": LR, "weight_decay": WD, "clamp_value": 1.0},
  "adam": {"lr": LR, "weight_decay": WD, "adam": True},
}

KERAS = {
  "defaults": {},
  "decay": {"learning_rate": LR, "weight_decay": WD},
  "global_clip5": {"learning_rate": LR, "weight_decay": WD, "global_clipnorm": 5.0},
  "decay_warmup": {"learning_rate": LR, "weight_decay": WD},
}

TFA = {
  "defaults": {},
  "decay": {
    "learning_rate": LR,
    "weight_decay": WD,
    "exclude_from_weight_decay": list(problem.NOT_DECAYED_REGEXES),
  },
  "separate_adaptation": {
    "learning_rate": LR,
    "weight_decay": WD,
    "exclude_from_weight_decay": list(problem.NOT_DECAYED_REGEXES),
    "exclude_from_layer_adaptation": ["temperature"],
  },
  "no_exclusions": {"learning_rate": LR, "weight_decay": WD},
  "lr_alias_clipnorm1": {"lr": LR, "clipnorm": 1.0},
  "global_clip5_lr_decay": {"learning_rate": LR, "global_clipnorm": 5.0, "decay": 0.05},
}

# Constructor arguments each library refuses: name -> kwargs. The recording script records the
# exception class each library raises; apex and DeepSpeed (amsgrad=True: RuntimeError) from source.
REFUSED = {
  "apex": {"amsgrad": {"amsgrad": True}, "unknown_argument": {"clamp_value": 10}},
  "deepspeed": {"amsgrad": {"amsgrad": True}, "unknown_argument": {"trust_clip": True}},
  "timm": {
    "negative_lr": {"lr": -1.0},
    "negative_eps": {"eps": -1e-6},
    "negative_weight_decay": {"weight_decay": -0.1},
    "unknown_argument": {"clamp_value": 10},
  },
  "torch_optimizer": {
    "zero_lr": {"lr": 0.0},
    "beta_one": {"betas": (1.0, 0.999)},
    "negative_clamp_value": {"clamp_value": -1.0},
    "unknown_argument": {"max_grad_norm": 1.0},
  },
  "keras": {
    "int_learning_rate": {"learning_rate": 1},
    "two_clips": {"clipnorm": 1.0, "global_clipnorm": 1.0},
    "unknown_argument": {"weight_decay_mask": None},
  },
  "tfa": {
    "zero_epsilon": {"epsilon": 0.0},
    "negative_lr_alias": {"lr": -1.0},
    "two_clips": {"clipnorm": 1.0, "global_clipnorm": 1.0},
    "unknown_argument": {"max_grad_norm": 1.0},
  },
}

CASES = {
  "apex": APEX,
  "deepspeed": DEEPSPEED,
  "timm": TIMM,
  "torch_optimizer": TORCH_OPTIMIZER,
  "keras": KERAS,
  "tfa": TFA,
}
SCHEDULED = {"timm": {"decoupled_corrected_warmup"}, "keras": {"decay_warmup"}}
TORCH_LIBRARIES = ("apex", "deepspeed", "timm", "torch_optimizer")
# Recorded from the libraries themselves (they run on a CPU); apex and DeepSpeed need CUDA.
RECORDED = ("timm", "torch_optimizer", "keras", "tfa")


def torch_param_groups(params: dict) -> list[dict]:
  """The problem's two groups, torch style: the second one has weight_decay 0."""
  return [
    {"params": {n: params[n] for n in problem.DECAYED}},
    {"params": {n: params[n] for n in problem.NOT_DECAYED}, "weight_decay": 0.0},
  ]


def deepspeed_grad_norms(grads: dict) -> list[list[float]]:
  """FusedLamb.step's grad_norms: the global gradient norm for every parameter of each group."""
  norm = problem.global_norm(grads)
  return [[norm] * len(problem.DECAYED), [norm] * len(problem.NOT_DECAYED)]


def scheduled_lr(library: str, case: str, base_lr: float, step: int) -> float:
  """The learning rate of step `step` (0-based) for this case."""
  factor = problem.lr_factor(step) if case in SCHEDULED.get(library, ()) else 1.0
  return base_lr * factor
