"""Figures of the random searches (``search``, ``plateau``), the longer training (``budget``) and
the divergence replay (``divergence``), in the convention of ``plots``: hue and line style = the
optimizer, shade and marker = a third variable, legends outside the axes."""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes import records, report
from optax_lamb_recipes.plots import (
  FONT_PT,
  LINE,
  MARKERS,
  PAGE_WIDTH_IN,
  _baseline_lines,
  legend_outside,
  legend_under,
  shade,
  style,
)

TRIAL_X = {"peak_lr": "peak learning rate", "warmup_frac": "warm-up (fraction of the steps)"}


def search_trials(search_results: dict, axes, x: str = "peak_lr", legend: bool = True) -> None:
  """Each trial's final validation loss (first seed) against its peak learning rate (or another
  ``TRIAL_X`` setting), one panel per searched batch; the chosen trial circled (the legend to the
  right of each panel, or none without ``legend``)."""
  from matplotlib.ticker import NullFormatter

  first = search_results["search"]["seeds"][0]
  chosen = {(c["family"], c["batch"]): c["trial"] for c in search_results["chosen"]}
  batches = search_results["search"].get("batches") or sorted({b for _, b in chosen})
  for ax, b in zip(np.atleast_1d(axes), batches, strict=True):
    for family, label in report.OPTIMIZERS.items():
      runs = [
        r
        for r in search_results["runs"]
        if (r["seed"], r["family"], r["batch"]) == (first, family, b)
      ]
      xs = [r["peak_lr"] if x == "peak_lr" else r["hyper"][x] for r in runs]
      val = [records.final(r, "validation") for r in runs]
      s = style(family)
      ax.scatter(xs, np.minimum(val, 1e3), color=s["color"], marker=s["marker"] if family ==
                 "lamb" else "s", s=18, label=f"{label} ({len(runs)} trials)")  # fmt: skip
      best = [i for i, r in enumerate(runs) if r["trial"] == chosen.get((family, b))]
      if best:
        ax.scatter([xs[best[0]]], [val[best[0]]], s=110, facecolors="none",
                   edgecolors=s["color"], label=f"{label}, chosen")  # fmt: skip
    ax.set_xscale("log")  # (no baseline: the token-frequency loss is the test split's)
    ax.xaxis.set_minor_formatter(NullFormatter())  # the labels of minor ticks would overlap
    ax.set(xlabel=TRIAL_X[x], ylabel="final validation loss (nats)", title=f"Trials at B={b}")
    if legend:
      legend_outside(ax)


def chosen_curves(search_results: dict, ax, batch: int, legend: bool = True) -> None:
  """Test loss during training of each optimizer's chosen trial at ``batch``, one line per seed
  (shade and marker: the seed)."""
  chosen = {(c["family"], c["batch"]): c["trial"] for c in search_results["chosen"]}
  seeds = search_results["search"]["seeds"]
  for family, label in report.OPTIMIZERS.items():
    for i, seed in enumerate(seeds):
      key = (family, batch, chosen.get((family, batch)), seed)
      run = [
        r for r in search_results["runs"] if (r["family"], r["batch"], r["trial"], r["seed"]) == key
      ]
      if run:
        steps = np.asarray(run[0]["samples"]) / batch
        ax.plot(steps, records.curve(run[0], "test"), ms=4, label=f"{label}, seed {seed}",
                **style(family, i, len(seeds)))  # fmt: skip
  _baseline_lines(search_results, ax)
  ax.set(xlabel="optimizer step", ylabel="test loss (nats)")
  ax.set_title(f"The chosen trials at B={batch}, every seed")
  if legend:
    legend_outside(ax)


def plateau(search_results: dict, stretched: dict | None = None):
  """The search past the plateau at the docs' page width: every trial's validation loss against
  its peak learning rate and against its warm-up (one legend for both, under them), with
  ``stretched`` (a longer-training run of the same batch, budget and first seed, not among the
  trials) as a star, and the chosen trials' test curves on every seed below."""
  import matplotlib.pyplot as plt

  (batch,) = search_results["search"]["batches"]
  fig = plt.figure(figsize=(PAGE_WIDTH_IN, 8.5), layout="constrained")
  top, bottom = fig.subfigures(2, 1, height_ratios=(1, 1.1))
  axes = top.subplots(1, 2, sharey=True)
  search_trials(search_results, axes[:1], legend=False)
  search_trials(search_results, axes[1:], x="warmup_frac", legend=False)
  if stretched is not None:
    xs = stretched["peak_lr"], stretched["hyper"]["warmup_frac"]
    for ax, x in zip(axes, xs, strict=True):
      ax.scatter([x], [records.final(stretched, "validation")], marker="*", s=120,
                 color=shade("lamb", 2, 3), label="LAMB of budget.json (1x search, stretched)")  # fmt: skip
  axes[1].set_ylabel("")
  for ax, what in zip(axes, ("learning rate", "warm-up"), strict=True):
    ax.set_title(f"Trials at B={batch}: {what}", fontsize=FONT_PT + 2)
  legend_under(top, axes[0], ncol=2)
  ax = bottom.subplots()
  chosen_curves(search_results, ax, batch, legend=False)
  legend_under(bottom, ax, ncol=3)
  return fig


