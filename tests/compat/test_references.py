"""The NumPy references against the libraries' recorded trajectories, and by their properties.

timm, torch_optimizer, Keras and TF Addons: each reference reproduces its library's goldens
(recorded by record_goldens.py) within GOLDEN_RTOL of each leaf's largest value, after step 1
and after the last step. apex and DeepSpeed need CUDA: their references are checked against the
timm and torch_optimizer references where the formulas coincide, and against one-step hand
derivations where they do not. The problem must tell the flavours apart: choices that differ
give differences far above GOLDEN_RTOL.
"""

from __future__ import annotations

import json
from pathlib import Path

import cases
import numpy as np
import problem
import pytest
import run_references
from references import apex, deepspeed, keras, tfa, timm, torch_optimizer

GOLDENS = Path(__file__).resolve().parent / "goldens"
GOLDEN_RTOL = 1e-5  # float32 libraries against float64 references
SAME_RTOL = 1e-12  # two float64 references of one formula
DIFFERENT_RTOL = 1e-3  # one formula choice apart


def worst_difference(actual: dict, expected: dict) -> tuple[float, str]:
  """Largest |actual - expected| over each leaf's largest |expected|, and the leaf it is on."""
  worst, where = 0.0, ""
  for name, want in expected.items():
    scale = max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)
    diff = float(np.max(np.abs(np.asarray(actual[name], np.float64) - want))) / scale
    if diff >= worst:
      worst, where = diff, name
  return worst, where


def _golden(library: str):
  arrays = np.load(GOLDENS / f"{library}.npz")
  meta = json.loads((GOLDENS / f"{library}.json").read_text())
  return arrays, meta


GOLDEN_CASES = [(lib, case) for lib in cases.RECORDED for case in cases.CASES[lib]]


@pytest.mark.parametrize("library", cases.RECORDED)
def test_goldens_are_recorded_from_the_current_cases(library):
  _, meta = _golden(library)
  assert meta["cases"] == json.loads(json.dumps(cases.CASES[library])), (
    f"{library}: cases.py changed since the goldens were recorded; run record_goldens.py"
  )
  assert meta["steps"] == problem.STEPS
  assert meta["scheduled"] == sorted(cases.SCHEDULED.get(library, ()))


@pytest.mark.parametrize("library,case", GOLDEN_CASES)
def test_reference_reproduces_library(library, case):
  arrays, _ = _golden(library)
  reference = run_references.trajectory(library, case)
  for when, params in reference.items():
    recorded = {name: arrays[f"{case}/{when}/{name}"] for name in problem.NAMES}
    worst, leaf = worst_difference(recorded, params)
    print(f"{library} {case} {when}: worst {worst:.2e} on {leaf}")
    assert worst <= GOLDEN_RTOL, f"{library} {case} after {when}: {worst:.2e} on {leaf}"


_REFERENCE_CLASSES = {
  "apex": lambda **kw: apex.FusedLAMB(problem.initial_params(), **kw),
  "deepspeed": lambda **kw: deepspeed.FusedLamb(problem.initial_params(), **kw),
  "timm": lambda **kw: timm.Lamb(problem.initial_params(), **kw),
  "torch_optimizer": lambda **kw: torch_optimizer.Lamb(problem.initial_params(), **kw),
  "keras": lambda **kw: keras.Lamb(problem.initial_params(), **kw),
  "tfa": lambda **kw: tfa.LAMB(problem.initial_params(), **kw),
}
_REFUSED_FROM_SOURCE = {"apex": "RuntimeError", "deepspeed": "RuntimeError"}  # amsgrad=True


@pytest.mark.parametrize(
  "library,name", [(lib, name) for lib in cases.REFUSED for name in cases.REFUSED[lib]]
)
def test_reference_refuses_what_library_refuses(library, name):
  if library in cases.RECORDED:
    expected = _golden(library)[1]["refused"][name]
  else:
    expected = _REFUSED_FROM_SOURCE[library] if name == "amsgrad" else "TypeError"
  assert expected != "accepted", f"{library} accepts {cases.REFUSED[library][name]}"
  with pytest.raises(Exception) as error:  # noqa: B017 (the class is compared by name below)
    _REFERENCE_CLASSES[library](**cases.REFUSED[library][name])
  assert type(error.value).__name__ == expected


# --- the problem tells the flavours apart -------------------------------------------------------

