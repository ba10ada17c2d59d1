"""Time one LAMB step (update + apply) of optax.lamb and of optax_lamb's implementations.

Usage:
  python -m benchmarks.step [--quick] [--skip-large] [--cases ...] [--impls ...]
                            [--inner-steps K] [--e2e-steps N] [--json PATH | --json-auto]
  python benchmarks/step.py ...

Two figures per case and implementation, measured in the same run:

- device: K steps inside one jitted call (a `fori_loop` over (params, state), grads fixed,
  params and state donated); per step = time of the call / K. Host dispatch is then
  negligible, so this is the time the device spends on a step.
- end to end (e2e): one jitted call per step, as a training loop makes it (params and state
  donated, arguments ordered (params, state, grads), outputs (params, state)), N calls back to
  back and `block_until_ready` after the last; per step = total / N. This adds what the host
  does per step (dispatch, one launch per kernel), which can dominate a step of a few ms on a
  GPU. `e2e sync` blocks after every call, so nothing of the host's work overlaps the device's.

Inputs are random (never zeros); warm-up runs are excluded; implementations run interleaved,
round by round, so they share the machine's load; each figure is the median over runs. The same
run measures the memory bandwidth (a large in-place jitted scale, bytes read plus written, K
times in one call as the device figure's steps) and
reports, per case and implementation, the effective bytes moved per parameter (device time x
bandwidth / params), the ratios to optax.lamb (device and e2e), the ratio to a single-pass floor
of 28 bytes per parameter (read g, m, v, p and write m, v, p once, float32), the number of buffers
in the state and an approximate kernel count of the compiled step. An implementation that fails
is recorded with its error; the others go on.

This module is the command line; the jobs live beside it: `trees` (the cases' shapes and arrays),
`implementations` (the steps timed), `timing` (device-only and end-to-end), `bandwidth`, `hlo`
(kernel count, memory), `case` (one case: compile, interleaved rounds, figures), `report` (JSON
entries, ratios, table), `plot`, `machine` (device, results file name, versions).
"""

from __future__ import annotations

import argparse
import os
import sys

if not __package__:  # run as a file: import from the repository root, not from benchmarks/
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax

from benchmarks import host_link, trees
from benchmarks import report as reporting
from benchmarks.bandwidth import Bandwidth
from benchmarks.case import Settings, run_case
from benchmarks.implementations import DEFAULT_IMPLEMENTATIONS, IMPLEMENTATIONS
from benchmarks.plot import plot


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small trees, a few runs (seconds)")
  parser.add_argument(
    "--skip-large",
    action="store_true",
    help="skip the BERT-large tree (it needs about 11 GB of memory)",
  )
  output = parser.add_mutually_exclusive_group()
  output.add_argument("--json", metavar="PATH", help="write the results as JSON")
  output.add_argument(
    "--json-auto",
    action="store_true",
    help="write the results to benchmarks/results/<device>.json (<device>-quick.json with --quick)",
  )
  parser.add_argument("--plot", metavar="PATH", help="write a PNG of device step time vs params")
  parser.add_argument("--runs", type=int, help="timed runs per figure (default 7, quick 3)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
  parser.add_argument(
    "--inner-steps", type=int, help="K, steps per call of the device figure (default 20, quick 3)"
  )
  parser.add_argument(
    "--e2e-steps", type=int, help="N, calls per run of the e2e figures (default 50, quick 5)"
  )
  parser.add_argument(
    "--compile-threads",
    type=int,
    default=1,
    help="executables compiled at once (default 1; a GPU session's many cores take several)",
  )
  parser.add_argument("--cases", nargs="+", help="only these cases")
  parser.add_argument(
    "--impls",
    nargs="+",
    default=list(DEFAULT_IMPLEMENTATIONS),
    choices=list(IMPLEMENTATIONS),
    help="implementations to time (optax.lamb gives the ratios)",
  )
  return parser


def _settings(args: argparse.Namespace) -> Settings:
  """The arguments' settings, each default depending on --quick."""
  return Settings(
    impls=args.impls,
    runs=args.runs or (3 if args.quick else 7),
    warmup=args.warmup,
    inner_steps=args.inner_steps or (3 if args.quick else 20),
    e2e_steps=args.e2e_steps or (5 if args.quick else 50),
    compile_threads=args.compile_threads,
  )


def _chosen_cases(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, dict]:
  cases = trees.cases(args.quick, args.skip_large)
  if args.cases:
    unknown = set(args.cases) - set(cases)
    if unknown:
      parser.error(f"unknown cases {sorted(unknown)}; choose from {list(cases)}")
    cases = {k: v for k, v in cases.items() if k in args.cases}
  return cases


def _write_outputs(report: dict, args: argparse.Namespace) -> None:
  path = reporting.results_path(args.quick) if args.json_auto else args.json
  if path:
    reporting.write_json(report, path)
    reporting.log(f"wrote {path}")
  if args.plot:
    plot(report, args.plot)
  print(reporting.format_table(report))  # last, so the table ends the output


def main(argv: list[str] | None = None) -> dict:
  parser = _parser()
  args = parser.parse_args(argv)
  if not args.quick and jax.default_backend() != "gpu":
    if any(impl.startswith("pallas") for impl in args.impls):
      parser.error("the pallas implementations run in interpret mode without a GPU: use --quick")
  settings = _settings(args)
  cases = _chosen_cases(args, parser)
  report = reporting.new_report(settings, args.quick)
  bandwidth = Bandwidth((1 << 20) if args.quick else (64 << 20), repeats=settings.inner_steps)
  for _ in range(2):
    bandwidth.run(record=False)
  reporting.log(
    f"timing {list(cases)} x {settings.impls}, {settings.runs} runs after {settings.warmup} "
    f"warm-up; device: {settings.inner_steps} steps per call, e2e: {settings.e2e_steps} calls"
  )
  path = reporting.results_path(args.quick) if args.json_auto else args.json
  for name, shapes in cases.items():
    report["cases"][name] = run_case(name, shapes, settings, bandwidth, reporting.log)
    report.update(bandwidth.report_fields())
    if path:  # as it goes: a run stopped at its time limit keeps the cases it finished
      reporting.summarise(report)
      reporting.write_json(report, path)
  if any(impl.startswith("offload") for impl in settings.impls):  # the link the offload uses
    report.update(host_link.measure((1 << 20) if args.quick else (64 << 20), settings.inner_steps))
    reporting.log(f"host link: {report['host_link_gbps']} GB/s (round trip, both ways counted)")
  report["load_average"] = [round(x, 2) for x in os.getloadavg()]
  reporting.summarise(report)
  _write_outputs(report, args)
  return report


if __name__ == "__main__":
  main()
