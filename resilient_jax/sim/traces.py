"""Failure traces: when which nodes or devices fail, when they rejoin, and which run slow.

A trace is a time-ordered list of events on a cluster of `nodes` nodes with `devices_per_node`
devices each. An event names a node and optionally one of its devices (-1: the whole node).
Traces come from a seeded Poisson process (`poisson_trace`), from a published cause mix with
stragglers (`mix_trace`; the mixes are in `mixes.py`), or from a CSV file (`read_csv_trace`)
with the columns `time,event,node[,device[,cause[,speed]]]`: seconds from the start, `fail`,
`rejoin`, `slow` or `slow_end`, the node, optionally the device inside it, what caused it, and
a slowdown's fraction of full speed::

    time,event,node,device
    3600,fail,12,3
    7200,fail,40
    25200,rejoin,40

Both generators are one process (`_failures`): memoryless causes, each failing the live units
of its scope (device, node, switch) until a repair, so one mechanism draws every trace and a
Poisson trace of a seed is the same whichever way it is asked for.

`FailureTracker` turns the events into the set of failed workers of a `Layout` (a worker is
down while any of its devices is down, i.e. failed on its own or on a failed node).
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from resilient_jax.schedule.core import Worker
from resilient_jax.sim.layout import Layout

__all__ = [
  "EVENT_KINDS",
  "Event",
  "FailureTracker",
  "Trace",
  "TraceError",
  "Cause",
  "SCOPES",
  "Stragglers",
  "mix_trace",
  "poisson_trace",
  "read_csv_trace",
  "write_csv_trace",
]

EVENT_KINDS = ("fail", "rejoin", "slow", "slow_end")
SCOPES = ("device", "node", "switch")
"""What one failure takes down: a device, a node (host) or a switch's nodes."""


class TraceError(ValueError):
  """A trace file or trace parameter is malformed; the message says where."""


@dataclasses.dataclass(frozen=True, order=True)
class Event:
  """One failure, rejoin, or start or end of a slowdown.

  Attributes:
    time_s: seconds from the start of the trace.
    kind: "fail", "rejoin", "slow" (the device runs at `speed` of its speed from now) or
      "slow_end" (that slowdown is over).
    node: the node.
    device: the device inside the node, or -1 for the whole node.
    cause: what caused it ("" when the source does not say), for reports.
    speed: for "slow" and "slow_end", the fraction of full speed; 1 otherwise.
  """

  time_s: float
  kind: str
  node: int
  device: int = -1
  cause: str = ""
  speed: float = 1.0

  def label(self) -> str:
    where = f"node {self.node}" + (f" device {self.device}" if self.device >= 0 else "")
    return f"{self.kind} {where}" + (f" ({self.cause})" if self.cause else "")


@dataclasses.dataclass(frozen=True)
class Trace:
  """Events over `duration_s` seconds, in time order.

  Attributes:
    duration_s: length of the simulated run.
    events: the events, sorted by time (ties keep their order in the source).
    nodes: nodes in the cluster.
    devices_per_node: devices per node.
  """

  duration_s: float
  events: tuple[Event, ...]
  nodes: int
  devices_per_node: int

  @property
  def failures(self) -> int:
    return sum(e.kind == "fail" for e in self.events)

  @property
  def rejoins(self) -> int:
    return sum(e.kind == "rejoin" for e in self.events)

  @property
  def slowdowns(self) -> int:
    return sum(e.kind == "slow" for e in self.events)

  def causes(self) -> dict[str, int]:
    """Failures per cause, counting a switch's nodes once (events of one time and cause)."""
    seen: dict[str, set[float]] = {}
    for e in self.events:
      if e.kind == "fail":
        seen.setdefault(e.cause, set()).add(e.time_s)
    return {cause: len(times) for cause, times in seen.items()}


