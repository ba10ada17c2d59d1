"""Figures of a sweep's results (``sweep``) and of the claim study's (``study``, ``analysis``)."""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes import analysis, report

# Colour = optimizer, line style and marker = tuning protocol: six arms told apart in print too.
COLOUR = {"lamb": "C0", "adamw": "C1"}
PROTOCOL_STYLE = {
  "tuned at B_min": dict(marker="o", ls="-"),
  "tuned at B_max": dict(marker="s", ls="--"),
  "retuned per batch": dict(marker="^", ls=":"),
}


def arm_style(arm: str) -> dict:
  protocol = arm.split(" ", 1)[1]
  return dict(color=COLOUR[report.FAMILY[arm]], **PROTOCOL_STYLE[protocol])


def _batch_colours(batches):
  import matplotlib

  cmap = matplotlib.colormaps["viridis"]
  return {b: cmap(i / max(1, len(batches) - 1)) for i, b in enumerate(batches)}


arm_runs = analysis.arm_runs  # the runs an arm reports at a batch (the notebook uses it here)


def _baseline_lines(results: dict, ax) -> None:
  seq = str(results["config"]["seq_len"])
  for key, style, label in (
    ("best_loss", dict(color="k", ls=":"), "best possible (Bayes)"),
    ("unigram_loss", dict(color="gray", ls="--"), "token frequencies only (no context)"),
  ):
    values = {str(k): v for k, v in (results["data"].get(key) or {}).items()}
    if seq in values:
      ax.axhline(values[seq], label=label, lw=1, **style)


def _log2_batches(ax, batches) -> None:
  ax.set_xscale("log", base=2)
  ax.set_xticks(batches, [str(int(b)) for b in batches])
  ax.minorticks_off()
  ax.set_xlabel("batch size (same number of samples per run)")


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
  ax.set_ylabel("final test MLM loss (nats)")
  ax.set_title(f"Quality vs batch size (mean ± sd over {n} seed{'s' * (n > 1)})")
  ax.legend(fontsize=8)


def loss_vs_samples(results: dict, ax, arms=None) -> None:
  """Test loss against samples seen, mean over seeds: colour = batch size, line style = arm.

  The first evaluation (far above the rest) is left out so that the axis shows the differences.
  """
  from matplotlib.lines import Line2D

  arms = arms or (
    report.arm_name("lamb", "tuned at B_min"),
    report.arm_name("adamw", "tuned at B_min"),
  )
  batches = results["config"]["batches"]
  colour = _batch_colours(batches)
  for b in batches:
    for arm in arms:
      runs = arm_runs(results, arm, b)
      if not runs:  # a study still under way
        continue
      y = np.nanmean([[np.nan if h is None else h for h in r["test"]] for r in runs], axis=0)
      ax.plot(runs[0]["samples"][1:], y[1:], arm_style(arm)["ls"], color=colour[b])
  _baseline_lines(results, ax)
  handles = [Line2D([], [], color=colour[b], label=f"B={b}") for b in batches]
  handles += [Line2D([], [], color="k", ls=arm_style(a)["ls"], label=a) for a in arms]
  ax.legend(handles=handles, fontsize=8, ncol=2)
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("test MLM loss (nats)")
  n = len({r["seed"] for r in results["runs"]})
  ax.set_title(f"Loss vs samples (mean over {n} seed{'s' * (n > 1)}; first evaluation not shown)")


def steps_to_target(results: dict, ax, targets, protocol: str = "retuned per batch") -> None:
  """Steps to reach each test-loss target against batch size, log-log (Shallue et al. 2019):
  perfect scaling halves the steps when the batch doubles (the dotted slope). Colour = target,
  solid = LAMB, dashed = AdamW; a batch whose runs never reach a target has no point."""
  colours = dict(zip(targets, ("C0", "C1", "C2", "C3"), strict=False))
  batches = np.array(results["config"]["batches"], float)
  for target in targets:
    for family in report.OPTIMIZERS:
      arm = report.arm_name(family, protocol)
      got = analysis.steps_to_target(results, arm, target)
      b = [k for k, v in got.items() if v is not None]
      ls = "-" if family == "lamb" else "--"
      ax.plot(b, [got[k] for k in b], ls, marker="o", ms=3,
              color=colours[target], label=f"{report.OPTIMIZERS[family]}, loss {target:.2f}")  # fmt: skip
  anchor = analysis.steps_to_target(results, report.arm_name("lamb", protocol), max(targets))
  if anchor.get(batches[0]):
    ax.plot(batches, anchor[batches[0]] * batches[0] / batches, "k:", lw=1, label="perfect scaling")
  ax.set_yscale("log")
  _log2_batches(ax, batches)
  ax.set_ylabel("optimizer steps to reach the target")
  ax.set_title(f"Steps to a test-loss target (both {protocol}; mean over seeds)")
  ax.legend(fontsize=7, ncol=2)


