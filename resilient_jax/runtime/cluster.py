"""One process of a multi-process job on `jax.distributed`: liveness, agreement, transfers.

Everything a survivor needs from the outside world goes through here, and every blocking call
is bounded:

* **Liveness and agreement.** `live(ids)` is the coordination service's `get_live_nodes`: a
  barrier over the listed processes that are alive, returning the *same* live set to each of
  them. It is used before every collective (a collective started with a dead peer can hang)
  and at the end of every step attempt (every survivor then either commits the step or re-runs
  it, never a mix).
* **Transfers.** Activations and activation gradients move between processes with
  `jax.experimental.transfer`: the producer registers an array under an integer id
  (`offer`), the consumer pulls it (`pull`). Both calls return at once; the pulled array is
  filled asynchronously and turns into an error if the producer dies first.
* **Watchdogs.** `wait` blocks on device results in a helper thread with a deadline; a survivor
  that waits past `distributed.wait_timeout_s` exits with `EXIT_WAIT_TIMEOUT` instead of
  hanging. Process 0 hosts the coordination service: a thread in every other process probes it
  and exits with `EXIT_COORDINATOR_LOST` as soon as it is gone, so a cluster scheduler can
  requeue the job, which then resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from resilient_jax.config import DistributedConfig

EXIT_COORDINATOR_LOST = 5
"""The coordination service (process 0) died: requeue the job; it resumes from a checkpoint."""
EXIT_WAIT_TIMEOUT = 6
"""A blocking wait passed `distributed.wait_timeout_s` (a live peer stopped making progress)."""

Logger = Callable[[str], None]


def exit_now(code: int, message: str) -> None:
  """Prints one line and ends the process at once (no atexit handlers: the distributed client's
  shutdown would block on peers that are gone)."""
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(code)


def _local_ip(coordinator: str) -> str:
  """This host's address on the route to the coordinator (what peers can connect to)."""
  host, port = coordinator.rsplit(":", 1)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, int(port)))
      return s.getsockname()[0]
    except OSError:
      return "127.0.0.1"


_ABORT_HANDLER: Any = None


def _exit_on_abort(code: int) -> None:
  """Turns SIGABRT into exit `code`.

  When the coordination service goes away, the distributed client's own error handler aborts
  the process from a C++ thread (often before this module's watchdog notices), which would
  exit with 134 rather than the documented code. Python's `signal` module cannot intercept
  that (its handlers run later, on the main thread), so a C-level handler is installed
  through ctypes.
  """
  global _ABORT_HANDLER
  import ctypes
  import signal

  handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

  def on_abort(signum: int) -> None:
    os.write(2, b"the distributed runtime aborted this process (the coordination service on "
                b"process 0 is gone); exiting with code %d\n" % code)
    os._exit(code)

  _ABORT_HANDLER = handler_type(on_abort)
  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = [ctypes.c_int, handler_type]
  libc.signal(signal.SIGABRT, _ABORT_HANDLER)


