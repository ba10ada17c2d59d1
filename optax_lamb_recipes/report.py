"""A sweep's arms, the learning-rate factor each one chooses, and its results as a table.

Each optimizer has three arms (``PROTOCOLS``), so that LAMB always meets AdamW tuned the same
way: the factor best on validation at the smallest batch carried to every batch by the
square-root rule (as the paper, which tuned at the small batch), the same from the largest
batch, and the factor best at each batch. Only the first seed's runs choose.
"""

from __future__ import annotations

import numpy as np

from optax_lamb_recipes.records import final

OPTIMIZERS = {"lamb": "LAMB", "adamw": "AdamW"}
PROTOCOLS = ("tuned at B_min", "tuned at B_max", "retuned per batch")


def arm_name(family: str, protocol: str) -> str:
  return f"{OPTIMIZERS[family]} {protocol}"


ARMS = tuple(arm_name(f, p) for f in OPTIMIZERS for p in PROTOCOLS)
FAMILY = {arm_name(f, p): f for f in OPTIMIZERS for p in PROTOCOLS}


def choose_factors(config: dict, runs: list[dict]) -> dict[str, list[float]]:
  """Arm -> its lr factor at each batch of ``config["batches"]``, chosen on validation.

  ``config`` is a sweep's configuration as a dict (``dataclasses.asdict`` or its JSON); only
  the runs of its first seed are looked at.
  """
  batches, seed = list(config["batches"]), config["seeds"][0]

  def best(family, batch):
    at = [r for r in runs if (r["seed"], r["family"], r["batch"]) == (seed, family, batch)]
    return min(at, key=lambda r: final(r, "validation"))["factor"]

  out = {}
  for family in OPTIMIZERS:
    out[arm_name(family, "tuned at B_min")] = [best(family, min(batches))] * len(batches)
    out[arm_name(family, "tuned at B_max")] = [best(family, max(batches))] * len(batches)
    out[arm_name(family, "retuned per batch")] = [best(family, b) for b in batches]
  return out


def summarize(results: dict) -> list[dict]:
  """Per batch: steps, and per arm its lr and final test loss per seed, mean and spread."""
  cfg = results["config"]
  rows = []
  for j, b in enumerate(cfg["batches"]):
    row = {"batch": b}
    for arm in ARMS:
      family, f = FAMILY[arm], results["chosen_factors"][arm][j]
      at = sorted(
        (r for r in results["runs"] if (r["family"], r["batch"], r["factor"]) == (family, b, f)),
        key=lambda r: r["seed"],
      )
      test = [r["test"][-1] for r in at]
      ok = [t for t in test if t is not None]
      g = cfg["lamb_grid"] if family == "lamb" else cfg["adamw_grid"]
      row["steps"] = at[0]["steps"]
      row[arm] = {
        "lr": at[0]["peak_lr"],
        "factor": f,
        "at_grid_edge": len(g) > 1 and f in (min(g), max(g)),
        "test": test,
        "mean": float(np.mean(ok)) if ok else None,
        "std": float(np.std(ok, ddof=1)) if len(ok) > 1 else None,
        "diverged": len(test) - len(ok),
      }
    rows.append(row)
  return rows


def format_cell(cell: dict) -> str:
  if cell["mean"] is None:
    return "diverged"
  s = f"{cell['mean']:.3f}"
  if cell["std"] is not None:
    s += f" ± {cell['std']:.3f}"
  if cell["diverged"]:
    s += f" ({cell['diverged']} diverged)"
  return s + f" (lr {cell['lr']:.2g}{' †' if cell['at_grid_edge'] else ''})"


def baselines(results: dict) -> list[str]:
  """The reference losses of the data, as sentences."""
  lines = []
  for key, what in (
    ("best_loss", "Best possible test loss (Bayes, exact)"),
    ("unigram_loss", "Context-free baseline (training token frequencies), test loss"),
  ):
    for n, v in (results["data"].get(key) or {}).items():
      lines.append(f"{what}: {v:.3f} nats (sequences of {n} tokens)")
  return lines


def columns(results: dict) -> dict[str, str]:
  """Column label -> the arm it shows: one column per optimizer and distinct choice of factors,
  so that protocols that chose the same factor at every batch (the same runs) share a column
  (``AdamW tuned at B_min = retuned per batch``; ``LAMB, every protocol`` where all three do)."""
  factors = results["chosen_factors"]
  out = {}
  for family, name in OPTIMIZERS.items():
    groups: dict[tuple, list[str]] = {}
    for protocol in PROTOCOLS:
      groups.setdefault(tuple(factors[arm_name(family, protocol)]), []).append(protocol)
    for protocols in groups.values():
      if len(protocols) == len(PROTOCOLS):
        label = f"{name}, every protocol"
      else:
        label = f"{name} " + " = ".join(protocols)
      out[label] = arm_name(family, protocols[0])
  return out


def context_free(results: dict) -> float | None:
  """The context-free (token-frequency) test loss at the sweep's sequence length, if known (keyed
  by the length as an int in a fresh sweep's results, as a string once read from JSON)."""
  by_length = {str(k): v for k, v in (results["data"].get("unigram_loss") or {}).items()}
  return by_length.get(str(results["config"]["seq_len"]))


def not_learned(results: dict, margin: float) -> list[tuple[str, int, float | None]]:
  """``(arm, batch, mean final test loss)`` of every cell of the table that did not end at least
  ``margin`` nats below the context-free baseline (a diverged one: None); empty without one."""
  base = context_free(results)
  if base is None:
    return []
  return [
    (arm, row["batch"], row[arm]["mean"])
    for row in results["summary"]
    for arm in columns(results).values()
    if row[arm]["mean"] is None or row[arm]["mean"] > base - margin
  ]


def format_table(results: dict) -> str:
  """The summary as a Markdown table (one column per distinct arm, `columns`), followed by the
  baselines."""
  seeds = len(results["config"]["seeds"])
  shown = columns(results)
  lines = [
    "| batch | steps | " + " | ".join(shown) + " |",
    "|---:|---:|" + "---:|" * len(shown),
  ]
  for r in results["summary"]:
    cells = " | ".join(format_cell(r[a]) for a in shown.values())
    lines.append(f"| {r['batch']} | {r['steps']} | {cells} |")
  spread = f"mean ± standard deviation over {seeds} seeds" if seeds > 1 else "one seed"
  lines.append(
    f"\nFinal test loss (nats), {spread}; learning rates chosen on the validation split "
    "with the first seed; † = at the edge of its grid."
  )
  lines += baselines(results)
  return "\n".join(lines)