def poisson_trace(
  *,
  nodes: int,
  devices_per_node: int,
  duration_s: float,
  device_mtbf_s: float,
  node_mtbf_s: float = math.inf,
  repair_s: float = math.inf,
  seed: int = 0,
) -> Trace:
  """Independent exponential failures of devices and of whole nodes, each repaired after
  `repair_s`.

  Every live device fails at rate `1/device_mtbf_s` and every live node at `1/node_mtbf_s`
  (both memoryless, so the superposition is sampled directly: one exponential gap at the total
  rate, then which device or node). A failed device or node rejoins `repair_s` later; until
  then it cannot fail again. The same process as `mix_trace` with two causes.

  Args:
    nodes: nodes in the cluster.
    devices_per_node: devices per node.
    duration_s: trace length.
    device_mtbf_s: mean time between failures of one device; `inf`: devices never fail alone.
    node_mtbf_s: mean time between failures of one node (power, network, host); `inf`: never.
    repair_s: repair time; `inf`: failed hardware never rejoins.
    seed: random seed.

  Returns:
    The trace.
  """
  for name, v in (
    ("duration_s", duration_s),
    ("device_mtbf_s", device_mtbf_s),
    ("node_mtbf_s", node_mtbf_s),
    ("repair_s", repair_s),
  ):
    _check_positive(f"trace.{name}", v)
  if not math.isfinite(duration_s):
    raise TraceError("trace.duration_s must be finite")
  rates = [
    _Rate("", "device", 0.0 if math.isinf(device_mtbf_s) else 1.0 / device_mtbf_s, repair_s),
    _Rate("", "node", 0.0 if math.isinf(node_mtbf_s) else 1.0 / node_mtbf_s, repair_s),
  ]
  events = _failures(rates, nodes, devices_per_node, 1, duration_s, np.random.default_rng(seed))
  return Trace(float(duration_s), tuple(events), nodes, devices_per_node)


@dataclasses.dataclass(frozen=True)
class Cause:
  """One cause of a failure mix.

  Attributes:
    name: what fails, for reports ("GPU", "HBM3", "network switch/cable").
    share: its share of the job's interruptions (the shares of a mix are normalised).
    scope: what one failure takes down (`SCOPES`): a device, a node, or a switch's nodes.
    repair_s: until the unit is back in the job: a spare's hand-over for hardware, a process
      relaunch for a transient cause; `inf`: never.
  """

  name: str
  share: float
  scope: str
  repair_s: float

  def __post_init__(self):
    if self.scope not in SCOPES:
      raise TraceError(f"cause {self.name!r}: scope {self.scope!r} is not one of {SCOPES}")
    _check_positive(f"cause {self.name!r} share", self.share)
    _check_positive(f"cause {self.name!r} repair_s", self.repair_s)


@dataclasses.dataclass(frozen=True)
class Stragglers:
  """Episodes of one device running slow (thermal throttling, a bad link, a noisy neighbour).

  Attributes:
    device_mtbs_s: mean time between episodes starting on one device (`inf`: none).
    speed: the fraction of its full speed a straggling device runs at.
    duration_s: how long an episode lasts.
  """

  device_mtbs_s: float = math.inf
  speed: float = 0.5
  duration_s: float = 3600.0

  def __post_init__(self):
    _check_positive("stragglers.device_mtbs_s", self.device_mtbs_s)
    _check_positive("stragglers.duration_s", self.duration_s)
    if not 0 < self.speed < 1:
      raise TraceError(f"stragglers.speed must be in (0, 1), got {self.speed!r}")


