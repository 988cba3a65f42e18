"""Activations and gradients on their way from other processes: pulled early, used once arrived.

A device runs its computations in the order they were dispatched (platform facts, jax 0.10,
CPU): a computation dispatched on an array that a transfer-server pull has not filled yet holds
back every computation dispatched to the same device after it, until the pull lands (device
copies of a pending pull are not held back, other devices are not, and the transfer server
keeps serving ready offers). A process that holds several workers must therefore never put such
a wait into a device's queue: any computation of another worker that lands on that device waits
behind it. One did: the last stage's backward seeded its gradient with `jnp.float32(1.0)`, a
computation on the process's first device, so in a pipeline whose stages alternate between two
processes (stage A on process 0's first device, B on process 1, C on process 0's second device)
C's backward waited for A's, queued first and waiting for B's gradient, which waited for C's:
every process hit its wait bound (exit 6).

So the interpreter pulls every activation and gradient its slots will read from other processes
at the start of an attempt (`Inbox.put`: the pulls are asynchronous and cost nothing while
pending), dispatches an op that reads one only once it has arrived (`arrived`), and, when
nothing else can be dispatched, waits for the first of those it needs (`wait_any`: bounded by
`distributed.wait_timeout_s` and abandoned for a producer found dead). The other pulls (a
reduction's gradient buffers, state hand-overs) are waited for before anything computes on them.
Every computation in a device's queue then has inputs that are computed or computing in this
process, so no queue waits on another process, whatever devices a computation's inputs come
from, and each slot still runs its op list in order, as the schedule assumes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

import jax

from resilient_jax.exit_codes import EXIT_WAIT_TIMEOUT, end_process
from resilient_jax.model.sharding import Where
from resilient_jax.runtime.cluster import HEARTBEAT_CHECK_S, Cluster
from resilient_jax.runtime.transport import ACT, GRAD, Key, Transport
from resilient_jax.schedule.core import BW, B, F, Op
from resilient_jax.schedule.plan import Slot, StepProgram

if TYPE_CHECKING:
  from resilient_jax.programs.stages import StagePrograms


class Inbox:
  """The pulls of one step attempt, by key, and when they arrive.

  Args:
    cluster: the joined job (liveness, the wait bound).
  """

  def __init__(self, cluster: Cluster):
    self.cluster = cluster
    self._pulls: dict[Hashable, tuple[int, list[jax.Array] | None]] = {}
    self._watched: set[Hashable] = set()
    self._lost: set[int] = set()
    # Bumped by every watcher thread whose pull landed; waiters sleep until it moves (a count,
    # not an event, so that several threads may wait at once without missing a wake-up).
    self._landed = 0
    self._changed = threading.Condition()

  def clear(self) -> None:
    """Forgets the last attempt's pulls (one still pending stays pending; nothing reads it)."""
    self._pulls.clear()
    self._watched.clear()
    self._lost.clear()

  def put(self, key: Hashable, process: int, arrays: list[jax.Array] | None) -> None:
    """Records the pull of `key` from `process` (None: the process could not be reached)."""
    self._pulls[key] = (process, arrays)

  def __contains__(self, key: Hashable) -> bool:
    return key in self._pulls

  def take(self, key: Hashable) -> tuple[int, list[jax.Array] | None]:
    """The pull of `key`: its process and arrays; None instead of arrays if they will not come
    (the process could not be reached, or was found dead while they were pending)."""
    process, arrays = self._pulls.pop(key)
    self._watched.discard(key)
    if arrays is not None and process in self._lost and not _ready(arrays):
      arrays = None
    return process, arrays

  def arrived(self, key: Hashable) -> bool:
    """Whether `key` can be read without waiting on another process (it arrived, failed, or
    will not come); True for a key that was never pulled (a local one)."""
    if key not in self._pulls:
      return True
    process, arrays = self._pulls[key]
    return arrays is None or process in self._lost or _ready(arrays)

  def wait_any(self, keys: Sequence[Hashable], what: str) -> None:
    """Blocks until one of `keys` `arrived`.

    A helper thread per key blocks on its arrays and wakes this wait; between wake-ups the
    producers' liveness is checked (`Cluster.dead`, which also fails their pending pulls), so a
    producer found dead ends the wait. Exits the process with `EXIT_WAIT_TIMEOUT` after
    `distributed.wait_timeout_s`. Several threads may wait at once.
    """
    cl = self.cluster
    deadline = time.monotonic() + cl.cfg.wait_timeout_s
    producers = {self._pulls[k][0] for k in keys if k in self._pulls}
    checked = time.monotonic()
    while True:
      with self._changed:
        seen = self._landed
      if any(self.arrived(k) for k in keys):
        return
      with self._changed:
        unwatched = [k for k in keys if k not in self._watched]
        self._watched.update(unwatched)
      for k in unwatched:
        threading.Thread(target=self._watch, args=(self._pulls[k][1],), daemon=True).start()
      now = time.monotonic()
      if now > deadline:
        end_process(EXIT_WAIT_TIMEOUT, f"process {cl.process_id}: waited more than "
                 f"{cl.cfg.wait_timeout_s}s for {what}; exiting with code {EXIT_WAIT_TIMEOUT}")
      if now - checked >= HEARTBEAT_CHECK_S:  # not on every arrival: probes cost a connection
        checked = now
        self._lost |= cl.dead(producers)
      with self._changed:
        if self._landed == seen:
          self._changed.wait(HEARTBEAT_CHECK_S)

  def _watch(self, arrays: Iterable[jax.Array]) -> None:
    try:
      jax.block_until_ready(list(arrays))
    except Exception:  # noqa: BLE001 - a failed pull has arrived too (as an error)
      pass
    with self._changed:
      self._landed += 1
      self._changed.notify_all()


