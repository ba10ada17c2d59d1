"""Figures of a sweep's results (the JSON written by ``optax_lamb_recipes.sweep``)."""

from __future__ import annotations

import numpy as np

# One colour and marker per arm, named as in the table (sweep.ARMS).
STYLE = {
  "LAMB": dict(color="C0", marker="o", ls="-"),
  "LAMB retuned": dict(color="C9", marker="D", ls=":"),
  "AdamW": dict(color="C1", marker="s", ls="--"),
  "AdamW retuned": dict(color="C2", marker="^", ls="-."),
}


def _cmap():
  import matplotlib

  return matplotlib.colormaps["viridis"]


def _arm_run(results: dict, arm: str, batch: int, seed: int | None = None) -> dict:
  """The run an arm reports at ``batch`` for ``seed`` (default: the first seed)."""
  from optax_lamb_recipes.sweep import FAMILY

  cfg = results["config"]
  seed = cfg["seeds"][0] if seed is None else seed
  factor = results["chosen_factors"][arm][cfg["batches"].index(batch)]
  key = (FAMILY[arm], batch, factor, seed)
  return next(
    r for r in results["runs"] if (r["family"], r["batch"], r["factor"], r["seed"]) == key
  )


def _baseline_lines(results: dict, ax) -> None:
  seq = str(results["config"]["seq_len"])
  for key, style, label in (
    ("best_loss", dict(color="k", ls=":"), "best possible (Bayes)"),
    ("unigram_loss", dict(color="gray", ls="--"), "token frequencies only (no context)"),
  ):
    values = {str(k): v for k, v in (results["data"].get(key) or {}).items()}
    if seq in values:
      ax.axhline(values[seq], label=label, **style)


def final_loss_vs_batch(results: dict, ax) -> None:
  """Final test loss against batch size, one line per arm, error bars = spread over seeds."""
  rows = results["summary"]
  batches = np.array([r["batch"] for r in rows], float)
  for k, (arm, style) in enumerate(STYLE.items()):
    y = np.array([np.nan if r[arm]["mean"] is None else r[arm]["mean"] for r in rows])
    err = np.array([r[arm]["std"] or 0.0 for r in rows])
    x = batches * 1.03 ** (k - 1.5)  # nudge the arms apart so the error bars stay readable
    ax.errorbar(x, y, yerr=err, label=arm, capsize=3, ms=5, **style)
  _baseline_lines(results, ax)
  n = len(results["config"]["seeds"])
  ax.set_xscale("log", base=2)
  ax.set_xticks(batches, [str(int(b)) for b in batches])
  ax.set_xlabel("batch size (same number of samples per run)")
  ax.set_ylabel("final test MLM loss (nats)")
  ax.set_title(f"Quality vs batch size (mean ± sd over {n} seed{'s' * (n > 1)})")
  ax.legend(fontsize=8)


def loss_vs_samples(results: dict, ax, arms=("LAMB", "AdamW retuned")) -> None:
  """Test loss against samples seen (first seed): colour = batch size, line style = arm."""
  from matplotlib.lines import Line2D

  batches = results["config"]["batches"]
  cmap = _cmap()
  colour = {b: cmap(i / max(1, len(batches) - 1)) for i, b in enumerate(batches)}
  for b in batches:
    for arm in arms:
      r = _arm_run(results, arm, b)
      y = [np.nan if h is None else h for h in r["test"]]
      ax.plot(r["samples"], y, STYLE[arm]["ls"], color=colour[b])
  handles = [Line2D([], [], color=colour[b], label=f"B={b}") for b in batches]
  handles += [Line2D([], [], color="k", ls=STYLE[a]["ls"], label=a) for a in arms]
  ax.legend(handles=handles, fontsize=7, ncol=2)
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("test MLM loss (nats)")
  ax.set_title("Loss vs samples: " + ", ".join(f"{a} ({STYLE[a]['ls']})" for a in arms))


def trust_ratios(results: dict, ax, batch: int | None = None) -> None:
  """LAMB's per-layer trust ratios over training at one batch size (the largest by default)."""
  import matplotlib

  batch = batch or max(results["config"]["batches"])
  run = _arm_run(results, "LAMB", batch)
  names = list(run["trust_ratios"])
  colours = matplotlib.colormaps["tab10"].colors
  dashes = ["-", "--", ":", "-."]
  for i, name in enumerate(names):  # colour and line style together: 40 distinct lines
    style = dict(color=colours[i % 10], ls=dashes[(i // 10) % 4])
    ax.plot(run["trust_ratio_steps"], run["trust_ratios"][name], lw=1.2, label=name, **style)
  ax.set_yscale("log")
  ax.set_xlabel("optimizer step")
  ax.set_ylabel("trust ratio ||p|| / ||u||")
  ax.set_title(f"LAMB trust ratios per layer, batch {batch}")
  ax.legend(fontsize=5, ncol=2)


def schedules(results: dict, ax, arms=("LAMB", "AdamW")) -> None:
  """The learning-rate schedules of the arms, against samples seen (first seed)."""
  batches = results["config"]["batches"]
  cmap = _cmap()
  for i, b in enumerate(batches):
    for arm in arms:
      r = _arm_run(results, arm, b)
      lr = np.asarray(r["lr"], float)
      keep = lr > 0  # step 0 of the warm-up has lr 0, which a log scale cannot show
      x = np.asarray(r["lr_steps"])[keep] * b
      colour = cmap(i / max(1, len(batches) - 1))
      ax.plot(x, lr[keep], STYLE[arm]["ls"], color=colour, label=f"{arm} B={b}")
  ax.set_yscale("log")
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("learning rate")
  ax.set_title("Schedules: sqrt(B) peak, constant warm-up steps, poly decay")
  ax.legend(fontsize=5, ncol=2)


def sweep_figure(results: dict, path: str | None = None):
  """The four panels in one figure; saved to ``path`` when given."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(13, 9))
  final_loss_vs_batch(results, axes[0, 0])
  loss_vs_samples(results, axes[0, 1])
  trust_ratios(results, axes[1, 0])
  schedules(results, axes[1, 1])
  fig.suptitle(
    f"BERT large-batch recipe, '{results['config']['name']}' preset: {results['data']['source']}"
  )
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig
