"""Renders a costed or measured training step: Chrome/Perfetto traces and Gantt charts.

Both writers take spans by duck typing so they work with the cost model's `Span` records, the
runtime's measurements and hand-written tuples alike: a span is anything with attributes
`worker`, `op`, `start`, `end`, or a plain tuple `(worker, op, start, end)`. `worker` is
`(dp, stage)`; `op` is a `schedule.core.Op`, a `(kind, mb)` pair, or a string such as `"F3"` or
`"AR"`. Times are in `time_unit` (seconds by default) and are converted to microseconds for
traces and milliseconds for plots.

A transfer is a tuple `(src_worker, dst_worker, start, end, label)`, drawn on the destination.

Failed workers (`failed`: worker -> the step it failed in) have no ops; both writers still give
each its row, marked as failed across the whole step, so a failure shows instead of a row that
silently vanishes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

Worker = tuple[int, int]

# Seconds per unit of the input times.
_UNIT_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}

# Trace thread ids of the per-stage comm lanes; kept apart from the compute lanes because
# Perfetto requires complete events of one thread to nest, and a receive overlapping the end of
# a compute op would not.
_COMM_TID_OFFSET = 1000

# Gantt charts: their time axis is in milliseconds, a compute bar this high (in rows).
_TO_MS = 1e3
_BAR_H = 0.8

KIND_COLORS = {
  "F": "#3b75af",  # blue
  "B": "#2a9d8f",  # teal
  "W": "#f2b134",  # orange-yellow
  "BW": "#1e6b35",  # dark green
  "AR": "#8c8c8c",  # grey
  "OPT": "#8e3b9e",  # purple
  "comm": "#d4d4d4",  # light grey
}
FAILED_COLOR = "#b22222"  # dark red: the hatching and label of a failed worker's row
_LIGHT_KINDS = {"W", "comm"}  # bars light enough to need black text
_KIND_ORDER = ("F", "B", "W", "BW", "AR", "OPT")
_OP_STRING = re.compile(r"^([A-Z]+?)(\d*)$")


class _Span(NamedTuple):
  worker: Worker
  kind: str
  mb: int
  start: float  # seconds
  end: float  # seconds

  @property
  def name(self) -> str:
    return f"{self.kind}{self.mb}" if self.mb >= 0 else self.kind


class _Transfer(NamedTuple):
  src: Worker
  dst: Worker
  start: float  # seconds
  end: float  # seconds
  label: str


def _scale(time_unit: str) -> float:
  try:
    return _UNIT_SECONDS[time_unit]
  except KeyError:
    raise ValueError(
      f"time_unit must be one of {sorted(_UNIT_SECONDS)}, got {time_unit!r}"
    ) from None


def _worker(w: Any) -> Worker:
  d, s = w
  return (int(d), int(s))


def _kind_mb(op: Any) -> tuple[str, int]:
  """(kind, mb) of an `Op`, a `(kind, mb)` pair or a string like "F3" / "OPT"."""
  if hasattr(op, "kind"):
    return str(op.kind), int(getattr(op, "mb", -1))
  if isinstance(op, str):
    m = _OP_STRING.match(op)
    if m is None:
      raise ValueError(f"cannot parse op {op!r}")
    return m.group(1), int(m.group(2)) if m.group(2) else -1
  kind, mb = op
  return str(kind), int(mb)


def _normalize(spans: Iterable[Any], scale: float) -> list[_Span]:
  out = []
  for sp in spans:
    if hasattr(sp, "worker"):
      worker, op, start, end = sp.worker, sp.op, sp.start, sp.end
    else:
      worker, op, start, end = sp
    kind, mb = _kind_mb(op)
    start, end = float(start) * scale, float(end) * scale
    if end < start:
      raise ValueError(f"span {kind}{mb} on {worker} ends before it starts ({start} > {end})")
    out.append(_Span(_worker(worker), kind, mb, start, end))
  return out


def _normalize_transfers(transfers: Iterable[Any] | None, scale: float) -> list[_Transfer]:
  out = []
  for src, dst, start, end, label in transfers or ():
    out.append(
      _Transfer(_worker(src), _worker(dst), float(start) * scale, float(end) * scale, str(label))
    )
  return out


def _prepare_path(path: str | os.PathLike) -> str:
  path = os.fspath(path)
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  return path


def write_chrome_trace(
  spans: Iterable[Any],
  path: str | os.PathLike,
  *,
  title: str = "",
  metadata: Mapping[str, Any] | None = None,
  transfers: Iterable[Any] | None = None,
  time_unit: str = "s",
  failed: Mapping[Any, int] | None = None,
) -> str:
  """Writes a Chrome / Perfetto trace-event JSON file of one step.

  Each data-parallel pipeline `d` is a process (pid `d`, "pipeline d") and each stage a thread
  (tid `s`, "stage s"); ops are complete ("X") events named like "F3" with the op kind as
  category. Transfers become "comm" events on a separate "stage s recv" thread of the destination
  worker (tid 1000 + s), sorted right below its compute thread. A failed worker's thread is
  named "stage s (failed at step N)" and holds one "failed at step N" event (category "failed")
  across the step; `otherData["failed_workers"]` lists them.

  Args:
    spans: objects with `worker`, `op`, `start`, `end` attributes, or such 4-tuples.
    path: the output file; missing parent directories are created.
    title: stored in `otherData["title"]` when non-empty.
    metadata: extra JSON-serialisable entries for `otherData`.
    transfers: optional `(src_worker, dst_worker, start, end, label)` tuples.
    time_unit: unit of the input times: "s", "ms", "us" or "ns".
    failed: `{worker: step}` of workers that failed (in that 1-based training step).

  Returns:
    The path written, as a string.
  """
  scale = _scale(time_unit)
  items = _normalize(spans, scale)
  moves = _normalize_transfers(transfers, scale)
  dead = _normalize_failed(failed)
  events = _trace_events(items, moves, dead)
  meta = _trace_metadata(items, {tr.dst for tr in moves}, dead)
  other = dict(metadata or {})
  if title:
    other.setdefault("title", title)
  if dead:
    other.setdefault(
      "failed_workers", [{"worker": [d, s], "step": n} for (d, s), n in sorted(dead.items())]
    )
  path = _prepare_path(path)
  with open(path, "w") as f:
    json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}, f)
  return path


def _to_us(t: float) -> float:
  """Seconds as trace microseconds, rounded to nanoseconds: keeps the JSON short and free of
  float noise like 4000.000000000001."""
  return round(t * 1e6, 3)


def _trace_events(
  items: list[_Span], moves: list[_Transfer], dead: dict[Worker, int]
) -> list[dict[str, Any]]:
  """The complete ("X") events: ops on their worker's thread, transfers on the destination's
  recv thread, and a failed worker's one event across the step."""
  events: list[dict[str, Any]] = []
  for sp in sorted(items, key=lambda x: (x.worker, x.start)):
    d, s = sp.worker
    events.append(
      {
        "name": sp.name,
        "cat": sp.kind,
        "ph": "X",
        "pid": d,
        "tid": s,
        "ts": _to_us(sp.start),
        "dur": _to_us(sp.end - sp.start),
        "args": {"mb": sp.mb, "worker": [d, s]},
      }
    )
  for tr in sorted(moves, key=lambda x: (x.dst, x.start)):
    d, s = tr.dst
    events.append(
      {
        "name": tr.label,
        "cat": "comm",
        "ph": "X",
        "pid": d,
        "tid": _COMM_TID_OFFSET + s,
        "ts": _to_us(tr.start),
        "dur": _to_us(tr.end - tr.start),
        "args": {"src": list(tr.src), "dst": list(tr.dst)},
      }
    )
  t_end = max([sp.end for sp in items] + [tr.end for tr in moves] + [0.0])
  for (d, s), step in sorted(dead.items()):
    events.append(
      {
        "name": f"failed at step {step}",
        "cat": "failed",
        "ph": "X",
        "pid": d,
        "tid": s,
        "ts": 0.0,
        "dur": _to_us(t_end),
        "args": {"worker": [d, s], "failure_step": step},
      }
    )
  return events


