"""Markdown tables rendered from the committed benchmark results (`benchmarks/results/*.json`).

The docs build writes `benchmark_tables` into the benchmarks page; the README's
headline figures are the `headline` block, which a test keeps equal to this render.
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
  """A time in ms: `device_ms`/`e2e_ms` (current format) or `median_ms` (the CPU file's device time)."""
  if key == "device_ms":
    return result.get("device_ms", result.get("median_ms"))
  return result.get(key)


def _fmt(x: float | None, digits: int = 2) -> str:
  if x is None:
    return "not measured"
  return f"{x:.{digits}f}" if x < 100 else f"{x:.0f}"


def _source(report: dict, path: str) -> str:
  date = str(report.get("date", "undated"))[:10]
  device = report.get("device_kind") or report.get("device", "?")
  versions = f"jax {report.get('jax', '?')}, optax {report.get('optax', '?')}"
  return f"{device}, {versions}, {date} (`benchmarks/results/{os.path.basename(path)}`)"


def case_table(report: dict) -> str:
  """One row per (tree, implementation): times, ratio to optax.lamb, temporaries."""
  rows = [
    "| tree | params | implementation | device ms | end-to-end ms | device vs optax.lamb "
    "| temporaries MB |",
    "|---|---:|---|---:|---:|---:|---:|",
  ]
  for name, case in report["cases"].items():
    base = _ms(case["results"].get("optax.lamb", {}), "device_ms")
    for impl, r in case["results"].items():
      if "error" in r:
        rows.append(f"| {name} | | {_IMPLEMENTATIONS.get(impl, impl)} | error | | | |")
        continue
      device = _ms(r, "device_ms")
      ratio = f"{device / base:.2f}x" if base and device is not None else ""
      temp = r.get("memory", {}).get("temp_bytes")
      rows.append(
        f"| {name} | {case['params'] / 1e6:.1f}M | {_IMPLEMENTATIONS.get(impl, impl)} "
        f"| {_fmt(device)} | {_fmt(_ms(r, 'e2e_ms'))} | {ratio} "
        f"| {'' if temp is None else f'{temp / 1e6:.0f}'} |"
      )
  return "\n".join(rows)


def benchmark_tables(results_dir: str) -> str:
  """Every committed result file: where and when it was measured, then its table."""
  parts = []
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    report = _load(path)
    parts.append(f"## {_source(report, path)}\n")
    if report.get("note"):
      parts.append(report["note"] + "\n")
    parts.append(case_table(report) + "\n")
  return "\n".join(parts)


def headline(results_dir: str) -> str:
  """The README's figures: BERT-base and BERT-large on the CPU file, optax.lamb against ours."""
  path = os.path.join(results_dir, "cpu-2core.json")
  report = _load(path)
  rows = [
    f"Measured on {_source(report, path)}; device time of one jitted, donated step:",
    "",
    "| tree | `optax.lamb` | `optax_lamb.lamb` | `update_and_apply` |",
    "|---|---:|---:|---:|",
  ]
  for name in ("bert-base", "bert-large"):
    results = report["cases"][name]["results"]
    base = _ms(results["optax.lamb"], "device_ms")
    cells = [f"{_fmt(base, 0)} ms"]
    for impl in ("optax_lamb.lamb", "update_and_apply"):
      t = _ms(results[impl], "device_ms")
      cells.append(f"{_fmt(t, 0)} ms ({t / base:.2f}x)")
    rows.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


README_MARKERS = (
  "<!-- headline figures: python -m docs._render -->",
  "<!-- end headline figures -->",
)


def readme_with_headline(readme: str, results_dir: str) -> str:
  """`readme` with the text between the markers replaced by `headline` (a new render)."""
  start, end = README_MARKERS
  head, rest = readme.split(start)
  _, tail = rest.split(end)
  return f"{head}{start}\n{headline(results_dir)}\n{end}{tail}"


if __name__ == "__main__":  # rewrite the README's headline figures from the committed results
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = os.path.join(root, "README.md")
  with open(path) as f:
    text = readme_with_headline(f.read(), os.path.join(root, "benchmarks", "results"))
  with open(path, "w") as f:
    f.write(text)
