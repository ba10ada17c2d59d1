"""Figures of a sweep's results (``sweep``) and of the claim study's (``study``, ``analysis``).

One convention in every figure of the recipe (here and in ``plots_search``): the optimizer is the
hue and the line style (LAMB blue and solid, AdamW orange and dashed), so that the two are told
apart in colour and in print; a third variable (batch, budget, target, tuning protocol, seed) is
the shade of that hue, light to dark as it grows, and the marker. Legends sit outside the axes.
"""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes import analysis, records, report

COLOUR = {"lamb": "C0", "adamw": "C1"}
LINE = {"lamb": "-", "adamw": "--"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
# Each optimizer's shades come from a sequential colour map of its hue, whose lightness falls
# steadily (CIE L* about 80 to 21 for Blues, 79 to 29 for Oranges, over the range below): seven
# shades stay 7 to 12 L* apart, where mixing the hue with white and black left the lightest
# oranges 5 apart.
SHADES = {"lamb": "Blues", "adamw": "Oranges"}
SHADE_RANGE = (0.35, 1.0)
FONT_PT = 9  # the smallest text in a figure drawn at the docs' page width (7.5 in)
PAGE_WIDTH_IN = 7.5


def shade(family: str, i: int = 0, n: int = 1) -> tuple[float, float, float]:
  """The ``i``-th of ``n`` shades of ``family``'s colour, light to dark (its colour where n = 1)."""
  from matplotlib import colormaps
  from matplotlib.colors import to_rgb

  if n == 1:
    return to_rgb(COLOUR[family])
  lo, hi = SHADE_RANGE
  return to_rgb(colormaps[SHADES[family]](lo + (hi - lo) * i / (n - 1)))


def style(family: str, i: int = 0, n: int = 1) -> dict:
  """Colour, line style and marker of the ``i``-th of ``n`` lines of ``family``."""
  return dict(color=shade(family, i, n), ls=LINE[family], marker=MARKERS[i % len(MARKERS)])


def arm_style(arm: str) -> dict:
  """An arm's `style`: its optimizer, shaded and marked by its protocol."""
  return style(report.FAMILY[arm], report.PROTOCOLS.index(arm.split(" ", 1)[1]), 3)


def legend_outside(ax, **kw) -> None:
  """The legend to the right of the axes, where it hides no line."""
  ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=FONT_PT, **kw)


def legend_under(fig, ax, ncol: int = 2, **kw) -> None:
  """``ax``'s legend under it, outside the axes, in ``fig`` (a figure or subfigure of one axes
  with a constrained layout, which makes room for it)."""
  handles, labels = ax.get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=FONT_PT, **kw)


def _batch_list(same: list[int], batches: list[int]) -> str:
  """``16-128`` for three or more consecutive batches of ``batches``, else ``16, 64``."""
  i = batches.index(same[0])
  if len(same) > 2 and batches[i : i + len(same)] == same:
    return f"{same[0]}-{same[-1]}"
  return ", ".join(map(str, same))


def coinciding(results: dict, families, protocol: str) -> str:
  """``"\\n(same as B_min at B=16-128)"``: where ``protocol``'s arms of every one of ``families``
  took the same learning-rate factors as an earlier protocol's (the same runs, so the same
  points), per earlier protocol; empty where they never do."""
  factors, batches = results["tuning"]["chosen_factors"], results["config"]["batches"]
  parts = []
  for other in report.PROTOCOLS[: report.PROTOCOLS.index(protocol)]:
    same = [
      b
      for j, b in enumerate(batches)
      if all(
        factors[report.arm_name(f, protocol)][j] == factors[report.arm_name(f, other)][j]
        for f in families
      )
    ]
    if same:
      parts.append(f"{other.removeprefix('tuned at ')} at B={_batch_list(same, batches)}")
  return f"\n(same as {', '.join(parts)})" if parts else ""


# The last protocol (retuned per batch) coincides with one of the others at most batches: its
# markers are hollow and larger, so that the point it covers shows through.
HOLLOW = dict(mfc="none", ms=8, mew=1.5)