def _trace_metadata(
  items: list[_Span], comm_lanes: set[Worker], dead: dict[Worker, int]
) -> list[dict[str, Any]]:
  """The metadata ("M") events naming and ordering the processes (pipelines) and threads
  (stages, their recv lanes right below them)."""
  meta: list[dict[str, Any]] = []
  workers = {sp.worker for sp in items} | comm_lanes | set(dead)
  for d in sorted({w[0] for w in workers}):
    meta.append(_meta("process_name", d, 0, {"name": f"pipeline {d}"}))
    meta.append(_meta("process_sort_index", d, 0, {"sort_index": d}))
  for d, s in sorted({sp.worker for sp in items} | set(dead)):
    name = f"stage {s} (failed at step {dead[(d, s)]})" if (d, s) in dead else f"stage {s}"
    meta.append(_meta("thread_name", d, s, {"name": name}))
    meta.append(_meta("thread_sort_index", d, s, {"sort_index": 2 * s}))
  for d, s in sorted(comm_lanes):
    tid = _COMM_TID_OFFSET + s
    meta.append(_meta("thread_name", d, tid, {"name": f"stage {s} recv"}))
    meta.append(_meta("thread_sort_index", d, tid, {"sort_index": 2 * s + 1}))
  return meta


def _normalize_failed(failed: Mapping[Any, int] | None) -> dict[Worker, int]:
  return {_worker(w): int(step) for w, step in (failed or {}).items()}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
  return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def plot_gantt(
  spans: Iterable[Any],
  path: str | os.PathLike,
  *,
  title: str = "",
  highlight_mbs: Iterable[int] | None = None,
  transfers: Iterable[Any] | None = None,
  time_unit: str = "s",
  dpi: int = 120,
  failed: Mapping[Any, int] | None = None,
) -> str:
  """Writes a PNG Gantt chart of one step: one row per worker, idle time left white.

  Rows are labelled "d{dp} s{stage}", ordered by (dp, stage) from the top, with a line between
  pipelines. Bars are coloured by op kind and show their micro-batch id when wide enough. A
  failed worker keeps its row: hatched in red across the step, labelled "failed at step N", its
  tick label "d{dp} s{stage} FAILED".

  Args:
    spans: objects with `worker`, `op`, `start`, `end` attributes, or such 4-tuples.
    path: the output PNG; missing parent directories are created.
    title: the figure title.
    highlight_mbs: micro-batch ids, or `(worker, mb)` pairs, whose compute bars get a thick
      black outline (e.g. the work re-routed into a peer's bubbles after a failure).
    transfers: optional `(src_worker, dst_worker, start, end, label)` tuples, drawn as thin
      light-grey bars along the bottom of the destination row.
    time_unit: unit of the input times: "s", "ms", "us" or "ns".
    dpi: resolution of the PNG.
    failed: `{worker: step}` of workers that failed (in that 1-based training step).

  Returns:
    The path written, as a string.
  """
  # Imported here so that importing this module never picks a backend for the caller, and the
  # explicit Agg canvas means no display is ever needed.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  scale = _scale(time_unit)
  items = _normalize(spans, scale)
  moves = _normalize_transfers(transfers, scale)
  highlight = set(highlight_mbs or ())
  dead = _normalize_failed(failed)

  workers = sorted({sp.worker for sp in items} | {tr.dst for tr in moves} | set(dead))
  row = {w: i for i, w in enumerate(workers)}
  n = max(len(workers), 1)
  t_end = max([sp.end for sp in items] + [tr.end for tr in moves] + [0.0]) * _TO_MS
  t_end = t_end if t_end > 0 else 1.0

  width_in, height_in = 14.0, 1.4 + 0.45 * n
  # A Figure with its own Agg canvas is not registered with pyplot, so nothing can leak into
  # `plt.get_fignums()` even if saving fails half-way.
  fig = Figure(figsize=(width_in, height_in), dpi=dpi)
  FigureCanvasAgg(fig)
  ax = fig.add_axes((0.07, 0.8 / height_in, 0.8, 1 - 1.4 / height_in))

  kinds_present = _draw_ops(ax, items, row)
  if moves:
    _draw_transfers(ax, moves, row)
  _draw_failed_rows(ax, dead, row, t_end)
  marked = [
    sp for sp in items if sp.mb >= 0 and (sp.mb in highlight or (sp.worker, sp.mb) in highlight)
  ]
  if marked:
    _outline(ax, marked, row)
  _draw_axes(ax, workers, dead, t_end, title)
  _label_bars(ax, items, row, t_end, ax.get_position().width * width_in * dpi, n, dpi)
  _draw_legend(ax, kinds_present, bool(moves), bool(marked), bool(dead))

  path = _prepare_path(path)
  fig.savefig(path, format="png", dpi=dpi, bbox_inches="tight", facecolor="white")
  return path


