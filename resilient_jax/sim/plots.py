"""PNG plots of a simulation, drawn from its `results.json` content (so they can be redrawn
from a saved file without simulating again)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot_goodput", "plot_sweep", "plot_trace"]

# One colour per policy, stable across plots and runs.
COLORS = {
  "recycle": "#1f77b4",
  "naive": "#ff7f0e",
  "oobleck": "#2ca02c",
  "bamboo": "#9467bd",
  "restart": "#d62728",
  "auto": "#7f7f7f",
}

# Policies often reach the same throughput (restart matches recycle until re-routing runs out of
# bubbles, and auto is whichever policy it picked), so coinciding curves must stay apart: each
# is drawn narrower than the one before it, with its own marker and dash pattern, so a curve
# on top of another leaves the one below visible around it.
STYLES = {
  "recycle": {"lw": 5.0, "ls": "-", "marker": "o", "ms": 9},
  "naive": {"lw": 4.0, "ls": "-", "marker": "s", "ms": 7},
  "oobleck": {"lw": 3.4, "ls": "-", "marker": "^", "ms": 7},
  "bamboo": {"lw": 2.8, "ls": "-", "marker": "D", "ms": 5},
  "restart": {"lw": 2.6, "ls": (0, (5, 2)), "marker": "v", "ms": 6},
  "auto": {"lw": 1.5, "ls": (0, (1, 1)), "marker": "x", "ms": 7},
}
_DEFAULT_STYLE = {"lw": 1.6, "ls": "-", "marker": "o", "ms": 4}

# The goodput bars: committed training, then each loss of `goodput.LOSSES`.
_LOSS_COLORS = {
  "committed": "#4c9a2a",
  "detection": "#ff7f0e",
  "replanning": "#17becf",
  "restarts": "#d62728",
  "rerun": "#9467bd",
  "slowed": "#8c564b",
  "stragglers": "#e377c2",
  "checkpoint": "#7f7f7f",
  "waiting": "#bcbd22",
}


def _style(name: str, order: int) -> dict[str, Any]:
  """Line style of `name`; `order` (draw order) puts later curves on top of earlier ones."""
  st = dict(STYLES.get(name, _DEFAULT_STYLE))
  return {"linewidth": st["lw"], "linestyle": st["ls"], "marker": st["marker"],
          "markersize": st["ms"], "zorder": 2 + order, "markeredgewidth": 1.6}


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")  # files only: no display on clusters and CI
  import matplotlib.pyplot as plt

  return plt


def plot_sweep(results: Mapping[str, Any], path: str | Path) -> None:
  """Relative throughput against concurrent failures, one line per policy, and the bound."""
  plt = _pyplot()
  rows = results["rows"]
  fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
  policies = list(dict.fromkeys(r["policy"] for r in rows))
  # The widest first, so each narrower curve lies on top of the wider ones it coincides with.
  policies.sort(key=lambda n: -STYLES.get(n, _DEFAULT_STYLE)["lw"])
  for order, name in enumerate(policies):
    pts = sorted((r["failures"], r["relative"]) for r in rows if r["policy"] == name)
    ax.plot(
      [p[0] for p in pts],
      [p[1] for p in pts],
      label=name,
      color=COLORS.get(name),
      alpha=0.9,
      **_style(name, order),
    )
  bound = sorted({(r["failures"], r["bound"]) for r in rows})
  ax.plot(
    [b[0] for b in bound],
    [b[1] for b in bound],
    "k--",
    lw=1.2,
    label="bound min(1, (m+p-1)(D-k)/(mD))",
    zorder=2 + len(policies),
  )
  xs = sorted({r["failures"] for r in rows})
  if xs and max(xs) > 8:
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
  cfg = results["config"]
  if cfg["sweep_placement"] == "hosts":
    ax.set_xlabel(f"concurrent failed hosts (all their workers; placement {cfg['placement']})")
  else:
    where = "in one stage" if cfg["sweep_placement"] == "stage" else "at random workers"
    ax.set_xlabel(f"concurrent failed workers ({where})")
  ax.set_ylabel("throughput relative to fault-free")
  ax.set_ylim(0, 1.05)
  ax.grid(alpha=0.3)
  ax.set_title(f"{cfg['title']}\nsteady-state throughput under failures", fontsize=10)
  ax.legend(fontsize=8, loc="lower left", handlelength=3.5)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def plot_trace(results: Mapping[str, Any], path: str | Path) -> None:
  """Throughput over time through the failure trace, and the failed workers below it."""
  plt = _pyplot()
  trace = results["trace"]
  fig, (ax, ax2) = plt.subplots(
    2, 1, figsize=(9, 5.5), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
  )
  hours = [t / 3600 for t in trace["bin_start_s"]]
  width = trace["bin_s"] / 3600
  for name, run in trace["policies"].items():
    xs = hours + [hours[-1] + width]
    ys = run["throughput"] + run["throughput"][-1:]
    ax.step(
      xs,
      ys,
      where="post",
      lw=1.3,
      color=COLORS.get(name),
      label=f"{name} (mean {run['mean_throughput']:.0f}/s)",
      ls=":" if name == "auto" else "-",
    )
  for e in trace["events"]:
    if e["kind"] == "fail":
      ax.axvline(e["time_s"] / 3600, color="#d62728", alpha=0.25, lw=0.8)
  ax.set_ylabel("samples/s (counted work)")
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="lower right")
  cfg = results["config"]
  ax.set_title(f"{cfg['title']}\n{trace['summary']}", fontsize=10)
  t = [s["time_s"] / 3600 for s in trace["failed_workers"]] + [trace["duration_s"] / 3600]
  n = [s["failed"] for s in trace["failed_workers"]]
  ax2.step(t, n + n[-1:], where="post", color="k", lw=1)
  ax2.set_ylabel("failed\nworkers")
  ax2.set_xlabel("hours")
  ax2.set_ylim(bottom=0)
  ax2.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def plot_goodput(results: Mapping[str, Any], path: str | Path) -> None:
  """Where each policy's wall time went through the trace: one bar per policy, its committed
  training (the ETTR) and its losses stacked to 100%."""
  from resilient_jax.sim.goodput import LOSSES

  plt = _pyplot()
  g = results["goodput"]["policies"]
  names = list(g)
  fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
  left = [0.0] * len(names)
  parts = [("committed", [100 * g[n]["ettr"] for n in names])]
  parts += [(k, [100 * g[n]["losses_share"][k] for n in names]) for k in LOSSES]
  for label, widths in parts:
    if not any(widths):
      continue
    ax.barh(names, widths, left=left, color=_LOSS_COLORS[label], label=label, edgecolor="white",
            linewidth=0.5)
    left = [a + b for a, b in zip(left, widths, strict=True)]
  # The losses are a few percent: start the axis just below the lowest ETTR.
  low = max(0.0, 5 * math.floor(min(100 * g[n]["ettr"] for n in names) / 5) - 5)
  for y, n in enumerate(names):
    ax.text(low + 0.5, y, f"ETTR {g[n]['ettr']:.3f}", va="center", ha="left", color="white",
            fontsize=9, fontweight="bold")
  ax.set_xlim(low, 100)
  ax.invert_yaxis()
  ax.set_xlabel("% of wall time")
  ax.set_title(f"{results['config']['title']}\n{results['trace']['summary']}", fontsize=9)
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5, fontsize=8, frameon=False)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