arm_runs = analysis.arm_runs  # the runs an arm reports at a batch (the notebook uses it here)


def _baseline_lines(results: dict, ax) -> None:
  seq = str(results["config"]["seq_len"])
  for key, style_, label in (
    ("best_loss", dict(color="k", ls=":"), "best possible (Bayes)"),
    ("unigram_loss", dict(color="gray", ls="-."), "token frequencies only"),
  ):
    values = {str(k): v for k, v in (results["data"].get(key) or {}).items()}
    if seq in values:
      ax.axhline(values[seq], label=label, lw=1, **style_)


def _log2_batches(ax, batches) -> None:
  ax.set_xscale("log", base=2)
  ax.set_xticks(batches, [str(int(b)) for b in batches])
  ax.minorticks_off()
  ax.set_xlabel("batch size (same samples per run)")


def final_loss_vs_batch(results: dict, ax) -> None:
  """Final test loss against batch size, one line per arm, error bars = spread over seeds."""
  rows = results["summary"]
  batches = np.array([r["batch"] for r in rows], float)
  for k, arm in enumerate(report.ARMS):
    y = np.array([np.nan if r[arm]["mean"] is None else r[arm]["mean"] for r in rows])
    err = np.array([r[arm]["std"] or 0.0 for r in rows])
    x = batches * 1.025 ** (k - 2.5)  # nudge the arms apart so the error bars stay readable
    ax.errorbar(x, y, yerr=err, label=arm, capsize=2, ms=4, **arm_style(arm))
  _baseline_lines(results, ax)
  n = len(results["config"]["seeds"])
  _log2_batches(ax, batches)
  ax.set_ylabel("final test loss (nats)")
  ax.set_title(f"Final loss (mean ± sd, {n} seed{'s' * (n > 1)})")
  legend_outside(ax)


def loss_vs_samples(results: dict, ax, arms=None) -> None:
  """Test loss against samples seen, mean over seeds, one line per arm and batch (shade and
  marker: the batch). The first evaluation (far above the rest) is left out."""
  arms = arms or (
    report.arm_name("lamb", "tuned at B_min"),
    report.arm_name("adamw", "tuned at B_min"),
  )
  batches = results["config"]["batches"]
  for arm in arms:
    for i, b in enumerate(batches):
      runs = arm_runs(results, arm, b)
      if not runs:  # a study still under way
        continue
      y = np.nanmean([records.curve(r, "test") for r in runs], axis=0)
      ax.plot(runs[0]["samples"][1:], y[1:], ms=3, label=f"{arm.split()[0]} B={b}",
              **style(report.FAMILY[arm], i, len(batches)))  # fmt: skip
  _baseline_lines(results, ax)
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("test loss (nats)")
  n = len({r["seed"] for r in results["runs"]})
  ax.set_title(f"Test loss during training (mean, {n} seed{'s' * (n > 1)})")
  protocols = {a.split(" ", 1)[1] for a in arms}
  legend_outside(ax, ncol=2, title=protocols.pop() if len(protocols) == 1 else None)


def steps_to_target(results: dict, ax, targets, protocol: str = "retuned per batch") -> None:
  """Median steps over seeds to each test-loss target against batch size, log-log, the bar
  spanning the evaluations around it (`analysis.steps_to_target`); shade and marker: the
  target. Perfect scaling halves the steps when the batch doubles (dotted)."""
  batches = np.array(results["config"]["batches"], float)
  for j, family in enumerate(report.OPTIMIZERS):
    for k, target in enumerate(targets):
      got = analysis.steps_to_target(results, report.arm_name(family, protocol), target)
      b = np.array([x for x, m in got.items() if m and np.isfinite(m["median"])], float)
      med = np.array([got[x]["median"] for x in b])
      err = [med - [got[x]["low"] for x in b], [got[x]["high"] for x in b] - med]
      ax.errorbar(b * 1.03 ** (2 * j + k - 2), med, yerr=err, capsize=2, ms=4,
                  label=f"{report.OPTIMIZERS[family]}, loss {target:.2f}",
                  **style(family, k, len(targets)))  # fmt: skip
  anchor = analysis.steps_to_target(results, report.arm_name("lamb", protocol), max(targets))
  if anchor.get(batches[0]) and np.isfinite(anchor[batches[0]]["median"]):
    start = anchor[batches[0]]["median"] * batches[0]
    ax.plot(batches, start / batches, "k:", lw=1, label="perfect scaling")
  ax.set_yscale("log")
  _log2_batches(ax, batches)
  ax.set_ylabel("optimizer steps to the target")
  ax.set_title(f"Steps to a test loss (median over seeds, {protocol})")
  legend_outside(ax)


