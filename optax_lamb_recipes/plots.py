"""Figures of a sweep's results (the JSON written by ``optax_lamb_recipes.sweep``)."""

from __future__ import annotations

import numpy as np

STYLE = {
  "LAMB": dict(color="C0", marker="o"),
  "AdamW": dict(color="C1", marker="s"),
  "AdamW @ LAMB lr": dict(color="C3", marker="x"),
  "AdamW retuned": dict(color="C2", marker="^"),
}


def final_loss_vs_batch(results: dict, ax) -> None:
  """Final held-out loss against batch size, one line per arm (gaps where a run diverged)."""
  rows = results["summary"]
  batches = [r["batch"] for r in rows]
  for arm, style in STYLE.items():
    y = [np.nan if r[arm] is None else r[arm] for r in rows]
    ax.plot(batches, y, label=arm, **style)
  best = results["data"].get("best_loss")
  if best:
    ax.axhline(min(best.values()), color="k", ls=":", label="best possible (Bayes)")
  unigram = results["data"].get("unigram_loss")
  if unigram:
    seq = str(results["config"]["seq_len"])
    ax.axhline(
      unigram[seq] if seq in unigram else unigram[int(seq)],
      color="gray",
      ls="--",
      label="token frequencies only (no context)",
    )
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch size (same number of samples per run)")
  ax.set_ylabel("final held-out MLM loss (nats)")
  ax.set_title("Quality vs batch size")
  ax.legend(fontsize=8)


def loss_vs_samples(results: dict, ax, roles=("LAMB", "AdamW")) -> None:
  """Held-out loss against samples seen, colour by batch size, line style by arm."""
  batches = results["config"]["batches"]
  cmap = __import__("matplotlib").colormaps["viridis"]
  styles = dict(zip(roles, ["-", "--", ":", "-."], strict=False))
  for i, b in enumerate(batches):
    for r in results["runs"]:
      if r["batch"] == b and r["role"] in roles:
        y = [np.nan if h is None else h for h in r["held_out"]]
        label = f"{r['role']} B={b}" if i in (0, len(batches) - 1) else None
        ax.plot(
          r["samples"], y, styles[r["role"]], color=cmap(i / max(1, len(batches) - 1)), label=label
        )
  ax.set_xlabel("training sequences seen")
  ax.set_ylabel("held-out MLM loss (nats)")
  ax.set_title("Loss vs samples (solid LAMB, dashed AdamW)")
  ax.legend(fontsize=7)


def trust_ratios(results: dict, ax, batch: int | None = None) -> None:
  """LAMB's per-layer trust ratios over training at one batch size (the largest by default)."""
  batch = batch or max(results["config"]["batches"])
  run = next(r for r in results["runs"] if r["role"] == "LAMB" and r["batch"] == batch)
  for name, ys in run["trust_ratios"].items():
    ax.plot(run["trust_ratio_steps"], ys, lw=1, label=name)
  ax.set_yscale("log")
  ax.set_xlabel("optimizer step")
  ax.set_ylabel("trust ratio ||p|| / ||u||")
  ax.set_title(f"LAMB trust ratios per layer, batch {batch}")
  ax.legend(fontsize=5, ncol=2)


def schedules(results: dict, ax) -> None:
  """The learning-rate schedules LAMB and AdamW used, against samples seen."""
  batches = results["config"]["batches"]
  cmap = __import__("matplotlib").colormaps["viridis"]
  for i, b in enumerate(batches):
    for r in results["runs"]:
      if r["batch"] == b and r["role"] in ("LAMB", "AdamW"):
        x = np.asarray(r["lr_steps"]) * b
        ls = "-" if r["role"] == "LAMB" else "--"
        ax.plot(
          x, r["lr"], ls, color=cmap(i / max(1, len(batches) - 1)), label=f"{r['role']} B={b}"
        )
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
    fig.savefig(path, dpi=110)
  return fig