def _draw_ops(ax: Any, items: list[_Span], row: dict[Worker, int]) -> list[str]:
  """One bar per op, coloured by kind; returns the kinds drawn, in legend order."""
  kinds_present = []
  for kind in _KIND_ORDER + tuple(sorted({sp.kind for sp in items} - set(_KIND_ORDER))):
    group = [sp for sp in items if sp.kind == kind]
    if not group:
      continue
    kinds_present.append(kind)
    ax.barh(
      [row[sp.worker] for sp in group],
      [(sp.end - sp.start) * _TO_MS for sp in group],
      left=[sp.start * _TO_MS for sp in group],
      height=_BAR_H,
      color=KIND_COLORS.get(kind, "#555555"),
      edgecolor="white",
      linewidth=0.4,
      zorder=2,
    )
  return kinds_present


def _draw_transfers(ax: Any, moves: list[_Transfer], row: dict[Worker, int]) -> None:
  """Thin bars in the gap below the destination row's compute bars, so a receive never hides
  the op it feeds."""
  comm_h = 0.14
  ax.barh(
    [row[tr.dst] + _BAR_H / 2 + comm_h / 2 - 0.03 for tr in moves],
    [(tr.end - tr.start) * _TO_MS for tr in moves],
    left=[tr.start * _TO_MS for tr in moves],
    height=comm_h,
    color=KIND_COLORS["comm"],
    edgecolor="#9a9a9a",
    linewidth=0.3,
    zorder=3,
  )