STEPS_OF = {"trust_ratios": "trust_ratio_steps", "relative_steps": "relative_step_steps"}


def per_layer(run: dict, key: str, ax, colour, label: str, **kw) -> None:
  """A band (min to max over the leaves) and the median of ``run[key]`` (per-leaf series)."""
  series = np.array(list(run[key].values()), float)
  steps = np.asarray(run[STEPS_OF[key]], float)
  lo, med, hi = np.nanmin(series, 0), np.nanmedian(series, 0), np.nanmax(series, 0)
  ax.fill_between(steps / max(steps[-1], 1), lo, hi, color=colour, alpha=0.2, lw=0)
  ax.plot(steps / max(steps[-1], 1), med, color=colour, label=label, **kw)


PER_LAYER = {
  "trust_ratios": ("trust ratio ||p|| / ||u||", "{name}: trust ratio per layer"),
  "relative_steps": ("||dp|| / ||p|| per step", "{name}: relative step per layer"),
}


def per_layer_by_batch(results: dict, ax, family: str, key: str, batches=None) -> None:
  """``key`` per layer (line: median over the decayed layers, band: range) at several batches.

  ``key``: ``"trust_ratios"`` (LAMB) or ``"relative_steps"`` (``||dp|| / ||p||``, both
  optimizers); the arm tuned at B_min, seed 0.
  """
  every = results["config"]["batches"]
  batches = batches or every
  arm = report.arm_name(family, "tuned at B_min")
  for b in batches:
    run = next((r for r in arm_runs(results, arm, b) if key in r), None)
    if run is not None:
      s = style(family, every.index(b), len(every))
      per_layer(run, key, ax, s["color"], f"B={b}", ls=s["ls"])
  ylabel, title = PER_LAYER[key]
  ax.set_yscale("log")
  ax.set_xlabel("fraction of training")
  ax.set_ylabel(ylabel)
  ax.set_title(title.format(name=report.OPTIMIZERS[family]) + " (median, range)")
  legend_outside(ax)


def schedules(results: dict, ax, arm=None) -> None:
  """One arm's learning-rate schedules against samples seen, linear axes (warm-up visible)."""
  arm = arm or report.arm_name("lamb", "tuned at B_min")
  batches = results["config"]["batches"]
  for i, b in enumerate(batches):
    runs = arm_runs(results, arm, b)
    if runs:
      s = style(report.FAMILY[arm], i, len(batches)) | {"marker": None}
      ax.plot(np.asarray(runs[0]["lr_steps"]) * b, runs[0]["lr"], label=f"B={b}", **s)
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("learning rate")
  ax.set_title(f"Schedules, {arm}")
  legend_outside(ax)


