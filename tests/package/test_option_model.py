"""One option model: lamb's configuration is built (and checked) in one place, its fields are typed,
and a hyper-parameter's name changes on its way into a step in one table only."""

import ast
import dataclasses
from pathlib import Path

import optax_lamb
from optax_lamb.core._config import STEP_SCALAR_NAMES, Hyperparams, LambConfig, PerLeafOptions
from optax_lamb.core._options import LambOptions, StepScalars
from optax_lamb.faults import _check_args
from optax_lamb.step._plan import given_scalars

PACKAGE = Path(optax_lamb.__file__).resolve().parent


def test_the_rename_table_maps_hyperparams_onto_step_scalars():
  assert set(STEP_SCALAR_NAMES) <= set(Hyperparams._fields), STEP_SCALAR_NAMES
  assert set(STEP_SCALAR_NAMES.values()) <= set(StepScalars._fields), STEP_SCALAR_NAMES
  # Distinct values, so that a field read under another one's name shows.
  numbers = dict(b1=0.11, b2=0.22, eps=0.33, eps_root=0.44, min_trust_ratio=0.55)
  numbers.update(max_trust_ratio=5.5, max_param_norm=6.6)
  config = _check_args.lamb_config(learning_rate=1e-3, **numbers)
  scalars = given_scalars(config)
  for name, scalar in STEP_SCALAR_NAMES.items():
    assert getattr(scalars, scalar) == numbers[name], (name, scalar)


def test_the_configuration_is_built_in_one_place():
  """`LambConfig.of` (fields unchecked) is called by `_check_args.lamb_config` alone."""
  callers = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "of" and getattr(node.func.value, "id", None) == "LambConfig":
          callers.append(str(path.relative_to(PACKAGE)))
  assert callers == ["faults/_check_args.py"], callers


def test_no_option_field_is_typed_any():
  fields = [*dataclasses.fields(LambOptions), *dataclasses.fields(PerLeafOptions)]
  annotations = {f.name: str(f.type) for f in fields}
  annotations.update((k, str(v)) for k, v in Hyperparams.__annotations__.items())
  annotations.update((k, str(v)) for k, v in LambConfig.__annotations__.items())
  untyped = {k: v for k, v in annotations.items() if "Any" in v}
  assert not untyped, untyped