class Cluster:
  """Joins the job, starts this process's transfer server and the coordinator watchdog.

  Must be created before JAX initialises its backends.
  """

  def __init__(self, cfg: DistributedConfig, log: Logger = print):
    self.cfg = cfg
    self.log = log
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": cfg.heartbeat_timeout_s}
    if cfg.coordinator:
      kwargs["coordinator_address"] = cfg.coordinator
    if cfg.num_processes:
      kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id >= 0:
      kwargs["process_id"] = cfg.process_id
    jax.distributed.initialize(**kwargs)
    from jax._src import distributed

    self.client = distributed.global_state.client
    self.coordinator: str = distributed.global_state.coordinator_address
    self.process_id = jax.process_index()
    self.num_processes = jax.process_count()
    self.device = jax.local_devices()[0]
    self._timeout_ms = cfg.wait_timeout_s * 1000
    if self.process_id != 0:
      _exit_on_abort(EXIT_COORDINATOR_LOST)
      threading.Thread(target=self._watch_coordinator, name="coordinator-watchdog",
                       daemon=True).start()

    from jax.experimental import transfer

    ip = _local_ip(self.coordinator)
    self._server = transfer.start_transfer_server(
      self.device.client, f"{ip}:0", [f"{ip}:0"]
    )
    self.kv_set(f"transfer/{self.process_id}", self._server.address())
    self._addresses: dict[int, str] = {}
    self._connections: dict[int, Any] = {}

  # ---------------------------------------------------------------- failure of process 0

  def _watch_coordinator(self) -> None:
    host, port = self.coordinator.rsplit(":", 1)
    misses = 0
    while True:
      time.sleep(0.5)
      try:
        socket.create_connection((host, int(port)), timeout=2).close()
        misses = 0
      except OSError:
        misses += 1
        if misses >= 2:
          self.coordinator_lost()

  def coordinator_lost(self) -> None:
    exit_now(
      EXIT_COORDINATOR_LOST,
      f"process {self.process_id}: the coordination service (process 0 at {self.coordinator}) "
      f"is gone; exiting with code {EXIT_COORDINATOR_LOST} so the job is restarted from its "
      "latest checkpoint",
    )

  def _service(self, fn: Callable[..., Any], *args: Any) -> Any:
    """Calls the coordination service; its loss ends this process with the documented code."""
    try:
      return fn(*args)
    except Exception as e:  # the client raises plain runtime errors for lost RPCs
      self.check_coordinator()
      raise RuntimeError(f"coordination service call failed: {e}") from None

  def check_coordinator(self) -> None:
    """Exits with `EXIT_COORDINATOR_LOST` if the coordination service is unreachable."""
    if self.process_id != 0 and not self._coordinator_reachable():
      self.coordinator_lost()

  def _coordinator_reachable(self) -> bool:
    host, port = self.coordinator.rsplit(":", 1)
    try:
      socket.create_connection((host, int(port)), timeout=2).close()
      return True
    except OSError:
      return False

  # ---------------------------------------------------------------- agreement

  def live(self, process_ids: Iterable[int]) -> set[int]:
    """The live subset of `process_ids`, the same in every live caller (a barrier over them).

    Blocks until every listed process has called it or been declared dead (up to the
    heartbeat timeout).
    """
    ids = sorted(set(process_ids))
    return set(self._service(self.client.get_live_nodes, ids))

  def kv_set(self, key: str, value: Any) -> None:
    self._service(self.client.key_value_set, key, json.dumps(value), True)

  def kv_get(self, key: str) -> Any:
    """Waits (bounded) for `key` to be set."""
    try:
      raw = self.client.blocking_key_value_get(key, self._timeout_ms)
    except Exception as e:
      self.check_coordinator()
      if "DEADLINE_EXCEEDED" in str(e):
        exit_now(EXIT_WAIT_TIMEOUT, f"process {self.process_id}: timed out waiting for {key!r}")
      raise
    return json.loads(raw)

  def kv_try_get(self, key: str) -> Any | None:
    try:
      return json.loads(self.client.key_value_try_get(key))
    except Exception:  # NOT_FOUND
      return None

  # ---------------------------------------------------------------- transfers

  def offer(self, uid: int, arrays: Sequence[jax.Array]) -> None:
    """Makes `arrays` (on this process's device) available to one `pull(…, uid, …)`."""
    self._server.await_pull(uid, list(arrays))

  def pull(
    self, process: int, uid: int, specs: Sequence[jax.ShapeDtypeStruct]
  ) -> list[jax.Array] | None:
    """Arrays `process` offered under `uid`, placed on this device; None if it cannot be reached.

    The arrays arrive asynchronously; if the producer dies first they hold an error, which
    surfaces in `wait`.
    """
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    try:
      if process not in self._connections:
        if process not in self._addresses:
          self._addresses[process] = self.kv_get(f"transfer/{process}")
        self._connections[process] = self._server.connect(self._addresses[process])
      return list(self._connections[process].pull(uid, specs))
    except Exception:  # connection refused: the peer is gone
      self._connections.pop(process, None)
      return None

  def connect(self, peers: Iterable[int]) -> None:
    """Opens the transfer connections to `peers` now, with one tiny transfer each way.

    The first transfer over a new connection costs a large fraction of a second; a survivor
    that takes over a failed worker's micro-batches would otherwise pay it inside the
    recovery. Every listed peer must call this with this process among its peers.
    """
    peers = sorted(set(peers) - {self.process_id})
    token = jax.device_put(jax.numpy.zeros((1,), jax.numpy.float32), self.device)
    spec = jax.ShapeDtypeStruct((1,), jax.numpy.float32)
    base = 1 << 61
    for p in peers:
      self.offer(base + self.process_id * 65536 + p, [token])
    pulled = [self.pull(p, base + p * 65536 + self.process_id, [spec]) for p in peers]
    self.wait([x for x in pulled if x is not None], "the first transfer from each peer")

  # ---------------------------------------------------------------- bounded waits

  def wait(self, tree: Any, what: str) -> BaseException | None:
    """Blocks until every array in `tree` is computed; returns the error if one failed.

    Exits the process with `EXIT_WAIT_TIMEOUT` if that takes longer than the configured bound.
    """
    box: list[BaseException | None] = []

    def run() -> None:
      try:
        jax.block_until_ready(tree)
        box.append(None)
      except Exception as e:  # an array computed from a lost peer's data
        box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(self.cfg.wait_timeout_s)
    if not box:
      exit_now(EXIT_WAIT_TIMEOUT, f"process {self.process_id}: waited more than "
               f"{self.cfg.wait_timeout_s}s for {what}; exiting with code {EXIT_WAIT_TIMEOUT}")
    return box[0]

  def finish(self, code: int = 0) -> None:
    """Leaves the job. Process 0 lingers briefly so the others leave before the service."""
    sys.stdout.flush()
    sys.stderr.flush()
    if self.process_id == 0:
      time.sleep(1.0)
    os._exit(code)
