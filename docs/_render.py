"""Markdown rendered from committed results: benchmarks (`benchmarks/results/*.json`), the
recipe's claim study (`notebooks/results/study.json`), its random search (`search.json`), the
searched settings trained longer (`budget.json`), the search past the plateau (`past_plateau.json`),
the replay of the diverged run (`divergence.json`) and 8-bit against float32 moments
(`moments8.json`).

The docs build writes `benchmark_tables` into the benchmarks page. The README and the pages in
`benchmark_blocks` and `_recipe_blocks` hold blocks between `<!-- NAME: python -m docs._render -->`
and `<!-- end NAME -->` markers; `python -m docs._render` rewrites them, and tests keep them equal
to a fresh render (the benchmark blocks in a fast test). Every ratio to the bandwidth floor is
computed here from the results' own `floor_bytes_per_param` (`traffic`).
"""

from __future__ import annotations

import glob
import json
import os

_IMPLEMENTATIONS = {
  "optax.lamb": "`optax.lamb`",
  "optax_lamb.lamb": "`optax_lamb.lamb`",
  "update_and_apply": "`update_and_apply`",
  "xla.lamb": "`optax_lamb.lamb` (xla)",
  "optax_lamb.lamb-bf16": "`optax_lamb.lamb`, bf16 moments",
}


