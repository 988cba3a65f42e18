"""The coordination service's key-value store as a process of a job uses it: every call
bounded, its loss ending the process with the documented code.

`Cluster` (`runtime/cluster.py`) is one: it brings the client (`jax.distributed`'s), its
configuration (`distributed.wait_timeout_s`), its death proofs (`dead`, which waits for nobody)
and `check_coordinator`. Waiting for keys is polling (`poll`): a wait for one process's key
(`await_key`) or for every one of several processes' keys under a directory (`await_keys`:
one directory read a poll, so the process that gathers from P processes makes O(1) calls to
the service once they have written, not P) ends when the keys are set or their owners are
proven dead, or after `wait_timeout_s` with `EXIT_WAIT_TIMEOUT`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from resilient_jax.config import DistributedConfig
from resilient_jax.exit_codes import EXIT_WAIT_TIMEOUT, end_process

T = TypeVar("T")

POLL_MIN_S, POLL_MAX_S = 0.002, 0.02
"""`KeyValueStore.poll` sleeps between checks, doubling from the first to the second."""


class KeyValueStore:
  """The key-value calls of `Cluster` (see the module docstring)."""

  client: Any
  cfg: DistributedConfig
  process_id: int
  _timeout_ms: int

  def check_coordinator(self) -> None:
    """Ends this process if the coordination service is gone (`Cluster`'s)."""
    raise NotImplementedError

  def dead(self, process_ids: Iterable[int]) -> set[int]:
    """The listed processes proven dead, waiting for nobody (`Cluster`'s)."""
    raise NotImplementedError

  def _service(self, fn: Callable[..., Any], *args: Any) -> Any:
    """Calls the coordination service; its loss ends this process with the documented code."""
    try:
      return fn(*args)
    except Exception as e:  # the client raises plain runtime errors for lost RPCs
      self.check_coordinator()
      raise RuntimeError(f"coordination service call failed: {e}") from None

  def timed_out(self, what: str) -> None:
    """Ends this process after a wait for `what` passed `distributed.wait_timeout_s`: with
    `EXIT_COORDINATOR_LOST` and its local copy when the coordination service is unreachable
    then (its host cut off from process 0's, or process 0 lost: a wait for the others cannot
    end while the service is gone, and the watchdog may not have noticed yet), so that a
    process that lost the service ends one way whichever noticed first; else
    `EXIT_WAIT_TIMEOUT`."""
    self.check_coordinator()
    end_process(EXIT_WAIT_TIMEOUT, f"process {self.process_id}: waited more than "
                f"{self.cfg.wait_timeout_s}s for {what}; exiting with code {EXIT_WAIT_TIMEOUT}")

  def poll(self, what: str, check: Callable[[], T | None], wake_key: str | None = None) -> T:
    """Calls `check` until it returns something other than None; returns that.

    Between calls it sleeps `POLL_MIN_S`, doubling up to `POLL_MAX_S`, or, given `wake_key`,
    waits that long for `wake_key` to be set (a decision that `check` reads), so that waiters
    follow a decision the moment it is written. Exits with `EXIT_WAIT_TIMEOUT` after
    `distributed.wait_timeout_s`.
    """
    deadline = time.monotonic() + self.cfg.wait_timeout_s
    delay = POLL_MIN_S
    while True:
      out = check()
      if out is not None:
        return out
      if time.monotonic() > deadline:
        self.timed_out(what)
      if wake_key is None:
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)
        continue
      try:
        self.client.blocking_key_value_get(wake_key, int(POLL_MAX_S * 1000))
      except Exception as e:
        if "DEADLINE_EXCEEDED" not in str(e):
          self.check_coordinator()
          raise RuntimeError(f"coordination service call failed: {e}") from None

  def await_key(self, key: str, owner: int, what: str) -> Any | None:
    """The value `owner` sets under `key`, once set; None if `owner` is proven dead first."""

    def check() -> tuple[Any] | None:
      value = self.kv_try_get(key)
      if value is not None:
        return (value,)
      if self.dead([owner]):
        return (self.kv_try_get(key),)  # it may have set the key just before dying
      return None

    return self.poll(what, check)[0]

  def await_keys(self, directory: str, owners: Iterable[int], what: str) -> dict[int, Any]:
    """What each of `owners` sets under `directory/OWNER`, once every one is set or its owner
    proven dead (left out). One directory read a poll rather than `await_key` per owner: the
    process that gathers from P processes makes O(1) calls to the coordination service once
    they have written, not P one after another."""
    wanted = {f"{directory}/{p}": p for p in owners}
    got: dict[int, Any] = {}

    def read() -> None:
      for k, v in self._service(self.client.key_value_dir_get, directory):
        if k in wanted:
          got[wanted[k]] = json.loads(v)

    def check() -> tuple[dict[int, Any]] | None:
      read()
      missing = [p for p in wanted.values() if p not in got]
      if missing and len(self.dead(missing)) < len(missing):
        return None
      if missing:
        read()  # one may have set its key just before dying
      return (got,)

    return self.poll(what, check)[0]

  def kv_set(self, key: str, value: Any) -> None:
    self._service(self.client.key_value_set, key, json.dumps(value), True)

  def kv_get(self, key: str) -> Any:
    """Waits (bounded) for `key` to be set."""
    try:
      raw = self.client.blocking_key_value_get(key, self._timeout_ms)
    except Exception as e:
      self.check_coordinator()
      if "DEADLINE_EXCEEDED" in str(e):
        end_process(EXIT_WAIT_TIMEOUT, f"process {self.process_id}: timed out waiting for {key!r}")
      raise
    return json.loads(raw)

  def kv_try_get(self, key: str) -> Any | None:
    """The value under `key`, or None if it is not set."""
    try:
      raw = self.client.key_value_try_get(key)
    except Exception as e:
      if "NOT_FOUND" in str(e):
        return None
      self.check_coordinator()
      raise RuntimeError(f"coordination service call failed: {e}") from None
    return json.loads(raw)

  def kv_delete(self, key: str) -> None:
    """Deletes `key` and every key under `key/`."""
    self._service(self.client.key_value_delete, key)

  def kv_keys(self, directory: str) -> list[str]:
    """Every key under `directory/`, at any depth."""
    return [k for k, _ in self._service(self.client.key_value_dir_get, directory)]

  def kv_dir(self, directory: str) -> dict[str, Any]:
    """Every key directly under `directory/`, by its last component."""
    rows = self._service(self.client.key_value_dir_get, directory)
    return {k.rsplit("/", 1)[1]: json.loads(v) for k, v in rows}