# library: {case: that library's cases one formula choice away from it}. timm: "decoupled" decays
# outside the ratio, before the step ("decay": inside it); DeepSpeed: "no_bias_correction" drops
# the bias correction it applies on the step size.
_ONE_CHOICE_APART = {
  "timm": {
    "decay": ("decoupled", "no_averaging", "caution", "always_adapt_trust_clip", "no_clip"),
    "decoupled": ("decoupled_corrected_warmup",),
  },
  "apex": {"decay": ("l2", "nvlamb")},
  "deepspeed": {"decay": ("eps_inside_sqrt", "no_bias_correction", "unclamped", "tight_clamps")},
  "torch_optimizer": {"decay": ("debias", "clamp_1", "adam")},
  "keras": {"decay": ("global_clip5",), "defaults": ("decay",)},
  "tfa": {"decay": ("separate_adaptation", "no_exclusions")},
}
# (library, case, library, case): one formula choice apart
DIFFERENT = [
  (library, case, library, other)
  for library, apart in _ONE_CHOICE_APART.items()
  for case, others in apart.items()
  for other in others
] + [
  ("tfa", "decay", "keras", "decay"),  # excluded leaves adapt / not; decay inside the ratio / not
  ("timm", "no_clip", "tfa", "no_exclusions"),  # adapts only decayed leaves / every leaf
]


@pytest.mark.parametrize("lib_a,case_a,lib_b,case_b", DIFFERENT)
def test_problem_tells_choices_apart(lib_a, case_a, lib_b, case_b):
  a = run_references.trajectory(lib_a, case_a)["final"]
  b = run_references.trajectory(lib_b, case_b)["final"]
  worst, leaf = worst_difference(a, b)
  assert worst > DIFFERENT_RTOL, f"{lib_a} {case_a} vs {lib_b} {case_b}: only {worst:.1e} on {leaf}"


# --- apex, by its properties --------------------------------------------------------------------


def _run(optimizer, steps: int | None = None, deepspeed_norms: bool = False) -> dict:
  for grads in problem.gradients()[:steps]:
    if deepspeed_norms:
      optimizer.step(grads, grad_norms=cases.deepspeed_grad_norms(grads))
    else:
      optimizer.step(grads)
  return optimizer.params


def _first_step():
  """The initial params and the first gradients, in float64."""
  params, grads = problem.initial_params(), problem.gradients()[0]
  return (
    {n: p.astype(np.float64) for n, p in params.items()},
    {n: g.astype(np.float64) for n, g in grads.items()},
  )


def _groups():
  return cases.torch_param_groups(problem.initial_params())


@pytest.mark.parametrize("case", [c for c in cases.APEX if c != "l2"])
def test_apex_equals_timm_where_options_coincide(case):
  """timm's Lamb is written after apex's FusedLAMB: adam_w_mode=True, use_nvlamb = always_adapt."""
  kwargs = dict(cases.APEX[case])
  timm_kwargs = {("always_adapt" if k == "use_nvlamb" else k): v for k, v in kwargs.items()}
  worst, leaf = worst_difference(
    _run(apex.FusedLAMB(_groups(), **kwargs)), _run(timm.Lamb(_groups(), **timm_kwargs))
  )
  assert worst <= SAME_RTOL, f"{case}: {worst:.1e} on {leaf}"


def _clip_divisor_apex(grads, max_grad_norm):
  norm = problem.global_norm(grads)
  return norm / max_grad_norm if norm > max_grad_norm else 1.0


def test_apex_l2_mode_first_step_by_hand():
  """adam_w_mode=False: the decay joins the clipped gradient before the moments (step 1)."""
  lr, wd, eps = 0.01, 0.1, 1e-6
  params, grads = _first_step()
  clip = _clip_divisor_apex(grads, 1.0)
  expected = {}
  for name, p in params.items():
    decay = wd if name in problem.DECAYED else 0.0
    g = grads[name] / clip + decay * p
    u = g / (np.abs(g) + eps)  # m_hat = g and v_hat = g^2 at step 1
    ratio = lr * np.linalg.norm(p) / np.linalg.norm(u) if decay and np.any(p) else lr
    expected[name] = p - ratio * u
  opt = apex.FusedLAMB(_groups(), lr=lr, weight_decay=wd, adam_w_mode=False, eps=eps)
  worst, leaf = worst_difference(_run(opt, steps=1), expected)
  assert worst <= SAME_RTOL, f"{worst:.1e} on {leaf}"


def test_apex_without_nvlamb_does_not_adapt_undecayed_leaves():
  """Step 1 of the undecayed group is plain lr * u, u = g / (|g| + eps), whatever ||p||."""
  params, grads = _first_step()
  clip = _clip_divisor_apex(grads, 1.0)
  after = _run(apex.FusedLAMB(_groups(), lr=0.01), steps=1)
  for name in problem.NOT_DECAYED:
    g = grads[name] / clip
    expected = params[name] - 0.01 * g / (np.abs(g) + 1e-6)
    np.testing.assert_allclose(after[name], expected, rtol=SAME_RTOL, atol=0)


