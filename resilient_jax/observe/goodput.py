"""The goodput report, `WORKDIR/goodput.json`: what failures and rejoins cost a run.

Per event (a failure or a rejoin): its step, the time to detect it, the time from then to the
next committed step, the steps run again because of it, the throughput (samples/s) of the
committed steps before and after it, and for a rejoin where the returned workers' state came
from and the bytes copied. For the run: the effective training time (the step times of the
steps that count: committed and not redone after a restore; compiles excluded) as a fraction
of the wall time since the run started.

Times to detect: a failure injected in-process is known at once (0); a killed process's is
the time from its kill (the launcher's `kills.jsonl`) to its detection; a rejoin is scheduled
at a step boundary, so it has none.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from resilient_jax.files import write_json_atomic

AROUND_STEPS = 3
"""Committed steps on either side of an event that its before/after throughput averages."""


@dataclasses.dataclass
class Event:
  """One failure or rejoin, completed as the run goes on.

  Attributes:
    kind: "failure", "rejoin", "straggler" (a worker found slow, its share re-weighted) or
      "straggler_recovered" (back to its peers' pace, its share given back).
    step: the step it happened at the start of, or during.
    nodes: the nodes lost or back.
    at: when it was detected (or, for a rejoin, applied), seconds since the epoch.
    detect_s: from the fault to its detection (None: not known).
    next_step_s: from `at` to the commit of the next step (None until then).
    steps_rerun: steps attempted again because of it (the step in flight, or those redone
      after a restore).
    extra: what else the event reports (outcome, state sources, bytes copied).
  """

  kind: str
  step: int
  nodes: list[int]
  at: float
  detect_s: float | None = None
  next_step_s: float | None = None
  steps_rerun: int = 0
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class GoodputLog:
  """Collects the events of a run and writes `goodput.json` (see the module docstring)."""

  def __init__(self) -> None:
    self.started = self.ready = time.time()
    """When the process started (`Trainer(started=...)`; else when the run was built), and when
    the run was built: `wall_s` counts from the first, `startup_s` is the gap."""
    self.events: list[Event] = []

  def add(self, kind: str, step: int, nodes: list[int], *, detect_s: float | None = None,
          at: float | None = None, **extra: Any) -> Event:
    """Records an event; the caller may complete it (`steps_rerun`, `extra`) afterwards."""
    event = Event(kind, step, sorted(nodes), time.time() if at is None else at, detect_s,
                  extra=dict(extra))
    self.events.append(event)
    return event

  def committed(self, step: int, at: float | None = None) -> None:
    """A step committed: it is the next committed step of every event still waiting for one."""
    at = time.time() if at is None else at
    for e in self.events:
      if e.next_step_s is None:
        e.next_step_s = round(max(at - e.at, 0.0), 6)
        e.extra.setdefault("next_committed_step", step)

  def report(self, metrics: list[dict], now: float | None = None) -> dict[str, Any]:
    """The report: per event, and for the run, from the run's final metrics rows."""
    wall = max((time.time() if now is None else now) - self.started, 1e-9)
    effective = sum(r.get("step_time_s", 0.0) for r in metrics)
    rate = {r["step"]: r.get("samples_per_s", 0.0) for r in metrics}
    steps = sorted(rate)
    events = []
    for e in self.events:
      # The event's own step runs on the plan after it (its committed attempt is timed).
      before = [rate[s] for s in steps if e.step - AROUND_STEPS <= s < e.step]
      after = [rate[s] for s in steps if e.step <= s < e.step + AROUND_STEPS]
      out = {
        "kind": e.kind, "step": e.step, "nodes": e.nodes,
        "time_to_detect_s": e.detect_s,
        "time_to_next_committed_step_s": e.next_step_s,
        "steps_rerun": e.steps_rerun,
        "samples_per_s_before": round(statistics.fmean(before), 3) if before else None,
        "samples_per_s_after": round(statistics.fmean(after), 3) if after else None,
      }
      out.update(e.extra)
      events.append(out)
    return {
      "events": events,
      "run": {
        "steps": len(metrics),
        "failures": sum(e.kind == "failure" for e in self.events),
        "rejoins": sum(e.kind == "rejoin" for e in self.events),
        "stragglers": sum(e.kind == "straggler" for e in self.events),
        "steps_rerun": sum(e.steps_rerun for e in self.events),
        "wall_s": round(wall, 3),
        "startup_s": round(self.ready - self.started, 3),
        "effective_training_s": round(effective, 3),
        "effective_fraction": round(effective / wall, 4),
      },
    }

  def write(self, path: Path, metrics: list[dict]) -> dict[str, Any]:
    """Writes the report to `path` (atomically) and returns it."""
    out = self.report(metrics)
    write_json_atomic(path, out)
    return out
