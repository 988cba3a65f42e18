"""Failure traces: when which nodes or devices fail and when they rejoin.

A trace is a time-ordered list of events on a cluster of `nodes` nodes with `devices_per_node`
devices each. An event names a node and optionally one of its devices (-1: the whole node).
Traces come from a seeded Poisson process (`poisson_trace`) or from a CSV file
(`read_csv_trace`) with the columns `time,event,node[,device]`: seconds from the start, `fail`
or `rejoin`, the node, and optionally the device inside it::

    time,event,node,device
    3600,fail,12,3
    7200,fail,40
    25200,rejoin,40

`FailureTracker` turns the events into the set of failed workers of a `Layout` (a worker is
down while any of its devices is down, i.e. failed on its own or on a failed node).
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import math
from collections.abc import Iterator
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
  "poisson_trace",
  "read_csv_trace",
  "write_csv_trace",
]

EVENT_KINDS = ("fail", "rejoin")


class TraceError(ValueError):
  """A trace file or trace parameter is malformed; the message says where."""


@dataclasses.dataclass(frozen=True, order=True)
class Event:
  """One failure or rejoin.

  Attributes:
    time_s: seconds from the start of the trace.
    kind: "fail" or "rejoin".
    node: the node.
    device: the device inside the node, or -1 for the whole node.
  """

  time_s: float
  kind: str
  node: int
  device: int = -1

  def label(self) -> str:
    where = f"node {self.node}" + (f" device {self.device}" if self.device >= 0 else "")
    return f"{self.kind} {where}"


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
  then it cannot fail again.

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
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v <= 0:
      raise TraceError(f"trace.{name} must be positive, got {v!r}")
  if not math.isfinite(duration_s):
    raise TraceError("trace.duration_s must be finite")
  rng = np.random.default_rng(seed)
  n_dev = nodes * devices_per_node
  dev_rate = 0.0 if math.isinf(device_mtbf_s) else 1.0 / device_mtbf_s
  node_rate = 0.0 if math.isinf(node_mtbf_s) else 1.0 / node_mtbf_s
  down_dev: set[int] = set()
  down_node: set[int] = set()
  repairs: list[tuple[float, int, int]] = []  # (time, node, device or -1)
  events: list[Event] = []
  t = 0.0
  while True:
    rate = (n_dev - len(down_dev)) * dev_rate + (nodes - len(down_node)) * node_rate
    gap = rng.exponential(1.0 / rate) if rate > 0 else math.inf
    if repairs and repairs[0][0] <= t + gap:
      # Memoryless: a repair before the next failure just restarts the clock at the repair.
      t, node, dev = heapq.heappop(repairs)
      if t >= duration_s:
        break
      (down_node if dev < 0 else down_dev).discard(node if dev < 0 else dev)
      events.append(Event(t, "rejoin", node, dev if dev < 0 else dev % devices_per_node))
      continue
    t += gap
    if t >= duration_s:
      break
    if rng.random() * rate < (n_dev - len(down_dev)) * dev_rate:
      while (dev := int(rng.integers(n_dev))) in down_dev:
        pass  # rejection sampling: few devices are down at once
      down_dev.add(dev)
      node, local = divmod(dev, devices_per_node)
      heapq.heappush(repairs, (t + repair_s, node, dev))
    else:
      while (node := int(rng.integers(nodes))) in down_node:
        pass
      down_node.add(node)
      local = -1
      heapq.heappush(repairs, (t + repair_s, node, -1))
    events.append(Event(t, "fail", node, local))
  return Trace(float(duration_s), tuple(events), nodes, devices_per_node)


def read_csv_trace(
  path: str | Path, *, nodes: int, devices_per_node: int, duration_s: float | None = None
) -> Trace:
  """Reads `time,event,node[,device]` rows (an optional header line is skipped).

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
    if len(cells) not in (3, 4):
      raise TraceError(f"{where}: expected time,event,node[,device], got {len(cells)} columns")
    try:
      time_s = float(cells[0])
      node = int(cells[2])
      device = int(cells[3]) if len(cells) == 4 and cells[3] != "" else -1
    except ValueError:
      raise TraceError(f"{where}: time must be a number, node and device integers") from None
    kind = cells[1].lower()
    if kind not in EVENT_KINDS:
      raise TraceError(f"{where}: event {cells[1]!r} is not one of {', '.join(EVENT_KINDS)}")
    if not math.isfinite(time_s) or time_s < 0:
      raise TraceError(f"{where}: time {cells[0]} is not a non-negative number of seconds")
    if not 0 <= node < nodes:
      raise TraceError(f"{where}: node {node} is outside the cluster's {nodes} nodes")
    if not -1 <= device < devices_per_node:
      raise TraceError(f"{where}: device {device} is outside 0..{devices_per_node - 1}")
    events.append(Event(time_s, kind, node, device))
  events.sort(key=lambda e: e.time_s)
  end = duration_s if duration_s is not None else (events[-1].time_s if events else 0.0)
  if end <= 0:
    raise TraceError(f"trace {path}: duration must be positive (give trace.hours)")
  kept = tuple(e for e in events if e.time_s < end or duration_s is None)
  return Trace(float(end), kept, nodes, devices_per_node)


def write_csv_trace(trace: Trace, path: str | Path) -> None:
  """Writes `trace` in the format `read_csv_trace` reads."""
  lines = ["time,event,node,device"]
  lines += [
    f"{e.time_s:.3f},{e.kind},{e.node},{e.device if e.device >= 0 else ''}" for e in trace.events
  ]
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

  @property
  def failed(self) -> frozenset[Worker]:
    return frozenset(self._dead_devices)

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
    """Applies one event; returns the failed workers after it. Redundant events are no-ops."""
    if event.node >= self.layout.nodes:
      raise TraceError(f"event {event.label()} names a node outside the {self.layout.nodes}")
    devices = list(self._devices(event))
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
