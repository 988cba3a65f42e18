"""One process of a multi-process job on `jax.distributed`: liveness, agreement, transfers.

Everything a survivor needs from the outside world goes through here, and every blocking call
is bounded:

* **Death proofs.** `dead(ids)` returns the listed processes that are *proven* dead, without
  waiting for anybody: a process is dead when its transfer server's port refuses a TCP
  connection (`probe`; the kernel closes a killed process's ports at once), or when its
  heartbeat stopped: a daemon thread in every process bumps the counter `hb/{pid}` in the
  key-value store every `heartbeat_timeout_s / 10` seconds, and a process whose counter has
  not moved for `heartbeat_timeout_s` (while this process's own counter kept moving, so a
  stall here or in the store is not mistaken for silence there) is declared dead. The port
  proves a crash within milliseconds; the heartbeat covers a host that went silent (its
  ports time out instead of refusing, or, frozen, accept and never answer). A verdict is final.
  A pull from a silent host never fails by itself: once it is declared dead, every pull from
  it still pending is failed (`_cut_off`) and every wait on it given up (`wait`).
* **Agreement.** `decide(key, proposal)` is first writer wins: the proposal is written with
  `allow_overwrite=False`, and every caller then reads the key back and follows the *stored*
  value, never its own proposal, so every process that reads a decision acts on the same one
  (`runtime/multiprocess.py` decides each collective and each step attempt this way). A
  process that reads a decision listing itself as dead (possible only after a false heartbeat
  verdict) exits with `EXIT_DECLARED_DEAD`. The coordination service's `get_live_nodes` is not
  used: it is a barrier that declares a process dead only after the heartbeat timeout, and a
  process blocked in it while its peers followed a decision in the store and moved on would
  wait for them forever.
* **Transfers.** Activations and activation gradients move between processes with
  `jax.experimental.transfer`: the producer registers an array under an integer id
  (`offer`), the consumer pulls it (`pull`). Both calls return at once; the pulled array is
  filled asynchronously and turns into an error if the producer dies first. An array on a
  worker's sub-mesh crosses in the layout its receiver keeps it in (`runtime.wire`): one
  replica of a whole array, the pieces of a tensor-parallel split.
* **Rejoin.** A process started with the `process_id` of one that ran earlier in the same
  job (its `transfer/{pid}` key is set: the coordination service outlives every process but
  0) is `relaunched`: it keeps its predecessor's address key as it is (a survivor that has not
  yet found the predecessor dead probes that address, which refuses, rather than this new
  server's, which would accept and hide the death), starts its heartbeat only once admitted,
  and takes from its admission a `generation`: verdicts are per generation (`declared/{pid}/{g}`
  marks, `readmit` forgets this process's verdict on a peer), so a predecessor's death
  sentence never ends its successor. Admission itself is `runtime/admission.py`'s.
* **Watchdogs.** `wait` blocks on device results in a helper thread with a deadline, and `poll`
  (under every wait for keys: the key-value calls are `runtime/kvstore.py`'s) has the same
  deadline; a survivor that waits past
  `distributed.wait_timeout_s` exits with `EXIT_WAIT_TIMEOUT` instead of hanging. Process 0
  hosts the coordination service: a thread in every other process probes it and exits with
  `EXIT_COORDINATOR_LOST` as soon as it cannot reach it (after its `last_words`: a local copy
  of its stages). Process 0 lost and this host cut off look the same from here, so its last
  line names both and where the copy went; a job that lost process 0 is requeued and resumes
  from the newest step it can read.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from resilient_jax.config import DistributedConfig
from resilient_jax.exit_codes import (
  EXIT_COORDINATOR_LOST,
  EXIT_DECLARED_DEAD,
  EXIT_WAIT_TIMEOUT,
  end_process,
)
from resilient_jax.model.sharding import Where
from resilient_jax.observe.logs import info
from resilient_jax.runtime.joining import (
  await_coordinator,
  exit_on_abort,
  join_arguments,
  native_log_to,
)
from resilient_jax.runtime.kvstore import KeyValueStore
from resilient_jax.runtime.liveness import (
  HeartbeatMonitor,
  first_writer_wins,
  probe_address,
)
from resilient_jax.runtime.wire import landing, offered, split_of

PROBE_INTERVAL_S = 0.02
"""A peer that accepted a probe is not probed again sooner than this."""
HEARTBEAT_CHECK_S = 0.1
"""Heartbeat counters are read at most this often while waiting for a peer."""


Logger = Callable[[str], None]



def _local_ip(coordinator: str) -> str:
  """This host's address on the route to the coordinator (what peers can connect to)."""
  host, port = coordinator.rsplit(":", 1)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, int(port)))
      return s.getsockname()[0]
    except OSError:
      return "127.0.0.1"