def test_apex_max_grad_norm_none_fails_at_the_kernel_call():
  opt = apex.FusedLAMB(_groups(), max_grad_norm=None)
  with pytest.raises(TypeError, match="max_grad_norm"):
    opt.step(problem.gradients()[0])


# --- DeepSpeed, by its properties ---------------------------------------------------------------

_UNCLAMPED = {"max_coeff": np.inf, "min_coeff": 0.0}


@pytest.mark.parametrize("bias_correction", [False, True])
def test_deepspeed_equals_torch_optimizer_without_clamps(bias_correction):
  """Both: no bias correction inside u, decay inside the ratio, bias correction on the step."""
  common = {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-6}
  ours = deepspeed.FusedLamb(_groups(), bias_correction=bias_correction, **common, **_UNCLAMPED)
  theirs = torch_optimizer.Lamb(_groups(), clamp_value=np.inf, debias=bias_correction, **common)
  worst, leaf = worst_difference(_run(ours), _run(theirs))
  assert worst <= SAME_RTOL, f"{worst:.1e} on {leaf}"


def _deepspeed_first_step(eps_inside_sqrt, clip_norm, min_coeff, max_coeff):
  lr, wd, eps, b1, b2 = 0.01, 0.1, 1e-8, 0.9, 0.999
  params, grads = _first_step()
  norm = problem.global_norm(grads)
  divisor = max((norm + 1e-6) / clip_norm, 1.0) if clip_norm > 0 else 1.0
  step_size = lr * np.sqrt(1 - b2) / (1 - b1)
  expected = {}
  for name, p in params.items():
    g = grads[name] / divisor
    m, v = (1 - b1) * g, (1 - b2) * g * g
    denom = np.sqrt(v + eps) if eps_inside_sqrt else np.sqrt(v) + eps
    decay = wd if name in problem.DECAYED else 0.0
    u = m / denom + decay * p
    w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(u)
    coeff = np.clip(w_norm / u_norm, min_coeff, max_coeff) if w_norm and u_norm else 1.0
    expected[name] = p - step_size * coeff * u
  opt = deepspeed.FusedLamb(
    _groups(),
    lr=lr,
    weight_decay=wd,
    eps_inside_sqrt=eps_inside_sqrt,
    max_grad_norm=clip_norm,
    min_coeff=min_coeff,
    max_coeff=max_coeff,
  )
  return _run(opt, steps=1, deepspeed_norms=True), expected, opt.lamb_coeffs


@pytest.mark.parametrize(
  "eps_inside_sqrt,clip_norm,min_coeff,max_coeff",
  [(True, 0.0, 0.01, 10.0), (False, 5.0, 0.01, 10.0), (False, 0.0, 0.05, 0.2)],
)
def test_deepspeed_first_step_by_hand(eps_inside_sqrt, clip_norm, min_coeff, max_coeff):
  after, expected, _ = _deepspeed_first_step(eps_inside_sqrt, clip_norm, min_coeff, max_coeff)
  worst, leaf = worst_difference(after, expected)
  assert worst <= SAME_RTOL, f"{worst:.1e} on {leaf}"


def test_deepspeed_leaves_zero_norm_coefficients_unclamped():
  """With clamps [0.05, 0.2] the zero-initialised leaf still gets coefficient 1 at step 1."""
  _, _, coeffs = _deepspeed_first_step(False, 0.0, 0.05, 0.2)
  names = list(problem.DECAYED) + list(problem.NOT_DECAYED)  # the order of the groups
  by_name = dict(zip(names, coeffs, strict=True))
  assert by_name["encoder/bias"] == 1.0
  assert all(0.05 <= c <= 0.2 for n, c in by_name.items() if n != "encoder/bias")


def test_deepspeed_clipping_needs_grad_norms():
  opt = deepspeed.FusedLamb(_groups(), max_grad_norm=1.0)
  with pytest.raises(TypeError):
    opt.step(problem.gradients()[0])


def test_deepspeed_bare_group_norm_updates_only_the_groups_first_parameter():
  """A number instead of a list for a group: zip stops after the first parameter."""
  grads = problem.gradients()[0]
  opt = deepspeed.FusedLamb(_groups(), max_grad_norm=1.0)
  opt.step(grads, grad_norms=[problem.global_norm(grads)] * 2)
  initial = problem.initial_params()
  moved = {n for n in problem.NAMES if not np.array_equal(opt.params[n], initial[n])}
  assert moved == {problem.DECAYED[0], problem.NOT_DECAYED[0]}
