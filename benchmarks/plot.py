"""The step benchmark's figure: device step time against parameter count (matplotlib, log-log)."""

from __future__ import annotations

_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]


def _points(report: dict, impl: str) -> list[tuple]:
  """(params, device ms, case) of every case `impl` was timed on, by parameter count."""
  return sorted(
    (c["params"], c["results"][impl]["device_ms"], name)
    for name, c in report["cases"].items()
    if "device_ms" in c["results"].get(impl, {})
  )


def plot(report: dict, path: str) -> None:
  """Device step time against parameter count, one line per implementation (log-log), as a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  impls = list(dict.fromkeys(i for c in report["cases"].values() for i in c["results"]))
  for impl, marker in zip(impls, _MARKERS, strict=False):
    points = _points(report, impl)
    ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=impl, alpha=0.85)
  for name, case in report["cases"].items():
    timed = [r["device_ms"] for r in case["results"].values() if "device_ms" in r]
    if timed:
      ax.annotate(name, (case["params"], min(timed)), textcoords="offset points",
                  xytext=(4, -12), fontsize=8)  # fmt: skip
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("parameters")
  ax.set_ylabel(f"device step time, ms (median, {report['inner_steps']} steps per call)")
  ax.set_title(
    f"LAMB step, float32 params, params and state donated\n{report['device']}, jax {report['jax']}",
    fontsize=10,
  )
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