def search_trials(search_results: dict, axes) -> None:
  """Each random-search trial's final validation loss (first seed) against its peak learning
  rate, one panel per batch; the chosen trial circled. Shows how flat each optimizer's optimum is."""
  first = search_results["search"]["seeds"][0]
  chosen = {(c["family"], c["batch"]): c["trial"] for c in search_results["chosen"]}
  batches = sorted({b for _, b in chosen})
  for ax, b in zip(axes, batches, strict=True):
    for family, label in report.OPTIMIZERS.items():
      runs = [
        r
        for r in search_results["runs"]
        if (r["seed"], r["family"], r["batch"]) == (first, family, b)
      ]
      lrs = [r["peak_lr"] for r in runs]
      val = [r["validation"][-1] if r["validation"][-1] is not None else np.nan for r in runs]
      ax.scatter(lrs, val, color=COLOUR[family], s=14, label=f"{label} ({len(runs)} trials)")
      best = [r for r in runs if r["trial"] == chosen.get((family, b))]
      if best:
        ax.scatter([best[0]["peak_lr"]], [best[0]["validation"][-1]], s=80,
                   facecolors="none", edgecolors=COLOUR[family])  # fmt: skip
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate", ylabel="final validation loss (nats)", title=f"B={b}")
    ax.legend(fontsize=8)


def budget_curves(budget_results: dict, axes, seed: int = 0) -> None:
  """Test loss against samples of the searched settings at each sample budget (``budget``), one
  panel per batch, colour = optimizer, darker and solid = longer; the token-frequency baseline."""
  runs = budget_results["search_runs_at_1x"] + budget_results["runs"]
  batches = sorted({c["batch"] for c in budget_results["chosen"]})
  multiples = sorted({r["multiple"] for r in runs})
  for ax, b in zip(axes, batches, strict=True):
    for family, label in report.OPTIMIZERS.items():
      for j, m in enumerate(multiples):
        run = [
          r
          for r in runs
          if (r["family"], r["batch"], r["multiple"], r["seed"]) == (family, b, m, seed)
        ]
        if run:
          alpha = 0.35 + 0.65 * j / max(1, len(multiples) - 1)
          ls = "-" if j == len(multiples) - 1 else "--"
          ax.plot(run[0]["samples"], run[0]["test"], color=COLOUR[family], alpha=alpha, ls=ls,
                  marker=".", label=f"{label} {m}x")  # fmt: skip
    _baseline_lines(budget_results, ax)
    ax.set_xscale("log")
    ax.set_ylim(top=min(6.2, ax.get_ylim()[1]))
    ax.set(xlabel="training samples", ylabel="test loss (nats)", title=f"B={b}, seed {seed}")
    ax.legend(fontsize=8, ncol=2)


def budget_steps(budget_results: dict, ax, targets) -> None:
  """Fewest steps over the longer-training runs to reach each test-loss target
  (`budget.steps_to_target`) against batch size, log-log, with perfect scaling from each
  optimizer's smallest-batch point (dotted). Colour = target, circles and solid = LAMB, squares
  and dashed = AdamW; a batch whose runs never reach a target has no point."""
  from optax_lamb_recipes import budget

  colours = dict(zip(targets, ("C0", "C1", "C2", "C3"), strict=False))
  batches = np.array(sorted({c["batch"] for c in budget_results["chosen"]}), float)
  for target in targets:
    for family, label in report.OPTIMIZERS.items():
      got = {b: budget.steps_to_target(budget_results, family, int(b), target) for b in batches}
      b = [k for k, v in got.items() if v is not None]
      ax.plot(b, [got[k][0] for k in b], "-" if family == "lamb" else "--",
              marker="o" if family == "lamb" else "s", ms=5, color=colours[target],
              label=f"{label}, loss {target:.1f}")  # fmt: skip
      if got[batches[0]]:
        ax.plot(
          batches, got[batches[0]][0] * batches[0] / batches, ":", color=colours[target], lw=1
        )
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(batches, [str(int(b)) for b in batches])
  ax.set(xlabel="batch size", ylabel="optimizer steps to reach the target")
  ax.set_title("Longer training: fewest steps to a target (dotted: perfect scaling)")
  ax.legend(fontsize=7, ncol=2)


STEPS_OF = {"trust_ratios": "trust_ratio_steps", "relative_steps": "relative_step_steps"}


def per_layer(run: dict, key: str, ax, colour, label: str) -> None:
  """A band (min to max over the leaves) and the median of ``run[key]`` (per-leaf series)."""
  series = np.array(list(run[key].values()), float)
  steps = run[STEPS_OF[key]]
  lo, med, hi = np.nanmin(series, 0), np.nanmedian(series, 0), np.nanmax(series, 0)
  ax.fill_between(np.asarray(steps) / max(steps[-1], 1), lo, hi, color=colour, alpha=0.2, lw=0)
  ax.plot(np.asarray(steps) / max(steps[-1], 1), med, color=colour, label=label)


PER_LAYER = {
  "trust_ratios": ("trust ratio ||p|| / ||u||", "{name}: trust ratio per layer (median, range)"),
  "relative_steps": ("||dp|| / ||p|| per step", "{name}: relative step per layer (median, range)"),
}