def _load(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _ms(result: dict, key: str) -> float | None:
  """A time in ms (`device_ms`, `e2e_ms`), None where the file does not have it."""
  return result.get(key)


def _fmt(x: float | None, digits: int = 2) -> str:
  if x is None:
    return "not measured"
  return f"{x:.{digits}f}" if x < 100 else f"{x:.0f}"


def _source(report: dict, path: str) -> str:
  date = str(report.get("date", "undated"))[:10]
  # A GPU's kind ("NVIDIA H200"); a CPU's model and cores (its device_kind is just "cpu").
  gpu = report.get("backend") == "gpu"
  device = (report.get("device_kind") if gpu else None) or report.get("device", "?")
  versions = f"jax {report.get('jax', '?')}, optax {report.get('optax', '?')}"
  commit = (
    f"commit {report['commit']}" if report.get("commit") else "commit not recorded in the file"
  )
  return f"{device}, {versions}, {date}, {commit} (`benchmarks/results/{os.path.basename(path)}`)"


def _ratio(result: dict, optax: dict, key: str) -> str:
  """`result`'s time over optax.lamb's (under 1: faster), or "" where either is missing."""
  ours, base = _ms(result, key), _ms(optax, key)
  return f"{ours / base:.2f}x" if ours is not None and base else ""


def case_table(report: dict) -> str:
  """One row per (tree, implementation): times, ratio to optax.lamb, temporaries."""
  rows = [
    "| tree | params | implementation | device ms | end-to-end ms | device vs optax.lamb "
    "| end to end vs optax.lamb | temporaries MB |",
    "|---|---:|---|---:|---:|---:|---:|---:|",
  ]
  for name, case in report["cases"].items():
    optax = case["results"].get("optax.lamb", {})
    for impl, r in case["results"].items():
      if "error" in r:
        rows.append(f"| {name} | | {_IMPLEMENTATIONS.get(impl, impl)} | error | | | | |")
        continue
      ratios = [_ratio(r, optax, key) for key in ("device_ms", "e2e_ms")]
      temp = r.get("memory", {}).get("temp_bytes")
      rows.append(
        f"| {name} | {case['params'] / 1e6:.1f}M | {_IMPLEMENTATIONS.get(impl, impl)} "
        f"| {_fmt(_ms(r, 'device_ms'))} | {_fmt(_ms(r, 'e2e_ms'))} | {ratios[0]} | {ratios[1]} "
        f"| {'' if temp is None else f'{temp / 1e6:.0f}'} |"
      )
  return "\n".join(rows)


def benchmark_tables(results_dir: str) -> str:
  """Every committed step benchmark file: where and when it was measured, then its table (the
  compile-time file, rendered into docs/benchmarks.md, has no per-tree cases)."""
  parts = []
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    report = _load(path)
    if "cases" not in report:
      continue
    parts.append(f"## {_source(report, path)}\n")
    if report.get("note"):
      parts.append(report["note"] + "\n")
    parts.append(case_table(report) + "\n")
  return "\n".join(parts)


def _latest_gpu_file(results_dir: str) -> str:
  """The GPU results file measured last (by date, then name) among those that record a commit."""
  paths = [
    p
    for p in glob.glob(os.path.join(results_dir, "*.json"))
    if _load(p).get("backend") == "gpu" and _load(p).get("commit")
  ]
  return max(paths, key=lambda p: (str(_load(p).get("date")), p))


def traffic(results_dir: str, name: str, tree: str, implementations: tuple[str, ...]) -> str:
  """One sentence: the bytes per parameter that `implementations` moved on `tree` (device time x
  the copy bandwidth measured in the same run / params), as multiples of the file's single-pass
  floor (`floor_bytes_per_param`: read g, m, v, p and write m, v, p once, float32)."""
  report = _load(os.path.join(results_dir, name))
  case = report["cases"][tree]
  floor = report["floor_bytes_per_param"]
  bandwidth = case.get("bandwidth_gbps", report["bandwidth_gbps"])
  moved = [
    f"{_IMPLEMENTATIONS.get(impl, impl)} {_fmt(case['results'][impl]['device_ms'])} ms, "
    f"{case['results'][impl]['bytes_per_param']:.1f} B/param "
    f"({case['results'][impl]['bytes_per_param'] / floor:.2f}x the floor)"
    for impl in implementations
  ]
  speed = f"{bandwidth / 1e3:.2f} TB/s" if bandwidth >= 1e3 else f"{bandwidth:.1f} GB/s"
  return (
    f"Device-only on {tree} at the {speed} copy bandwidth measured in the same "
    f"run (`benchmarks/results/{name}`), against the {floor} B/param single-pass floor (read g, m, "
    f"v, p and write m, v, p once, float32): " + "; ".join(moved) + "."
  )


def _device_name(report: dict) -> str:
  """The device column of the README's table: a GPU's kind, "CPU" for a CPU."""
  return report.get("device_kind", "GPU") if report.get("backend") == "gpu" else "CPU"


def headline(results_dir: str) -> str:
  """The README's figures: BERT-base and BERT-large, optax.lamb against `lamb` and
  `update_and_apply`, device-only and end to end, on the CPU file and the latest GPU file (where
  `lamb`, `auto`, takes the Pallas kernels), then the GPU's bytes moved against the floor."""
  keys = ("device_ms", "e2e_ms")
  files = [os.path.join(results_dir, "cpu-2core.json"), _latest_gpu_file(results_dir)]
  reports = [_load(path) for path in files]
  runs = sorted({report["runs"] for report in reports})
  rows = [
    "One jitted, donated step, device-only / end to end (ms, and the time as a multiple of "
    f"`optax.lamb`'s), median of {' or '.join(map(str, runs))} runs, on "
    + " and ".join(_source(r, p) for r, p in zip(reports, files, strict=True))
    + "; on the GPU `optax_lamb.lamb` (`auto`) takes the Pallas Triton kernels:",
    "",
    "| device, tree | `optax.lamb` | `optax_lamb.lamb` | `update_and_apply` |",
    "|---|---:|---:|---:|",
  ]
  for report in reports:
    for name in ("bert-base", "bert-large"):
      results = report["cases"][name]["results"]
      base = [_ms(results["optax.lamb"], k) for k in keys]
      cells = [" / ".join(_fmt(b) for b in base) + " ms"]
      for impl in ("optax_lamb.lamb", "update_and_apply"):
        times = [_ms(results[impl], k) for k in keys]
        ratios = " / ".join(f"{t / b:.2f}x" for t, b in zip(times, base, strict=True))
        cells.append(" / ".join(_fmt(t) for t in times) + f" ms ({ratios})")
      rows.append(f"| {_device_name(report)}, {name} | " + " | ".join(cells) + " |")
  gpu = os.path.basename(files[1])
  return "\n".join([*rows, "", traffic(results_dir, gpu, "bert-large", ("update_and_apply",))])


def study_summary(study_path: str) -> str:
  """The README's lines on the claim study: the paired differences (the README's text above the
  block says what the cells are), the verdicts and where they come from."""
  from optax_lamb_recipes import analysis

  results = _load(study_path)
  table = analysis.format_differences(results).split("\n\n", 1)[1]  # without its title
  return (
    table
    + "\n\nAt 95%: "
    + " ".join(analysis.findings(results))
    + f" {analysis.format_compute(results)} (`notebooks/results/{os.path.basename(study_path)}`)."
  )


def recipe_headline(plateau_path: str) -> str:
  """The recipe's first finding: LAMB against AdamW past the plateau (`plateau.verdict`)."""
  from optax_lamb_recipes import plateau

  return plateau.verdict(_load(plateau_path))


def study_report(study_path: str) -> str:
  """docs/recipe.md's tables: the paired differences, each arm's loss, the compute."""
  from optax_lamb_recipes import analysis

  results = _load(study_path)
  return analysis.format_report(results) + f"\n\n{analysis.format_compute(results)}."


def steps_to_target(study_path: str, table: bool) -> str:
  """The steps-to-target findings (and, with `table`, the table they come from)."""
  from optax_lamb_recipes import analysis

  results = _load(study_path)
  text = analysis.steps_findings(results)
  return analysis.format_steps_to_target(results) + "\n\n" + text if table else text


def search_summary(search_path: str, full: bool) -> str:
  """The random search: the paired table and its finding (with `full`: the chosen trials and
  the budget too)."""
  from optax_lamb_recipes import search

  results = _load(search_path)
  if full:
    return search.format_report(results) + "\n\nAt 95%: " + search.findings(results)
  return (
    search.format_table(results)
    + "\n\nAt 95%: "
    + search.findings(results)
    + _provenance(results, search_path)
  )


def _provenance(results: dict, path: str) -> str:
  """`` (N runs, M min wall, `notebooks/results/FILE`).``: where a README summary comes from."""
  return (
    f" ({len(results['runs'])} runs, {results['wall_seconds'] / 60:.0f} min wall, "
    f"`notebooks/results/{os.path.basename(path)}`)."
  )


def budget_summary(budget_path: str, full: bool) -> str:
  """The searched settings trained longer: the table and findings (with `full`: the compute)."""
  from optax_lamb_recipes import budget_report as budget

  results = _load(budget_path)
  if full:
    return budget.format_report(results)
  return (
    budget.format_table(results)
    + "\n\n"
    + " ".join(budget.findings(results))
    + _provenance(results, budget_path)
  )


# The layouts of the norms' block sums that the memory files measure (benchmarks/memory.py
# `--norm-blocks`), by the name each entry records, in the order the tables show them.
_NORM_LAYOUTS = {
  "rows": "the accelerators' layout (rows)",
  "columns": "the CPU backend's (columns)",
}
# The README's line: these configurations on BERT-base.
_MEMORY_SUMMARY = ("optax.lamb", "lamb", "lamb, skip_nonfinite",
                   "lamb, bfloat16 params, master weights", "update_and_apply, 8-bit moments")  # fmt: skip


def _memory_files(results_dir: str) -> dict[str, tuple[str, dict]]:
  """Norm layout -> (file name, results) of the committed memory files; each file holds one
  layout (every entry records it)."""
  found = {}
  for path in sorted(glob.glob(os.path.join(results_dir, "memory", "*.json"))):
    results = _load(path)
    layouts = {r["norm_blocks"] for t in results["trees"].values() for r in t.values()}
    if len(layouts) != 1 or layouts & found.keys():
      raise ValueError(f"{path}: one norm layout a file, one file a layout (found {layouts})")
    found[layouts.pop()] = (os.path.basename(path), results)
  return {layout: found[layout] for layout in _NORM_LAYOUTS if layout in found}


def _memory_source(files: dict[str, tuple[str, dict]]) -> str:
  """Where and when each layout was measured, run by run (a merged file holds several): the
  device and jax once where every run agrees."""
  from benchmarks import memory as bench

  jaxes = {r["versions"].get("jax", "?") for _, r in files.values()}
  devices = {device for _, r in files.values() for _, _, device in bench.runs(r)}
  each = [
    f"{layout}: "
    + ", ".join(
      f"commit {commit}, {date}" + ("" if len(devices) == 1 else f" ({device})")
      for commit, date, device in bench.runs(r)
    )
    + f", `benchmarks/results/memory/{name}`"
    for layout, (name, r) in files.items()
  ]
  common = (devices.pop() + ", " if len(devices) == 1 else "") + "jax " + " / ".join(sorted(jaxes))
  return f"{common}; " + "; ".join(each)


def memory(results_dir: str, full: bool) -> str:
  """The memory benchmark (benchmarks/memory.py), each norm layout measured: the table of every
  configuration (state bytes and temporaries), or the README's one-line summary."""
  files = _memory_files(results_dir)
  if not files:  # not committed: say so rather than print a number
    return "Memory: not measured at this commit (`python -m benchmarks.memory` writes it)."
  temps = lambda tree, config: [  # noqa: E731
    results["trees"].get(tree, {}).get(config, {}).get("temp_over_param_bytes")
    for _, results in files.values()
  ]
  cell = lambda xs: " / ".join("not measured" if x is None else f"{x:.4f}x" for x in xs)  # noqa: E731
  layouts = " / ".join(_NORM_LAYOUTS[layout] for layout in files)
  if not full:
    cells = ", ".join(f"`{c}` {cell(temps('bert-base', c))}" for c in _MEMORY_SUMMARY)
    return (
      "Compiled temporaries of one donated step on bert-base, as a multiple of the params' bytes, "
      f"with the norms summed in {layouts}: {cells} ({_memory_source(files)})."
    )
  first = next(iter(files.values()))[1]
  trees = list(first["trees"])
  rows = [
    f"Measured with {_memory_source(files)}. Temporaries as a multiple of the params' bytes, with "
    f"the norms summed in {layouts}; the state's bytes per parameter do not depend on the layout "
    "(one figure where the trees agree).",
    "",
    "| configuration | state B/param (device, host) | "
    + " | ".join(f"{t}: temporaries" for t in trees)
    + " |",
    "|---|---:|" + "---:|" * len(trees),
  ]
  for config in first["configurations"]:
    states = []  # each tree's, once where the trees agree
    for t in trees:
      r = first["trees"][t].get(config)
      state = "not measured" if r is None else (
        f"{r['state_device_bytes_per_param']:.2f}, {r['state_host_bytes_per_param']:.2f}")  # fmt: skip
      states += [] if state in states else [state]
    rows.append(
      f"| `{config}` | {' / '.join(states)} | "
      + " | ".join(cell(temps(t, config)) for t in trees)
      + " |"
    )
  return "\n".join(rows)


def compile_time(results_dir: str) -> str:
  """The compile-time benchmark (benchmarks/compile_time.py): its table, or that it is not
  measured (no number without its JSON)."""
  from benchmarks import compile_time as bench

  path = os.path.join(results_dir, "compile-cpu-2core.json")
  if not os.path.exists(path):
    return "Compile time: not measured at this commit (`python -m benchmarks.compile_time`)."
  results = _load(path)
  tree = next(iter(results["trees"]))
  return (
    f"Measured on {results['device']}, jax {results['versions'].get('jax', '?')}, commit "
    f"{results['commit']}, {results['date']}, {tree}, median of {results['repeats']} "
    f"interleaved rounds (`benchmarks/results/compile-cpu-2core.json`):\n\n"
    + bench.table(results, tree)
  )


def plateau_summary(plateau_path: str, full: bool) -> str:
  """The search past the plateau: the table and findings (with `full`: steps, trials, compute)."""
  from optax_lamb_recipes import plateau, search

  results = _load(plateau_path)
  if full:
    return plateau.format_report(results)
  return (
    search.format_table(results)
    + "\n\n"
    + " ".join(plateau.findings(results))
    + _provenance(results, plateau_path)
  )


def moments8_summary(moments8_path: str) -> str:
  """8-bit against float32 moments: the paired table, the findings and the compute."""
  from optax_lamb_recipes import moments8

  return moments8.format_report(_load(moments8_path))


def divergence_summary(divergence_path: str) -> str:
  """The replay of the diverged run: its findings and where they come from."""
  from optax_lamb_recipes import divergence

  results = _load(divergence_path)
  return (
    " ".join(divergence.findings(results))
    + f" ({results['wall_seconds'] / 60:.0f} min wall, "
    + f"`notebooks/results/{os.path.basename(divergence_path)}`)."
  )


# What each public symbol replaces in optax, where it has a counterpart (the API summary's last
# column; a symbol not listed here shows "none").
_OPTAX_EQUIVALENT = {
  "optax_lamb.lamb": "{py:obj}`optax.lamb` (first seven arguments)",
  "optax_lamb.update_and_apply": "`tx.update` + {py:obj}`optax.apply_updates`",
  "optax_lamb.scale_by_adam": "{py:obj}`optax.scale_by_adam`",
  "optax_lamb.add_decayed_weights": "{py:obj}`optax.add_decayed_weights`",
  "optax_lamb.scale_by_trust_ratio": "{py:obj}`optax.scale_by_trust_ratio`",
  "optax_lamb.clip_by_global_norm": "{py:obj}`optax.clip_by_global_norm`",
  "optax_lamb.skip_nonfinite": "{py:obj}`optax.apply_if_finite`",
  "optax_lamb.SkipNonFiniteState": "{py:obj}`optax.ApplyIfFiniteState`",
  "optax_lamb.ScaleByTrustRatioState": "{py:obj}`optax.ScaleByTrustRatioState` (which keeps no ratios)",
}


def _summary_line(obj: object) -> str:
  """The first paragraph of a docstring, its reST roles and literals written as MyST, and
  names relative to the package (``:func:`with_master_weights```) made absolute."""
  import inspect
  import re

  import optax_lamb

  doc = inspect.getdoc(obj) or ""
  text = " ".join(doc.split("\n\n")[0].split())

  def role(m: re.Match) -> str:
    kind, target = m.group(1), m.group(2)
    if kind != "math" and "." not in target and hasattr(optax_lamb, target.lstrip("~")):
      target = f"~optax_lamb.{target.lstrip('~')}"
    return f"{{{kind}}}`{target}`"

  text = re.sub(r":(\w+):`([^`]+)`", role, text)  # :func:`x` -> {func}`x`
  text = re.sub(r"``([^`]+)``", r"`\1`", text)
  return text.replace("|", "\\|")


def api_summary(api_page: str) -> str:
  """docs/api.md's summary tables, generated from the package: every name in
  ``optax_lamb.__all__`` and ``optax_lamb.compat.__all__`` and the backend classes, each linked to
  its entry, with the first paragraph of its docstring; in the order of the entries on
  `api_page` (names without an entry last)."""
  import inspect
  import re

  import optax_lamb
  from optax_lamb import compat
  from optax_lamb.backends import pallas_triton, xla

  with open(api_page) as f:
    order = re.findall(r"\.\. auto(?:function|class):: ([\w.]+)", f.read())

  def position(item: tuple[str, object]) -> int:
    return order.index(item[0]) if item[0] in order else len(order)

  def table(names: list[tuple[str, object]], equivalents: bool) -> str:
    rows = ["| symbol | what it is |" + (" optax equivalent |" if equivalents else "")]
    rows.append("|---|---|" + ("---|" if equivalents else ""))
    for name, obj in sorted(names, key=position):
      cells = [f"{{py:obj}}`{name.rsplit('.', 1)[-1]} <{name}>`", _summary_line(obj)]
      if equivalents:
        cells.append(_OPTAX_EQUIVALENT.get(name, "none"))
      rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)

  def public(module):
    return [
      (f"{module.__name__}.{n}", getattr(module, n))
      for n in module.__all__
      if not inspect.ismodule(getattr(module, n))
    ]

  backends = [
    ("optax_lamb.backends.xla.XlaBackend", xla.XlaBackend),
    ("optax_lamb.backends.pallas_triton.PallasTritonBackend", pallas_triton.PallasTritonBackend),
    ("optax_lamb.backends.pallas_triton.BlockSizes", pallas_triton.BlockSizes),
  ]
  return (
    "\n\n".join(
      [
        "In `optax_lamb`:\n\n" + table(public(optax_lamb), equivalents=True),
        "In `optax_lamb.compat`, one constructor per library:\n\n" + table(public(compat), False),
        "Backends, for `implementation=`:\n\n" + table(backends, False),
      ]
    )
    + "\n"
  )