def mix_trace(
  *,
  nodes: int,
  devices_per_node: int,
  duration_s: float,
  device_mtbf_s: float,
  causes: Sequence[Cause],
  nodes_per_switch: int = 1,
  stragglers: Stragglers | None = None,
  seed: int = 0,
) -> Trace:
  """Failures from a published cause mix, and stragglers, reproducible by seed.

  The job is interrupted at rate `devices / device_mtbf_s` (how the mixes are published:
  interruptions of one job over its devices and days); cause `c` takes `c.share` of that,
  spread evenly over its units (each device, node or switch fails at `share * rate / units`
  while it is up). A failure takes its unit out until `c.repair_s` later. Stragglers come from
  their own random stream (the failures of a seed do not change with them): episodes start at
  rate `devices / device_mtbs_s` on a uniformly random device, which runs at `speed` for
  `duration_s`.

  Args:
    nodes: nodes in the cluster.
    devices_per_node: devices per node.
    duration_s: trace length.
    device_mtbf_s: the job's devices times its mean time between interruptions.
    causes: the mix.
    nodes_per_switch: nodes a "switch" cause takes down (a rack's top-of-rack switch).
    stragglers: slow-device episodes; None: none.
    seed: random seed.

  Returns:
    The trace, failures labelled with their cause.

  Raises:
    TraceError: for a non-positive time, rate or share.
  """
  _check_positive("trace.duration_s", duration_s)
  _check_positive("trace.device_mtbf_s", device_mtbf_s)
  if not math.isfinite(duration_s):
    raise TraceError("trace.duration_s must be finite")
  if not causes:
    raise TraceError("a failure mix needs at least one cause")
  if isinstance(nodes_per_switch, bool) or not isinstance(nodes_per_switch, int) or (
    nodes_per_switch < 1
  ):
    raise TraceError(f"trace.nodes_per_switch must be a positive integer, got {nodes_per_switch!r}")
  devices = nodes * devices_per_node
  units = {"device": devices, "node": nodes, "switch": -(-nodes // nodes_per_switch)}
  total = sum(c.share for c in causes)
  job_rate = devices / device_mtbf_s
  rates = [
    _Rate(c.name, c.scope, c.share / total * job_rate / units[c.scope], c.repair_s) for c in causes
  ]
  events = _failures(
    rates, nodes, devices_per_node, nodes_per_switch, duration_s, np.random.default_rng(seed)
  )
  if stragglers is not None and math.isfinite(stragglers.device_mtbs_s):
    rng = np.random.default_rng([seed, 1])
    events += _straggler_events(stragglers, devices, devices_per_node, duration_s, rng)
    events.sort(key=lambda e: e.time_s)
  return Trace(float(duration_s), tuple(events), nodes, devices_per_node)


def _straggler_events(
  s: Stragglers, devices: int, dpn: int, duration_s: float, rng: np.random.Generator
) -> list[Event]:
  """Episodes start as a Poisson process over the job; each ends `s.duration_s` later (an end
  past the trace is left out: the device is still slow when the trace stops)."""
  events = []
  t = 0.0
  while (t := t + rng.exponential(s.device_mtbs_s / devices)) < duration_s:
    node, local = divmod(int(rng.integers(devices)), dpn)
    events.append(Event(t, "slow", node, local, "straggler", s.speed))
    if t + s.duration_s < duration_s:
      events.append(Event(t + s.duration_s, "slow_end", node, local, "straggler", s.speed))
  return events


def _check_positive(name: str, v: float) -> None:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v <= 0:
    raise TraceError(f"{name} must be positive, got {v!r}")


@dataclasses.dataclass(frozen=True)
class _Rate:
  """One cause as the process samples it: the rate of each live unit of its scope."""

  cause: str
  scope: str
  per_unit: float
  repair_s: float


def _failures(
  rates: Sequence[_Rate], nodes: int, dpn: int, nodes_per_switch: int, duration_s: float,
  rng: np.random.Generator,
) -> list[Event]:
  """Failures and rejoins of independent memoryless causes, each unit down until repaired.

  Every live unit (device, node or switch) of a cause's scope fails at the cause's per-unit
  rate; a unit that is down cannot fail again until its repair, whatever the cause. The
  superposition is sampled directly: one exponential gap at the total rate, then which cause
  (in order), then which unit (uniform among the live ones, by rejection: few are down).
  """
  units = {"device": nodes * dpn, "node": nodes, "switch": -(-nodes // nodes_per_switch)}
  down: dict[str, set[int]] = {scope: set() for scope in SCOPES}
  repairs: list[tuple[float, int, str, int, str]] = []  # (time, order, scope, unit, cause)
  events: list[Event] = []
  t = 0.0
  while True:
    parts = [(units[r.scope] - len(down[r.scope])) * r.per_unit for r in rates]
    rate = sum(parts)
    gap = rng.exponential(1.0 / rate) if rate > 0 else math.inf
    if repairs and repairs[0][0] <= t + gap:
      # Memoryless: a repair before the next failure just restarts the clock at the repair.
      t, _, scope, unit, cause = heapq.heappop(repairs)
      if t >= duration_s:
        break
      down[scope].discard(unit)
      events += _unit_events(t, "rejoin", scope, unit, cause, nodes, dpn, nodes_per_switch)
      continue
    t += gap
    if t >= duration_s:
      break
    u, acc = rng.random() * rate, 0.0
    r = rates[-1]
    for part, cand in zip(parts, rates, strict=True):
      acc += part
      if u < acc:
        r = cand
        break
    while (unit := int(rng.integers(units[r.scope]))) in down[r.scope]:
      pass  # rejection sampling: few units are down at once
    down[r.scope].add(unit)
    heapq.heappush(repairs, (t + r.repair_s, len(events), r.scope, unit, r.cause))
    events += _unit_events(t, "fail", r.scope, unit, r.cause, nodes, dpn, nodes_per_switch)
  return events


def _unit_events(
  t: float, kind: str, scope: str, unit: int, cause: str, nodes: int, dpn: int, per_switch: int
) -> list[Event]:
  """The events of one unit failing or coming back: a switch is all of its nodes."""
  if scope == "device":
    return [Event(t, kind, unit // dpn, unit % dpn, cause)]
  if scope == "node":
    return [Event(t, kind, unit, -1, cause)]
  first = unit * per_switch
  return [Event(t, kind, n, -1, cause) for n in range(first, min(first + per_switch, nodes))]


def read_csv_trace(
  path: str | Path, *, nodes: int, devices_per_node: int, duration_s: float | None = None
) -> Trace:
  """Reads `time,event,node[,device[,cause[,speed]]]` rows (an optional header is skipped).

  Args:
    path: the CSV file.
    nodes: nodes in the cluster (events must name one of them).
    devices_per_node: devices per node.
    duration_s: trace length; None: the last event's time.

  Returns:
    The trace, events sorted by time.

  Raises:
    TraceError: for an unreadable file or a malformed row (the message gives file and line).
  """
  try:
    text = Path(path).read_text()
  except OSError as e:
    raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
  events = []
  for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
    cells = [c.strip() for c in row]
    if not cells or not any(cells) or cells[0].startswith("#"):
      continue
    if lineno == 1 and cells[0].lower() == "time":
      continue
    where = f"{path}:{lineno}"
    if len(cells) not in (3, 4, 5, 6):
      raise TraceError(
        f"{where}: expected time,event,node[,device[,cause[,speed]]], got {len(cells)} columns"
      )
    cells += [""] * (6 - len(cells))
    try:
      time_s = float(cells[0])
      node = int(cells[2])
      device = int(cells[3]) if cells[3] != "" else -1
      speed = float(cells[5]) if cells[5] != "" else 1.0
    except ValueError:
      raise TraceError(
        f"{where}: time and speed must be numbers, node and device integers"
      ) from None
    kind = cells[1].lower()
    if kind not in EVENT_KINDS:
      raise TraceError(f"{where}: event {cells[1]!r} is not one of {', '.join(EVENT_KINDS)}")
    if not math.isfinite(time_s) or time_s < 0:
      raise TraceError(f"{where}: time {cells[0]} is not a non-negative number of seconds")
    if not 0 <= node < nodes:
      raise TraceError(f"{where}: node {node} is outside the cluster's {nodes} nodes")
    if not -1 <= device < devices_per_node:
      raise TraceError(f"{where}: device {device} is outside 0..{devices_per_node - 1}")
    if not 0 < speed <= 1:
      raise TraceError(f"{where}: speed {cells[5]} is not in (0, 1]")
    events.append(Event(time_s, kind, node, device, cells[4], speed))
  events.sort(key=lambda e: e.time_s)
  end = duration_s if duration_s is not None else (events[-1].time_s if events else 0.0)
  if end <= 0:
    raise TraceError(f"trace {path}: duration must be positive (give trace.hours)")
  kept = tuple(e for e in events if e.time_s < end or duration_s is None)
  return Trace(float(end), kept, nodes, devices_per_node)


def write_csv_trace(trace: Trace, path: str | Path) -> None:
  """Writes `trace` in the format `read_csv_trace` reads."""
  labelled = any(e.cause or e.speed != 1.0 for e in trace.events)
  lines = ["time,event,node,device" + (",cause,speed" if labelled else "")]
  for e in trace.events:
    row = f"{e.time_s:.3f},{e.kind},{e.node},{e.device if e.device >= 0 else ''}"
    lines.append(row + (f",{e.cause},{e.speed:g}" if labelled else ""))
  Path(path).write_text("\n".join(lines) + "\n")


class FailureTracker:
  """The failed workers of a `Layout` as a trace's events are applied.

  Args:
    layout: where workers sit on nodes.
  """

  def __init__(self, layout: Layout):
    self.layout = layout
    self._down_dev: set[int] = set()
    self._down_node: set[int] = set()
    self._dead_devices: dict[Worker, int] = {}
    self._slow: dict[int, list[float]] = {}  # device -> the speeds of its episodes under way

  @property
  def failed(self) -> frozenset[Worker]:
    return frozenset(self._dead_devices)

  @property
  def slow(self) -> frozenset[tuple[Worker, float]]:
    """`(worker, speed)` of every worker with a slow device: its slowest device's speed."""
    speeds: dict[Worker, float] = {}
    for dev, episodes in self._slow.items():
      worker = self.layout.worker_of_device(dev)
      speeds[worker] = min(speeds.get(worker, 1.0), *episodes)
    return frozenset(speeds.items())

  def _devices(self, event: Event) -> Iterator[int]:
    base = event.node * self.layout.devices_per_node
    if event.device >= 0:
      yield base + event.device
    else:
      yield from range(base, base + self.layout.devices_per_node)

  def _set_down(self, dev: int, down: bool) -> None:
    worker = self.layout.worker_of_device(dev)
    n = self._dead_devices.get(worker, 0) + (1 if down else -1)
    if n:
      self._dead_devices[worker] = n
    else:
      self._dead_devices.pop(worker, None)

  def _is_down(self, dev: int) -> bool:
    return dev in self._down_dev or dev // self.layout.devices_per_node in self._down_node

  def apply(self, event: Event) -> frozenset[Worker]:
    """Applies one event; returns the failed workers after it. Redundant events are no-ops;
    a slowdown changes `slow`, not the failed set."""
    if event.node >= self.layout.nodes:
      raise TraceError(f"event {event.label()} names a node outside the {self.layout.nodes}")
    devices = list(self._devices(event))
    if event.kind in ("slow", "slow_end"):
      for dev in devices:
        episodes = self._slow.setdefault(dev, [])
        if event.kind == "slow":
          episodes.append(event.speed)
        elif event.speed in episodes:
          episodes.remove(event.speed)
        if not episodes:
          del self._slow[dev]
      return self.failed
    before = {dev: self._is_down(dev) for dev in devices}
    if event.device >= 0:
      (self._down_dev.add if event.kind == "fail" else self._down_dev.discard)(devices[0])
    else:
      (self._down_node.add if event.kind == "fail" else self._down_node.discard)(event.node)
    for dev in devices:
      now = self._is_down(dev)
      if now != before[dev]:
        self._set_down(dev, now)
    return self.failed
