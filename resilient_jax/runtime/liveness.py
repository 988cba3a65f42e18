"""The pure parts of a job's liveness and agreement, apart from the process that uses them
(`runtime/cluster.py`): first-writer-wins decisions in the key-value store, the heartbeat
verdict, and the port probe that proves a crashed process dead.

Costs: a decision is one write and one read of a small key per caller; a heartbeat reading is
one read of every process's counter (O(processes) bytes, every `HEARTBEAT_CHECK_S` at most,
only while waiting on a peer); a probe is one TCP connection.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping
from typing import Any

PROBE_TIMEOUT_S = 0.25
"""A probe that gets no answer within this proves nothing (a silent host: left to heartbeats)."""


def first_writer_wins(client: Any, key: str, proposal: Any) -> Any:
  """Writes `proposal` (JSON) under `key` unless a value is there already; returns the stored
  value, which every caller must follow (it is the same for all of them).

  Args:
    client: a `jax.distributed` client (`key_value_set(key, value, allow_overwrite)`, which
      raises an ALREADY_EXISTS error for a key that is set, and `key_value_try_get`).
    key: the decision's key; written once, never overwritten or deleted.
    proposal: this caller's proposal.
  """
  value = json.dumps(proposal)
  try:
    client.key_value_set(key, value, allow_overwrite=False)
    return json.loads(value)  # stored: ours
  except Exception as e:  # JaxRuntimeError
    if "ALREADY_EXISTS" not in str(e):
      raise
  return json.loads(client.key_value_try_get(key))


class HeartbeatMonitor:
  """Tells from successive readings of every process's heartbeat counter which went silent.

  A process is silent when its counter has not changed for `timeout_s` of local time and, over
  the same span, the observing process's own counter (read in the same reading) advanced by at
  least `min_beats`: so a stall of the observer or of the store, which also stops the
  observer's own counter, is never taken for silence of the peer. Readings may be far apart:
  an unchanged counter means no beat arrived in between.

  Args:
    me: the observing process (its counter is the reference).
    timeout_s: silence that makes a process dead.
    min_beats: the observer's own beats needed over that span.
  """

  def __init__(self, me: int, timeout_s: float, min_beats: int):
    self.me = me
    self.timeout_s = timeout_s
    self.min_beats = min_beats
    self._since: dict[int, tuple[int | None, float, int]] = {}

  def forget(self, process: int) -> None:
    """Drops what was seen of `process` (admitted back: its silence counts from now on)."""
    self._since.pop(process, None)

  def observe(self, counters: Mapping[int, int], now: float,
              processes: Iterable[int] = ()) -> set[int]:
    """Records one reading of the counters; returns the processes that are silent.

    Args:
      counters: process id -> counter, as read from the store at (about) `now`.
      now: `time.monotonic()` of the reading.
      processes: processes to watch that may not have written a counter yet.
    """
    mine = counters.get(self.me, 0)
    silent = set()
    for p in set(counters) | set(self._since) | set(processes):
      if p == self.me:
        continue
      value = counters.get(p)
      seen = self._since.get(p)
      if seen is None or seen[0] != value:
        self._since[p] = (value, now, mine)
      elif now - seen[1] >= self.timeout_s and mine - seen[2] >= self.min_beats:
        silent.add(p)
    return silent


def parse_address(address: str) -> tuple[str, int]:
  """`HOST:PORT` or `[V6HOST]:PORT` (a transfer server's `address()`) -> (host, port)."""
  host, port = address.rsplit(":", 1)
  return host.strip("[]"), int(port)


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
  """Connects to `address` and hangs up. True: refused (nothing listens: its process is
  dead); False: accepted; None: no answer in `timeout_s` or unreachable (proves nothing)."""
  try:
    socket.create_connection(parse_address(address), timeout=timeout_s).close()
    return False
  except ConnectionRefusedError:
    return True
  except OSError:
    return None