def per_layer_by_batch(results: dict, ax, family: str, key: str, batches=None) -> None:
  """``key`` per layer (line: median over the decayed layers, band: range) at several batches.

  ``key``: ``"trust_ratios"`` (LAMB) or ``"relative_steps"`` (``||dp|| / ||p||``, both
  optimizers); the arm tuned at B_min, seed 0.
  """
  batches = batches or results["config"]["batches"]
  colour = _batch_colours(results["config"]["batches"])
  arm = report.arm_name(family, "tuned at B_min")
  for b in batches:
    run = next((r for r in arm_runs(results, arm, b) if key in r), None)
    if run is not None:
      per_layer(run, key, ax, colour[b], f"B={b}")
  ylabel, title = PER_LAYER[key]
  ax.set_yscale("log")
  ax.set_xlabel("fraction of training")
  ax.set_ylabel(ylabel)
  ax.set_title(title.format(name=report.OPTIMIZERS[family]))
  ax.legend(fontsize=8)


def schedules(results: dict, ax, arm=None) -> None:
  """One arm's learning-rate schedules against samples seen, linear axes (warm-up visible)."""
  arm = arm or report.arm_name("lamb", "tuned at B_min")
  batches = results["config"]["batches"]
  colour = _batch_colours(batches)
  for b in batches:
    runs = arm_runs(results, arm, b)
    if not runs:
      continue
    r = runs[0]
    ax.plot(np.asarray(r["lr_steps"]) * b, r["lr"], color=colour[b], label=f"B={b}")
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("learning rate")
  ax.set_title(f"{arm}: sqrt(B) peak, constant warm-up steps, linear decay")
  ax.legend(fontsize=8)


def sweep_figure(results: dict, path: str | None = None):
  """The main job's four panels in one figure; saved to ``path`` when given."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(13, 9))
  final_loss_vs_batch(results, axes[0, 0])
  loss_vs_samples(results, axes[0, 1])
  per_layer_by_batch(results, axes[1, 0], "lamb", "trust_ratios")
  schedules(results, axes[1, 1])
  fig.suptitle(
    f"BERT large-batch recipe, '{results['config']['name']}' preset: {results['data']['source']}"
  )
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig


def paired_differences(results: dict, ax) -> None:
  """LAMB minus AdamW per tuning protocol against batch size, with 95% bootstrap intervals."""
  diffs = analysis.paired_differences(results)
  for k, (protocol, by_batch) in enumerate(diffs.items()):
    bs = np.array(sorted(by_batch), float)
    mean = np.array([by_batch[b]["mean"] for b in sorted(by_batch)])
    lo = mean - np.array([by_batch[b]["low"] for b in sorted(by_batch)])
    hi = np.array([by_batch[b]["high"] for b in sorted(by_batch)]) - mean
    style = dict(PROTOCOL_STYLE[protocol], color=f"C{k + 2}")
    ax.errorbar(bs * 1.03 ** (k - 1), mean, yerr=[lo, hi], capsize=3, label=protocol, **style)
  ax.axhline(0, color="k", lw=0.8)
  _log2_batches(ax, results["config"]["batches"])
  ax.set_ylabel("LAMB − AdamW, final test loss (nats)")
  ax.set_title("Paired by seed and test sequence; below 0: LAMB better (95% bootstrap interval)")
  ax.legend(fontsize=8)


def arm_losses(results: dict, ax) -> None:
  """Each arm's final test loss against batch size, with its 95% bootstrap interval (study)."""
  table = analysis.arm_table(results)
  for k, (arm, by_batch) in enumerate(table.items()):
    bs = sorted(by_batch)
    mean = np.array([by_batch[b]["mean"] for b in bs])
    err = [mean - [by_batch[b]["low"] for b in bs], [by_batch[b]["high"] for b in bs] - mean]
    x = np.array(bs, float) * 1.025 ** (k - 2.5)
    ax.errorbar(x, mean, yerr=err, label=arm, capsize=2, ms=4, **arm_style(arm))
  _baseline_lines(results, ax)
  _log2_batches(ax, results["config"]["batches"])
  ax.set_ylabel("final test MLM loss (nats)")
  ax.set_title("Each arm (mean over seeds, 95% bootstrap interval)")
  ax.legend(fontsize=8)


def lr_sensitivity(tuning: dict, axes) -> None:
  """Validation loss against the lr factor at each batch, one panel per optimizer (first seed)."""
  cfg = tuning["config"]
  colour = _batch_colours(cfg["batches"])
  for ax, family in zip(axes, report.OPTIMIZERS, strict=True):
    for b in cfg["batches"]:
      runs = [r for r in tuning["runs"] if (r["seed"], r["family"], r["batch"]) == (0, family, b)]
      runs.sort(key=lambda r: r["factor"])
      y = [r["validation"][-1] if r["validation"][-1] is not None else np.nan for r in runs]
      ax.plot([r["peak_lr"] for r in runs], y, "o-", ms=3, color=colour[b], label=f"B={b}")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title(f"{report.OPTIMIZERS[family]}: learning-rate sensitivity (seed 0)")
    ax.legend(fontsize=8)