def budget_curves(budget_results: dict, axes, seed: int = 0, legend: bool = True) -> None:
  """Test loss against samples of the searched settings at each sample budget (``budget``):
  ``axes[i][j]`` for optimizer i and batch j; shade and marker: the budget (light: 1x, dark: the
  longest), each curve labelled with its budget at its end; the token-frequency baseline."""
  runs = budget_results["search_runs_at_1x"] + budget_results["runs"]
  batches = sorted({c["batch"] for c in budget_results["chosen"]})
  multiples = sorted({r["multiple"] for r in runs})
  low = np.nanmin([np.nanmin(records.curve(r, "test")) for r in runs if r["seed"] == seed])
  for row, family in zip(axes, report.OPTIMIZERS, strict=True):
    for ax, b in zip(row, batches, strict=True):
      for j, m in enumerate(multiples):
        key = (family, b, m, seed)
        run = [r for r in runs if (r["family"], r["batch"], r["multiple"], r["seed"]) == key]
        if run:
          y = records.curve(run[0], "test")
          s = style(family, j, len(multiples))
          ax.plot(run[0]["samples"], y, ms=4, label=f"{m}x", **s)
          last = np.flatnonzero(np.isfinite(y) & (y < 6.2))
          if last.size:
            i = last[-1]
            ax.annotate(f"{m}x", (run[0]["samples"][i], y[i]), xytext=(3, -3),
                        textcoords="offset points", fontsize=FONT_PT, color=s["color"])  # fmt: skip
      _baseline_lines(budget_results, ax)
      ax.set_xscale("log")
      ax.set_ylim(low - 0.1, 6.2)  # the same in every panel; a diverged curve leaves the top
      ax.set(xlabel="training samples", ylabel="test loss (nats)",
             title=f"{report.OPTIMIZERS[family]}, B={b}, seed {seed}")  # fmt: skip
      if legend:
        legend_outside(ax, title="samples")


def budget(budget_results: dict, seed: int = 0):
  """`budget_curves` at the docs' page width, one legend (each optimizer's budgets) under the
  panels."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(PAGE_WIDTH_IN, 8), sharey=True, layout="constrained")
  budget_curves(budget_results, axes, seed, legend=False)
  handles, labels = [], []
  for row, family in zip(axes, report.OPTIMIZERS.values(), strict=True):
    h, lab = row[0].get_legend_handles_labels()
    handles += h
    labels += [f"{family} {x}" if x.endswith("x") else x for x in lab]
  keep = {}  # the baseline once
  for h, lab in zip(handles, labels, strict=True):
    keep.setdefault(lab, h)
  fig.legend(list(keep.values()), list(keep), loc="outside lower center", ncol=4,
             fontsize=FONT_PT, title="samples (times the search's)")  # fmt: skip
  for ax in axes[:, 1]:
    ax.set_ylabel("")
  return fig


def divergence(results: dict, axes) -> None:
  """The replay of the diverged run (``divergence``): each implementation's training loss per
  step and the half-learning-rate run; the difference between the two implementations' losses;
  the trust ratio of every layer (embeddings in colour, the rest grey)."""
  same, half = results["same"], results["half lr"]
  loss = np.array(same["loss"], float)
  t = np.arange(1, len(loss) + 1)
  ax = axes[0]
  for i, name in enumerate(same["chains"]):
    ax.plot(t, loss[:, i], color=shade("lamb", 2, 3), ls=("-", ":")[i], lw=1.2 - 0.4 * i,
            marker=(None, "x")[i], markevery=max(1, len(t) // 20),
            label=f"{name}, peak {same['peak_lr']:.4f}")  # fmt: skip
  half_loss = np.array(half["loss"], float)[:, 0]
  ax.plot(np.arange(1, len(half_loss) + 1), half_loss, color=shade("lamb", 0, 3), ls=LINE["lamb"],
          label=f"{half['chains'][0]}, peak {half['peak_lr']:.4f}")  # fmt: skip
  low = min(np.nanmin(loss), np.nanmin(half_loss))
  ax.set_ylim(
    low - 0.3, min(10.0, max(np.nanmax(loss), np.nanmax(half_loss)) + 0.3)
  )  # spikes go on
  for a in axes[:2]:
    a.axvline(same["warmup"], color="k", lw=0.8, ls=":", label="end of warm-up")
  ax.set(xlabel="optimizer step", ylabel="training loss (nats)", title="Training loss per step")
  legend_outside(ax)
  ax = axes[1]
  ax.semilogy(t, np.maximum(np.abs(loss[:, 0] - loss[:, 1]), 1e-9), color="k", lw=0.8)
  ax.set(xlabel="optimizer step", ylabel="|difference of the training losses| (nats)",
         title="optax_lamb.lamb against optax's chain")  # fmt: skip
  ax = axes[2]
  for k, (name, ratios) in enumerate(sorted(same["trust_ratios"].items())):
    embed = "embed" in name
    ax.semilogy(np.arange(1, len(ratios) + 1), ratios, lw=1.2 if embed else 0.6,
                color=shade("lamb", 2 * k % 3, 3) if embed else "0.7",
                marker=MARKERS[k % len(MARKERS)] if embed else None, markevery=100,
                label=name if embed else None)  # fmt: skip
  ax.plot([], [], color="0.7", label="other layers")
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set(xlabel="optimizer step", ylabel="trust ratio ||p|| / ||u||",
         title="Trust ratios of optax_lamb.lamb")  # fmt: skip
  legend_outside(ax)