def _draw_failed_rows(
  ax: Any, dead: dict[Worker, int], row: dict[Worker, int], t_end: float
) -> None:
  """A failed worker's row: hatched in red across the step, labelled with the failure's step."""
  for w, step in dead.items():
    ax.barh(
      row[w],
      t_end * 1.01,
      left=0,
      height=_BAR_H,
      facecolor="#fbeaea",
      edgecolor=FAILED_COLOR,
      hatch="///",
      linewidth=0,
      zorder=1.5,
    )
    ax.text(
      t_end * 1.01 / 2,
      row[w],
      f"failed at step {step}",
      ha="center",
      va="center",
      fontsize=9,
      fontweight="bold",
      color=FAILED_COLOR,
      bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5},
      zorder=5,
    )


def _outline(ax: Any, marked: list[_Span], row: dict[Worker, int]) -> None:
  """A thick black outline around the highlighted bars."""
  ax.barh(
    [row[sp.worker] for sp in marked],
    [(sp.end - sp.start) * _TO_MS for sp in marked],
    left=[sp.start * _TO_MS for sp in marked],
    height=_BAR_H,
    fill=False,
    edgecolor="black",
    linewidth=2.2,
    zorder=4,
  )


def _draw_axes(
  ax: Any, workers: list[Worker], dead: dict[Worker, int], t_end: float, title: str
) -> None:
  """Limits, one tick label per row (failed ones in red), the time grid and a line between
  pipelines."""
  ax.set_xlim(0, t_end * 1.01)
  ax.set_ylim(max(len(workers), 1) - 0.5, -0.5)  # first worker on top
  ax.set_yticks(
    range(len(workers)), [f"d{d} s{s}" + (" FAILED" if (d, s) in dead else "") for d, s in workers]
  )
  for tick, w in zip(ax.get_yticklabels(), workers, strict=True):
    if w in dead:
      tick.set_color(FAILED_COLOR)
      tick.set_fontweight("bold")
  ax.set_xlabel("time (ms)")
  ax.grid(axis="x", color="#e6e6e6", linewidth=0.6, zorder=0)
  ax.set_axisbelow(True)
  for i in range(1, len(workers)):
    if workers[i][0] != workers[i - 1][0]:
      ax.axhline(i - 0.5, color="#444444", linewidth=0.8, zorder=1)
  if title:
    ax.set_title(title)


def _label_bars(
  ax: Any,
  items: list[_Span],
  row: dict[Worker, int],
  t_end: float,
  ax_px: float,
  n_rows: int,
  dpi: int,
) -> None:
  """Each bar's micro-batch id (or kind), only where it fits: the bar's width in pixels (of
  the axes' `ax_px`) against the text's."""
  px_per_ms = ax_px / (t_end * 1.01)
  fontsize = 7.5 if n_rows <= 16 else 6.0
  char_px = 0.62 * fontsize * dpi / 72
  for sp in items:
    label = str(sp.mb) if sp.mb >= 0 else sp.kind
    if (sp.end - sp.start) * _TO_MS * px_per_ms < len(label) * char_px + 4:
      continue
    ax.text(
      (sp.start + sp.end) / 2 * _TO_MS,
      row[sp.worker],
      label,
      ha="center",
      va="center",
      fontsize=fontsize,
      color="black" if sp.kind in _LIGHT_KINDS else "white",
      zorder=5,
      clip_on=True,
    )


def _draw_legend(
  ax: Any, kinds: list[str], transfers: bool, marked: bool, failed: bool
) -> None:
  """The legend of what was drawn, outside the axes so it never covers a bar."""
  from matplotlib.patches import Patch

  handles = [Patch(color=KIND_COLORS.get(k, "#555555"), label=k) for k in kinds]
  if transfers:
    handles.append(Patch(facecolor=KIND_COLORS["comm"], edgecolor="#9a9a9a", label="comm"))
  if marked:
    handles.append(Patch(fill=False, edgecolor="black", linewidth=2.2, label="re-routed"))
  if failed:
    handles.append(
      Patch(facecolor="#fbeaea", edgecolor=FAILED_COLOR, hatch="///", label="failed worker")
    )
  ax.legend(
    handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8
  )


__all__ = ["KIND_COLORS", "plot_gantt", "write_chrome_trace"]