def sweep_figure(results: dict, path: str | None = None):
  """The main job's four panels in one figure; saved to ``path`` when given."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(15, 9), layout="constrained")
  final_loss_vs_batch(results, axes[0, 0])
  loss_vs_samples(results, axes[0, 1])
  per_layer_by_batch(results, axes[1, 0], "lamb", "trust_ratios")
  schedules(results, axes[1, 1])
  fig.suptitle(f"BERT large-batch recipe, '{results['config']['name']}' preset: "
               f"{results['data']['source']}")  # fmt: skip
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig


def paired_differences(results: dict, ax, legend: bool = True) -> None:
  """LAMB minus AdamW per tuning protocol against batch size, with 95% t-intervals over the seeds (black:
  a difference is neither optimizer's line; marker and dashes: the protocol)."""
  diffs = analysis.paired_differences(results)
  last = len(diffs) - 1
  for k, (protocol, by_batch) in enumerate(diffs.items()):
    bs = sorted(by_batch)
    mean = np.array([by_batch[b]["mean"] for b in bs])
    err = [mean - [by_batch[b]["low"] for b in bs], [by_batch[b]["high"] for b in bs] - mean]
    label = protocol + coinciding(results, report.OPTIMIZERS, protocol)
    ax.errorbar(np.array(bs, float) * 1.06 ** (k - 1), mean, yerr=err, capsize=3, label=label,
                color=str(0.45 * k / 2), marker=MARKERS[k], ls=("-", "-.", ":")[k],
                **(HOLLOW if k == last else {}))  # fmt: skip
  ax.axhline(0, color="k", lw=0.8)
  _log2_batches(ax, results["config"]["batches"])
  ax.set_ylabel("LAMB − AdamW (nats)")
  ax.set_title("LAMB minus AdamW, final test loss, paired (95% t-interval)\nbelow 0: LAMB better")
  if legend:
    legend_outside(ax, title="both tuned")


def arm_losses(results: dict, ax, legend: bool = True) -> None:
  """Each arm's final test loss against batch size, with its 95% t-interval over the seeds (study)."""
  table = analysis.arm_table(results)
  for k, (arm, by_batch) in enumerate(table.items()):
    bs = sorted(by_batch)
    mean = np.array([by_batch[b]["mean"] for b in bs])
    err = [mean - [by_batch[b]["low"] for b in bs], [by_batch[b]["high"] for b in bs] - mean]
    x = np.array(bs, float) * 1.04 ** (k - 2.5)
    protocol = arm.split(" ", 1)[1]
    label = arm + coinciding(results, [report.FAMILY[arm]], protocol)
    hollow = HOLLOW if protocol == report.PROTOCOLS[-1] else dict(ms=5)
    ax.errorbar(x, mean, yerr=err, label=label, capsize=2, **arm_style(arm), **hollow)
  _baseline_lines(results, ax)
  _log2_batches(ax, results["config"]["batches"])
  ax.set_ylabel("final test loss (nats)")
  ax.set_title("Each arm, mean over seeds (95% t-interval)")
  if legend:
    legend_outside(ax)


def headline(results: dict):
  """The study's figure at the docs' page width: the paired differences above, each arm's loss
  below, each with its legend under it."""
  import matplotlib.pyplot as plt

  fig = plt.figure(figsize=(PAGE_WIDTH_IN, 10.5), layout="constrained")
  top, bottom = fig.subfigures(2, 1, height_ratios=(1, 1.15))
  ax = top.subplots()
  paired_differences(results, ax, legend=False)
  legend_under(top, ax, ncol=3, title="both tuned")
  ax = bottom.subplots()
  arm_losses(results, ax, legend=False)
  legend_under(bottom, ax, ncol=2)
  return fig


def lr_sensitivity(tuning: dict, axes) -> None:
  """Validation loss against the peak learning rate at each batch, one panel per optimizer
  (first seed; shade and marker: the batch)."""
  batches = tuning["config"]["batches"]
  for ax, family in zip(axes, report.OPTIMIZERS, strict=True):
    for i, b in enumerate(batches):
      runs = [r for r in tuning["runs"] if (r["seed"], r["family"], r["batch"]) == (0, family, b)]
      runs.sort(key=lambda r: r["factor"])
      y = [r["validation"][-1] if r["validation"][-1] is not None else np.nan for r in runs]
      ax.plot([r["peak_lr"] for r in runs], y, ms=4, label=f"B={b}",
              **style(family, i, len(batches)))  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title(f"{report.OPTIMIZERS[family]}: learning-rate sensitivity (seed 0)")
    legend_outside(ax)
