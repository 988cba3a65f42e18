"""TensorBoard event files: a run's metrics per committed step, and its failures as text.

`tensorboard --logdir WORKDIR/tb` shows them. The training loop (process 0) writes one scalar per
metrics column under `train/` (loss, samples/s, step time, live workers, gradient norm, and the
skipped/clipped flags as 0 or 1) and text under `events/` (a failure, a recovery, a restore); the
simulator writes its sweep and trace (`write_simulation`).

The events go through tensorboardX's file writer and summary protos (numpy and protobuf only: no
TensorFlow, no PyTorch), synchronously: a step's events are a few hundred bytes, written in the
calling thread (about 0.1 ms a step) and flushed every `FLUSH_EVERY_S` (tensorboardX's flush is an
fsync, milliseconds) and at once for text. A write error is therefore caught here, logged once,
and the board stops writing while training goes on (tensorboardX's asynchronous `SummaryWriter`
would lose the error in its writer thread and then block the loop on its full queue).

A step that is run again (a resume from a checkpoint, a restore after a failure) leaves no
duplicate or conflicting point: a board opened or rewound at step N first writes TensorBoard's
restart marker, a `SessionLog.START` event at N, and TensorBoard's reader drops every earlier
event of step N or later (what tensorboardX's `purge_step` writes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SCALARS = ("loss", "samples_per_s", "tokens_per_s", "step_time_s", "live_workers", "grad_norm",
           "lr", "compile_s", "mfu")
"""Metrics columns written as `train/<column>` scalars when a row has them."""
FLAGS = ("skipped", "clipped")
"""Metrics columns present only when true: written as 0 or 1 every step."""
FLUSH_EVERY_S = 2.0
"""Scalars reach the disk at most this late (text events and the end of a run at once)."""
MAX_LINES = 1000
"""Trace events listed in the simulator's text event."""


class Board:
  """One event file in `logdir`, or nothing at all when `logdir` is None.

  Args:
    logdir: the directory (created); None: a board that writes nothing (not process 0).
    start_step: the first step this run writes: earlier events of it and later steps are
      dropped by TensorBoard's reader.
    log: where the one line about a write error goes.
  """

  def __init__(self, logdir: str | os.PathLike | None, start_step: int = 1,
               log: Callable[[str], None] = print):
    self.logdir = None if logdir is None else Path(logdir)
    self._log = log
    self._events = None
    self._flushed_at = time.monotonic()
    if self.logdir is None:
      return

    def open_file() -> None:
      from tensorboardX.event_file_writer import EventsWriter

      self.logdir.mkdir(parents=True, exist_ok=True)
      # tensorboardX names files by the second; nanoseconds keep two boards of one second apart
      # and in the order they were opened (the reader reads files in name order).
      self._events = EventsWriter(str(self.logdir / "events"), f".{time.time_ns()}")
      self._restart(start_step)

    self._guard(open_file)

  @property
  def active(self) -> bool:
    """Whether events are being written."""
    return self._events is not None

  def step(self, row: Mapping[str, Any]) -> None:
    """Writes a metrics row (with its `step`) as scalars."""
    if not self.active:
      return
    values = {k: row[k] for k in SCALARS if _is_number(row.get(k))}
    values.update({k: float(bool(row.get(k))) for k in FLAGS})
    self._guard(lambda: self._scalars(int(row["step"]), "train/", values))

  def text(self, step: int, tag: str, message: str) -> None:
    """Writes `message` as text event `events/<tag>` of `step`."""
    if self.active:
      self._guard(lambda: self._write(step, summary=_summary().text(f"events/{tag}", message)))

  def rewind(self, step: int) -> None:
    """The run goes on from `step` (a restore): events of `step` and later written so far are
    dropped by the reader."""
    if self.active:
      self._guard(lambda: self._restart(step))

  def scalars(self, step: int, prefix: str, values: Mapping[str, float]) -> None:
    """Writes `values` as scalars `<prefix><name>` of `step`."""
    if self.active:
      self._guard(lambda: self._scalars(step, prefix, values))

  def close(self) -> None:
    if self._events is not None:
      events, self._events = self._events, None
      try:
        events.close()
      except Exception as err:  # noqa: BLE001 - never fail the run over its TensorBoard file
        self._log(f"TensorBoard: cannot close the event file in {self.logdir} ({err})")

  # ---------------------------------------------------------------- writing

  def _restart(self, step: int) -> None:
    from tensorboardX.proto.event_pb2 import SessionLog

    self._write(step, session_log=SessionLog(status=SessionLog.START))

  def _scalars(self, step: int, prefix: str, values: Mapping[str, float]) -> None:
    summary = _summary()
    for name, value in values.items():
      self._write(step, summary=summary.scalar(f"{prefix}{name}", float(value)), flush=False)
    if time.monotonic() - self._flushed_at >= FLUSH_EVERY_S:
      self._flush()

  def _write(self, step: int, *, flush: bool = True, **fields: Any) -> None:
    from tensorboardX.proto.event_pb2 import Event

    self._events.write_event(Event(wall_time=time.time(), step=step, **fields))
    if flush:
      self._flush()

  def _flush(self) -> None:
    self._events.flush()
    self._flushed_at = time.monotonic()

  def _guard(self, write: Callable[[], None]) -> None:
    """Runs `write`; the first error is logged and ends the board's writing."""
    try:
      write()
    except Exception as err:  # noqa: BLE001 - never fail the run over its TensorBoard file
      self._log(f"TensorBoard: cannot write events to {self.logdir} ({err}); the run goes on "
                "without them")
      events, self._events = self._events, None
      if events is not None:
        try:
          events.close()
        except Exception:  # noqa: BLE001, S110 - already reported
          pass


def write_simulation(logdir: str | os.PathLike, results: Mapping[str, Any],
                     log: Callable[[str], None] = print) -> None:
  """The simulator's results (`sim.run_simulation`) as scalars, replacing an earlier run's.

  `sweep/<policy>/relative`, `.../samples_per_s` and `sweep/bound` have the number of concurrent
  failed workers as TensorBoard's step; `trace/<policy>/samples_per_s` (per bin) and
  `trace/failed_workers` have the trace's time in seconds; `events/trace` is the trace's
  summary and its failures and rejoins as text.
  """
  board = Board(logdir, start_step=0, log=log)
  bounds = {}
  for r in results["rows"]:
    board.scalars(int(r["failures"]), f"sweep/{r['policy']}/",
                  {"relative": r["relative"], "samples_per_s": r["throughput"]})
    bounds[int(r["failures"])] = r["bound"]
  for k, bound in sorted(bounds.items()):
    board.scalars(k, "sweep/", {"bound": bound})
  tr = results["trace"]
  for name, run in tr["policies"].items():
    for t, rate in zip(tr["bin_start_s"], run["throughput"], strict=True):
      board.scalars(int(t), f"trace/{name}/", {"samples_per_s": rate})
  for state in tr["failed_workers"]:
    board.scalars(int(state["time_s"]), "trace/", {"failed_workers": state["failed"]})
  events = tr["events"]
  lines = [f"- {e['time_s']:.0f} s: {e['kind']} node {e['node']}" +
           (f" device {e['device']}" if e["device"] >= 0 else "") for e in events[:MAX_LINES]]
  if len(events) > MAX_LINES:
    lines.append(f"- ... and {len(events) - MAX_LINES} more (results.json has them all)")
  board.text(0, "trace", "\n".join([tr["summary"], "", *lines]))
  board.close()


def _summary() -> Any:
  """tensorboardX's summary protos (imported on first use: 0.3 s)."""
  from tensorboardX import summary

  return summary


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)