def lost_coordinator_line(process_id: int, coordinator: str, copy: str, who: str = "") -> str:
  """What a process says as it ends on losing the coordination service: what it knows.

  It cannot tell process 0's loss from its own host being cut off from the job (the others
  may go on without it), so it names both, and where its local copy went; not what happens
  next, which is the scheduler's (and differs between the two).

  Args:
    process_id: this process.
    coordinator: the coordination service's address.
    copy: where its local copy went (`Cluster._say_last_words`).
    who: what noticed it, when not this process's own watchdog ("its distributed runtime ").
  """
  return (f"process {process_id}: {who}lost the coordination service at {coordinator} "
          f"(process 0 lost, or this host cut off); {copy}")


class Cluster(KeyValueStore):
  """Joins the job, starts this process's transfer server and the coordinator watchdog.

  Must be created before JAX initialises its backends.

  Args:
    cfg: the job's settings.
    log: where progress lines go.
    join_log: a file for what JAX's native runtime writes to stderr while this process joins
      (`joining.native_log_to`): a join that never forms then ends with one line naming it, not
      JAX's fatal log and C++ stack; removed once the join returns (what it caught goes to
      stderr). None: stderr is left as it is (the library's default; `launch.train` sets it).
  """

  def __init__(self, cfg: DistributedConfig, log: Logger = info,
               join_log: str | os.PathLike | None = None):
    self.cfg = cfg
    self.log = log
    jax.config.update("jax_enable_recoverability", True)
    # No XLA collective spans processes (a reduction is a gather over the transfer server,
    # `runtime.transport`); the only collectives are those inside a worker's sub-mesh, all on
    # this process's devices. Without cross-process CPU collectives they rendezvous in the
    # process: with gloo (jax's default once distributed) each sub-mesh's communicator is
    # registered in the coordination service under its device ids, and a relaunched process
    # (same ids; the service outlives it) failed on the key its predecessor left.
    jax.config.update("jax_cpu_collectives_implementation", None)
    # Joining is a wait like any other: bounded by distributed.wait_timeout_s (JAX's default
    # is five minutes, then an abort), and ended with one line and the wait's exit code.
    wait_s = max(1, int(cfg.wait_timeout_s))
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": cfg.heartbeat_timeout_s,
                              "initialization_timeout": wait_s}
    coordinator, num_processes, process_id = join_arguments(cfg, wait_s, kwargs)
    who = f"process {process_id}" if process_id >= 0 else "this process"
    if coordinator and process_id > 0:
      await_coordinator(coordinator, wait_s, who)
    never_formed = (
      f"{who}: the job at {coordinator or 'the detected coordinator'} did not form within "
      f"{wait_s}s (distributed.wait_timeout_s): did all {num_processes or 'its'} processes "
      "start, with this coordinator address?")
    exit_on_abort(EXIT_WAIT_TIMEOUT, lambda: never_formed + (
      f" (JAX's own log of it: {join_log})" if join_log and os.path.exists(join_log) else ""))
    # Said before, not during: JAX's join holds the GIL until it returns, so no thread of this
    # process can report while it waits (a reporter thread printed nothing).
    log(f"{who}: joining the job at {coordinator or 'the detected coordinator'} "
        f"({num_processes or 'all its'} processes), waiting at most {wait_s}s "
        "(distributed.wait_timeout_s)")
    with (contextlib.nullcontext() if join_log is None else native_log_to(join_log)):
      jax.distributed.initialize(**kwargs)
    from jax._src import distributed

    self.client = distributed.global_state.client
    self.coordinator: str = distributed.global_state.coordinator_address
    self.process_id = jax.process_index()
    self.num_processes = jax.process_count()
    self.device = jax.local_devices()[0]
    self._timeout_ms = cfg.wait_timeout_s * 1000
    self._last_beat = time.monotonic()
    self.stalled_s = 0.0
    """How long this process last went without a heartbeat past the timeout (0: never): it was
    frozen (SIGSTOP, a hung host) long enough for the others to give up on it."""
    self._stall_seen = -math.inf  # when that stall was noticed
    self.last_words: Callable[[], str] | None = None
    """Run before this process exits on the loss of the coordination service
    (`_say_last_words`); returns where its local copy went (`LocalCopies.write`)."""
    self._words_lock = threading.Lock()
    self._words_said: str | None = None  # what `last_words` returned (a second caller's too)
    if self.process_id == 0:
      # It hosts the service. Its clients abort once it stalls past the heartbeat timeout and
      # exit 5; so does it then, whichever it notices first (the runtime's abort, or the others
      # gone), never training on alone. Any other abort here is a bug, shown as one.
      exit_on_abort(EXIT_COORDINATOR_LOST, self._why_stalled, only_if=self._stalled)
    else:
      exit_on_abort(EXIT_COORDINATOR_LOST, lambda: lost_coordinator_line(
        self.process_id, self.coordinator, self._say_last_words(), "its distributed runtime "))
      threading.Thread(target=self._watch_coordinator, name="coordinator-watchdog",
                       daemon=True).start()

    from jax.experimental import transfer

    ip = _local_ip(self.coordinator)
    self._server = transfer.start_transfer_server(
      self.device.client, f"{ip}:0", [f"{ip}:0"]
    )
    self._addresses: dict[int, str] = {}
    self._connections: dict[int, Any] = {}
    self.bytes_offered = 0
    """Bytes of every array offered to other processes (each offer is pulled once)."""
    self.bytes_pulled = 0
    """Bytes of every array pulled from other processes."""
    # Liveness (see the module docstring).
    self._dead: set[int] = set()
    self._next_probe: dict[int, float] = {}
    self._heartbeat_interval_s = cfg.heartbeat_timeout_s / 10
    self._heartbeats = HeartbeatMonitor(self.process_id, cfg.heartbeat_timeout_s, min_beats=5)
    self._heartbeats_read = 0.0
    self.generation = 0
    """How many times this process id was admitted back into the job (0: an original)."""
    self.generations: dict[int, int] = {}
    """Other processes' generations, as this process admitted them."""
    # The coordination service keeps every key for the job's life: a predecessor's address
    # means this process was relaunched into a running job (see the module docstring).
    self.relaunched = self.kv_try_get(f"transfer/{self.process_id}") is not None
    if self.relaunched:
      self.log(f"process {self.process_id}: relaunched into a running job (generation unknown "
               "until admitted)")
    else:
      self.kv_set(f"transfer/{self.process_id}", self._server.address())
      self._start_heartbeat()

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
    line = lost_coordinator_line(self.process_id, self.coordinator, self._say_last_words())
    end_process(EXIT_COORDINATOR_LOST, f"{line}; exiting with code {EXIT_COORDINATOR_LOST}")

  def _say_last_words(self) -> str:
    """Runs `last_words` (the loop's local copy, `training/local_copies.py`) once, waiting at
    most `distributed.wait_timeout_s`, and returns where the copy went; a second caller (the
    watchdog and the runtime's abort race) waits for the first and gets the same answer."""
    with self._words_lock:
      if self._words_said is not None:
        return self._words_said
      words, self.last_words = self.last_words, None
      said = ["no local copy: no step was committed yet"]
      if words is not None:
        t = threading.Thread(target=lambda: said.append(words()), name="last-words",
                             daemon=True)
        t.start()
        t.join(self.cfg.wait_timeout_s)
        if t.is_alive():
          said.append(f"its local copy did not finish within {self.cfg.wait_timeout_s}s "
                      "(distributed.wait_timeout_s)")
      self._words_said = said[-1]
      return self._words_said

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

  # ---------------------------------------------------------------- liveness

  def _start_heartbeat(self) -> None:
    threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

  @property
  def address(self) -> str:
    """This process's transfer server (what peers pull from)."""
    return self._server.address()

  def admitted(self, generation: int) -> None:
    """This relaunched process was admitted as `generation`: it now answers for its own
    liveness (heartbeat, address key) like any live process."""
    self.generation = generation
    self.relaunched = False
    self.kv_set(f"transfer/{self.process_id}", self._server.address())
    self._start_heartbeat()

  def readmit(self, process: int, generation: int, address: str) -> None:
    """Forgets the verdict on `process`: it was admitted back as `generation`, its transfer
    server at `address` (its predecessor's connection and address are dropped)."""
    self._dead.discard(process)
    # Its predecessor's counter stopped long ago: the new one's silence counts from now.
    self._heartbeats.forget(process)
    self._cut_off(process)
    self._next_probe.pop(process, None)
    self._addresses[process] = address
    self.generations[process] = generation

  def _beat(self) -> None:
    """Bumps this process's heartbeat counter; and exits with `EXIT_DECLARED_DEAD` once the
    others declared this process dead (it was frozen, e.g. SIGSTOPped, for longer than the
    heartbeat timeout and has just been let go again): from this thread, so that a main thread
    that resumes inside a wait leaves at once instead of acting on decisions it missed."""
    n = 0
    me = self.process_id
    while True:
      n += 1
      self._stalled()  # before the beat: the gap since the last one
      self._last_beat = time.monotonic()
      try:
        self.client.key_value_set(f"hb/{me}", str(n), allow_overwrite=True)
        # A directory read: empty while nobody is declared, where a key read would raise.
        declared = {k for k, _ in self.client.key_value_dir_get("declared")}
        if f"declared/{me}/{self.generation}" in declared:
          self.declared_dead([me], "its heartbeat stopped for longer than "
                             f"{self.cfg.heartbeat_timeout_s}s")
      except Exception:  # a lost coordination service is the watchdog's business
        pass
      time.sleep(self._heartbeat_interval_s)

  def _stalled(self) -> bool:
    """Whether this process has gone without a heartbeat for longer than the timeout, now or
    within the last three timeouts (what the others do about it happens within that: their
    runtime aborts, and the loss reaches this process at its next wait). An older stall (a long
    pause of this process's Python that the others never saw) says nothing of a later loss."""
    now = time.monotonic()
    gap, timeout = now - self._last_beat, self.cfg.heartbeat_timeout_s
    if gap > timeout:
      self.stalled_s, self._stall_seen = gap, now
    return now - self._stall_seen < 3 * timeout

  def _why_stalled(self) -> str:
    return (f"process {self.process_id} (the coordination service) stalled for "
            f"{self.stalled_s:.0f}s, longer than distributed.heartbeat_timeout_s="
            f"{self.cfg.heartbeat_timeout_s}s: the other processes gave up on it and left "
            f"(exit {EXIT_COORDINATOR_LOST}); it does not train on alone: requeue the job, which "
            "resumes from its last checkpoint")

  def _address(self, process: int) -> str:
    if process not in self._addresses:
      self._addresses[process] = self.kv_get(f"transfer/{process}")
    return self._addresses[process]

  def probe(self, process: int) -> bool:
    """Whether `process` is proven dead by its transfer server refusing a connection.

    False if it accepted, or did not answer (a silent host; see `dead`). A peer that accepted
    is probed again only after `PROBE_INTERVAL_S`, one that did not answer after a second.
    """
    now = time.monotonic()
    if self._next_probe.get(process, 0.0) > now:
      return False
    if process not in self._addresses:
      address = self.kv_try_get(f"transfer/{process}")
      if address is None:  # it never got that far: only its heartbeat can tell
        return False
      self._addresses[process] = address
    refused = probe_address(self._addresses[process])
    if refused:
      return True
    self._next_probe[process] = now + (PROBE_INTERVAL_S if refused is False else 1.0)
    return False

  def dead(self, process_ids: Iterable[int]) -> set[int]:
    """The listed processes proven dead (a refused probe, or a stopped heartbeat); never blocks
    on other processes. A verdict is final: once dead, always dead to this process."""
    ids = set(process_ids) - {self.process_id}
    unknown = ids - self._dead
    for p in sorted(unknown):
      if self.probe(p):
        self._dead.add(p)
        self._cut_off(p)
        self.log(f"process {self.process_id}: process {p} refuses connections: dead")
    unknown -= self._dead
    now = time.monotonic()
    if unknown and now - self._heartbeats_read >= HEARTBEAT_CHECK_S:
      self._heartbeats_read = now
      rows = self._service(self.client.key_value_dir_get, "hb")
      counters = {int(k.rsplit("/", 1)[1]): int(v) for k, v in rows}
      silent = self._heartbeats.observe(counters, now, unknown) & unknown
      for p in sorted(silent):
        self._dead.add(p)
        self._cut_off(p)
        self.log(f"process {self.process_id}: no heartbeat from process {p} for "
                 f"{self.cfg.heartbeat_timeout_s}s: dead")
    return ids & self._dead

  def _cut_off(self, process: int) -> None:
    """Fails every pull from `process` still pending. A frozen process never answers them,
    and computations waiting on their arrays hold up this device's queue until they fail
    (later dispatches would block behind them); a crashed one's fail by themselves."""
    conn = self._connections.pop(process, None)
    if conn is not None:
      conn._poison_connection()  # noqa: SLF001 - the transfer API's only way to fail pulls

  def declared_dead(self, lost: Iterable[int], what: str) -> None:
    """Exits with `EXIT_DECLARED_DEAD` if this process is in an agreed `lost` set; else marks
    the lost processes `declared/{pid}/{generation}`, which a lost process that was only frozen
    reads once it runs again (`_beat`); under its generation, so that a successor admitted
    later is not meant."""
    lost = set(lost)
    if self.process_id == 0 and lost and self._stalled():
      end_process(EXIT_COORDINATOR_LOST, f"{self._why_stalled()}; exiting with code "
                  f"{EXIT_COORDINATOR_LOST}")
    if self.process_id in lost:
      end_process(EXIT_DECLARED_DEAD, f"process {self.process_id}: the other processes declared "
               f"this one dead ({what}) and went on without it; exiting with code "
               f"{EXIT_DECLARED_DEAD}")
    for p in sorted(lost):
      self.kv_set(f"declared/{p}/{self.generations.get(p, 0)}", True)
      self._cut_off(p)

  # ---------------------------------------------------------------- agreement

  def decide(self, key: str, proposal: Any) -> Any:
    """First writer wins (`first_writer_wins`): the value stored under `key`, to follow."""
    return self._service(first_writer_wins, self.client, key, proposal)

  # ---------------------------------------------------------------- transfers

  def offer(self, uid: int, arrays: Sequence[jax.Array],
            specs: Sequence[jax.ShapeDtypeStruct] | None = None) -> None:
    """Makes `arrays` (on this process's devices) available to one `pull(…, uid, …)`.

    Args:
      uid: the transfer's id.
      arrays: the arrays, on one device or a sub-mesh each.
      specs: the specs the receiver pulls them with (their splits matter: see the module
        docstring); None: every array is whole.
    """
    specs = [None] * len(arrays) if specs is None else specs
    self._server.await_pull(uid, [offered(x, s) for x, s in zip(arrays, specs, strict=True)])
    self.bytes_offered += sum(math.prod(x.shape) * x.dtype.itemsize for x in arrays)

  def pull(
    self, process: int, uid: int, specs: Sequence[jax.ShapeDtypeStruct],
    device: Where | None = None,
  ) -> list[jax.Array] | None:
    """Arrays `process` offered under `uid`, placed on `device` (one of this process's devices,
    or a worker's sub-mesh, split as each spec's sharding says; default: this process's first
    device); None if it cannot be reached.

    The arrays arrive asynchronously; if the producer dies first they hold an error, which
    surfaces in `wait`.
    """
    if process in self._dead:
      return None
    where = device or self.device
    wire = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=landing(s, where)) for s in specs]
    self.bytes_pulled += sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in specs)
    try:
      if process not in self._connections:
        self._connections[process] = self._server.connect(self._address(process))
      got = list(self._connections[process].pull(uid, wire))
    except Exception:  # connection refused: the peer is gone
      self._connections.pop(process, None)
      return None
    # A whole array landed on one device of a sub-mesh: the copies to its other devices run
    # on this host, after the one replica has crossed the network.
    return [x if isinstance(where, jax.Device) or split_of(s) is not None
            else jax.device_put(x, where) for x, s in zip(got, specs, strict=True)]

  def connect(self, peers: Iterable[int], salt: int = 0) -> None:
    """Opens the transfer connections to `peers` now, with one tiny transfer each way.

    The first transfer over a new connection costs a large fraction of a second; a survivor
    that takes over a failed worker's micro-batches would otherwise pay it inside the
    recovery. Every listed peer must call this with this process among its peers, and the
    same `salt` (0 at the start; the admission's step when a relaunched process is admitted:
    its transfers' ids must differ from those its predecessor already pulled).
    """
    peers = sorted(set(peers) - {self.process_id})
    token = jax.device_put(jax.numpy.zeros((1,), jax.numpy.float32), self.device)
    spec = jax.ShapeDtypeStruct((1,), jax.numpy.float32)
    base = (1 << 61) + (salt << 33)
    for p in peers:
      self.offer(base + self.process_id * 65536 + p, [token])
    pulled = [self.pull(p, base + p * 65536 + self.process_id, [spec]) for p in peers]
    self.wait([x for x in pulled if x is not None], "the first transfer from each peer")

  # ---------------------------------------------------------------- bounded waits

  def wait(self, tree: Any, what: str, peers: Iterable[int] = ()) -> BaseException | None:
    """Blocks until every array in `tree` is computed; returns the error if one failed.

    Args:
      tree: arrays, some possibly computed from other processes' data or in a collective with
        them.
      what: names the wait in messages.
      peers: the processes the arrays may wait on. Once one of them is proven dead (`dead`: a
        crash, or a stalled process whose heartbeat stopped), the wait is abandoned and returns
        an error: a frozen peer holds a collective or a transfer forever without failing it,
        and must cost its own worker only, not the waiters' (the computation stays pending on
        the device; nothing later depends on it).

    Exits the process with `EXIT_WAIT_TIMEOUT` if that takes longer than the configured bound
    (`EXIT_COORDINATOR_LOST` if the coordination service is unreachable then: `timed_out`).
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
    peers = sorted(set(peers) - {self.process_id})
    deadline = time.monotonic() + self.cfg.wait_timeout_s
    while not box and time.monotonic() < deadline:
      t.join(HEARTBEAT_CHECK_S if peers else self.cfg.wait_timeout_s)
      dead = self.dead(peers) if peers and not box else set()
      if dead:
        return RuntimeError(f"processes {sorted(dead)} died while this one waited for {what}")
    if not box:
      self.timed_out(what)
    return box[0]

  def finish(self, code: int = 0) -> None:
    """Leaves the job. Process 0 lingers briefly so the others leave before the service."""
    if self.process_id == 0:
      time.sleep(1.0)
    end_process(code)