def transfer_in(
  sp: StepProgram, prog: StagePrograms, slot: Slot, op: Op
) -> list[tuple[Key, int, jax.ShapeDtypeStruct]]:
  """What an op reads from other slots: (the transfer's key, the producing node, its spec) per
  transfer, in row order: one, several where it gathers a micro-batch's rows from pieces
  (`StepProgram.links`), none for an op that reads nothing from another slot (the first
  stage's F, the last stage's B or BW, W, FR). `prog` is the slot's whole-micro-batch program
  (a piece's specs are its rows of them)."""
  p, mb = sp.slots[slot], op.mb
  if op.kind == F and p.stage > 0:
    s, kind, spec, side = p.stage - 1, ACT, prog.input_spec, 1
  elif op.kind in (B, BW) and not p.last:
    s, kind, spec, side = p.stage, GRAD, prog.output_spec, 0
  else:
    return []
  if not sp.pieces:  # the common case, kept to one lookup
    src = sp.route[mb][p.stage - 1] if kind == ACT else sp.route[mb][p.stage + 1]
    return [((mb, s if kind == ACT else s + 1, kind, 0), sp.slots[src].node, spec)]
  out = []
  for link in sp.links(mb, s):
    if link[side] == slot:
      src, lo, hi = link[1 - side], link[2], link[3]
      out.append(((mb, s if kind == ACT else s + 1, kind, lo), sp.slots[src].node,
                  rows_spec(spec, hi - lo)))
  return out


def rows_spec(spec: jax.ShapeDtypeStruct, rows: int) -> jax.ShapeDtypeStruct:
  """`spec` with `rows` samples in its leading (batch) dimension."""
  if rows == spec.shape[0]:
    return spec
  return jax.ShapeDtypeStruct((rows, *spec.shape[1:]), spec.dtype)


def expect_inputs(
  sp: StepProgram, program: Callable[[Slot], StagePrograms], device: Callable[[Slot], Where],
  tp: Transport, slots: Sequence[Slot],
) -> dict[tuple[Slot, Op], tuple[Key, ...]]:
  """Announces to `tp` every transfer the ops of `slots` read from other processes (so their
  pulls start now: `Transport.expect`); returns their keys by (slot, op)."""
  out: dict[tuple[Slot, Op], tuple[Key, ...]] = {}
  for slot in slots:
    prog = program(slot)
    for op in sp.slots[slot].ops:
      keys = []
      for incoming in transfer_in(sp, prog, slot, op):
        if not tp.is_local(incoming[1]):
          tp.expect(*incoming, device(slot))
          keys.append(incoming[0])
      if keys:
        out[(slot, op)] = tuple(keys)
  return out


def _ready(arrays: Iterable[jax.Array]) -> bool:
  try:
    return all(x.is_ready() for x in arrays)
  except Exception:  # noqa: BLE001 - a failed pull is settled: its error flows on as data
    return True