# The step's traffic sentences: these implementations, as each file names them.
_TRAFFIC = ("optax.lamb", "optax_lamb.lamb", "update_and_apply")


def benchmark_blocks(root: str) -> dict[str, dict[str, str]]:
  """File -> block name -> its content, from the committed benchmark results (a few seconds)."""
  results = os.path.join(root, "benchmarks", "results")
  gpu = os.path.basename(_latest_gpu_file(results))
  return {
    "README.md": {
      "headline figures": headline(results),
      "memory": memory(results, full=False),
    },
    os.path.join("docs", "memory.md"): {"memory": memory(results, full=True)},
    os.path.join("docs", "benchmarks.md"): {
      "cpu traffic": traffic(results, "cpu-2core.json", "bert-base", _TRAFFIC),
      "memory": memory(results, full=True),
      "compile time": compile_time(results),
    },
    os.path.join("docs", "KERNELS.md"): {
      "gpu traffic": traffic(results, gpu, "bert-large", _TRAFFIC)
    },
  }


def _recipe_blocks(root: str) -> dict[str, dict[str, str]]:
  """File -> block name -> its content, from the recipe's committed results."""
  study = os.path.join(root, "notebooks", "results", "study.json")
  searched = os.path.join(root, "notebooks", "results", "search.json")
  longer = os.path.join(root, "notebooks", "results", "budget.json")
  past = os.path.join(root, "notebooks", "results", "past_plateau.json")
  replay = os.path.join(root, "notebooks", "results", "divergence.json")
  quantized = os.path.join(root, "notebooks", "results", "moments8.json")
  return {
    "README.md": {
      # The README leads with the finding past the plateau, then keeps the claim study's table;
      # the steps to a target, the random search, the longer training, the replay and the
      # search past the plateau's tables are docs/recipe.md's.
      "recipe headline": recipe_headline(past),
      "recipe study": study_summary(study),
    },
    os.path.join("docs", "recipe.md"): {
      "recipe headline": recipe_headline(past),
      "recipe study": study_report(study),
      "steps to target": steps_to_target(study, table=True),
      "random search": search_summary(searched, full=True),
      "longer training": budget_summary(longer, full=True),
      "divergence": divergence_summary(replay),
      "past the plateau": plateau_summary(past, full=True),
      "8-bit moments": moments8_summary(quantized),
    },
  }


def _blocks(root: str) -> dict[str, dict[str, str]]:
  """File -> block name -> its content, rendered now from the committed results."""
  blocks = benchmark_blocks(root)
  for name, recipe in _recipe_blocks(root).items():
    blocks.setdefault(name, {}).update(recipe)
  return blocks


def with_block(text: str, name: str, content: str) -> str:
  """``text`` with the lines between the block's two markers replaced by ``content``."""
  start, end = f"<!-- {name}: python -m docs._render -->", f"<!-- end {name} -->"
  head, rest = text.split(start)
  _, tail = rest.split(end)
  return f"{head}{start}\n{content}\n{end}{tail}"


def rendered(root: str, blocks: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
  """File -> its text with every block (or those of `blocks`) rendered from the committed
  results."""
  out = {}
  for name, named in (_blocks(root) if blocks is None else blocks).items():
    with open(os.path.join(root, name)) as f:
      text = f.read()
    for block, content in named.items():
      text = with_block(text, block, content)
    out[name] = text
  return out


if __name__ == "__main__":  # rewrite the rendered blocks of the README and the docs
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name, text in rendered(root).items():
    with open(os.path.join(root, name), "w") as f:
      f.write(text)
