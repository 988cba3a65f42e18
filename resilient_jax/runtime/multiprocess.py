"""The multi-process transport: the interpreter's slots spread over a `jax.distributed` job.

Every process runs the same interpreter on the same plan (derived deterministically from the
agreed set of failed nodes) and executes only its own slots' ops. Nodes are workers: one
process drives all its host's devices and holds several of them, as `ProcessLayout` places
them (`resilient_jax.spec.placement`, the simulator's placement too). Data between two nodes of
one process moves with `jax.device_put`, between processes over the transfer server:

* an activation or activation gradient for a slot of another process is offered to it under
  an id derived from (step, attempt, micro-batch, stage, kind), so a stale attempt's data can
  never be mistaken for the current one's; the consumer pulls it asynchronously at the start of
  the attempt and computes on it once it has arrived (`runtime.inbox`);
* a reduction whose holders span processes sums each process's members there (a
  reduce-scatter among its devices, `Transport.scatter_sum`), then runs a ring
  (reduce-scatter, all-gather) over the member processes on the same transfers
  (`ProcessTransport._ring`): 2 (P - 1) / P buffers in and out per process at any P;
* the end of the attempt is agreed: every process installs its new state on a commit, or every
  survivor drops the attempt on a loss and the step is re-run on the new plan.

**The failure unit is the process.** Agreement, liveness and transfers are between processes
(`Cluster` knows nothing of nodes); a process found dead loses every node it held at once
(`Outcome.lost`), and the policies re-route each lost worker's micro-batches to its stage's
peers.

**An attempt either commits everywhere or nowhere.** A live process always runs its whole op
list, even after a peer died: data from a dead peer arrives as an error array (or zeros, if the
peer could not be reached), which flows on as data, so no live peer ever waits for data that
will not come. Decisions go through the key-value store, first writer wins
(`Cluster.decide`), under `step/{step}/{attempt}/`, and every process follows the stored
decision, never its own proposal:

* At the end, each process writes `end/{pid}` (its status: ok, or why not, and its losses),
  then follows `end/outcome`: `{"commit": true}` is proposed once every participant reported
  success, `{"lost": [pids]}` once a participant is proven dead (`Cluster.dead`: its port
  refuses connections, or its heartbeat stopped). A process that finds itself in `lost` (it was
  frozen, or a heartbeat verdict was false) exits with `EXIT_DECLARED_DEAD`.

Each directory is read whole in one call, and a waiter blocks on its decision key between
reads, so it follows a decision as soon as it is written. Every wait has the
`distributed.wait_timeout_s` deadline of `Cluster.poll`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from resilient_jax.model.sharding import Where, target, worker_mesh
from resilient_jax.runtime.cluster import Cluster
from resilient_jax.runtime.inbox import Inbox
from resilient_jax.runtime.transport import (
  STATE,
  Devices,
  Key,
  Lookup,
  Outcome,
  PerDevice,
  Specs,
  Tag,
  Transfer,
  Transport,
  _add,
  _owners,
  _reduce_programs,
  _sum,
)
from resilient_jax.schedule import ring
from resilient_jax.spec import placement as placement_lib

PauseHook = Callable[[int, str], None]
"""Called with (step, where) at points a test may kill this process: "start" before a step,
the op's text (e.g. "F1") after an op is dispatched, "AR" inside the all-reduce."""


PIECE_ROWS = 64
"""Pieces of micro-batches cross processes only where they start below this row: their
transfers' ids (`ProcessTransport._tid`) have 6 bits for it. `training.run.start_run` refuses
`resilience.pieces` in a job of larger micro-batches."""


def transfer_id(step: int, attempt: int, mb: int, stage: int, kind: int) -> int:
  """A unique id per (step, attempt mod 64, micro-batch, stage, kind), below 2**60.

  Raises:
    ValueError: a field outside its range (2**22 steps, 2**16 micro-batches, 2**10 stages).
  """
  if not (0 <= step < 1 << 22 and 0 <= mb < 1 << 16 and 0 <= stage < 1 << 10):
    raise ValueError(f"transfer id out of range: step {step}, micro-batch {mb}, stage {stage}")
  return (((step * 64 + attempt % 64) * 65536 + mb) * 1024 + stage) * 4 + kind


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
  """Which process, and which of its local devices, each node (worker) of the grid runs on.

  Node `d * pp + s` is worker `(d, s)` (the coordinator's numbering); every process derives
  the same map from the config and the job's shape (`of`).

  Attributes:
    slots: node -> (process, index of the worker among the process's workers).
    devices_per_worker: `mesh.tp`: worker `i` of a process drives its local devices
      `i * devices_per_worker ... (i + 1) * devices_per_worker - 1` (its sub-mesh).
  """

  slots: dict[int, tuple[int, int]]
  devices_per_worker: int = 1

  @classmethod
  def of(cls, dp: int, pp: int, placement: str, num_processes: int, local_devices: int,
         devices_per_worker: int = 1) -> ProcessLayout:
    """The layout of a dp x pp grid over `num_processes` processes of `local_devices` each
    (`placement.process_slots`, which states the rule).

    Raises:
      ValueError: the grid does not fill the job's devices exactly.
    """
    return cls(placement_lib.process_slots(dp, pp, placement, num_processes, local_devices,
                                           devices_per_worker), devices_per_worker)

  def placement(self, node: int) -> jax.Device | jax.sharding.Mesh:
    """The node's device, or with `devices_per_worker > 1` its sub-mesh (the single-process
    `Transport`'s placements)."""
    process, index = self.slots[node]
    tp = self.devices_per_worker
    devices = _devices_of(process)[index * tp:(index + 1) * tp]
    return devices[0] if tp == 1 else worker_mesh(devices)

  def process_of(self, node: int) -> int:
    return self.slots[node][0]

  def processes_of(self, nodes: Sequence[int]) -> list[int]:
    """The processes holding `nodes`, sorted."""
    return sorted({self.slots[n][0] for n in nodes})

  def nodes_of(self, processes: Sequence[int]) -> list[int]:
    """Every node the processes hold, sorted."""
    wanted = set(processes)
    return sorted(n for n, (p, _) in self.slots.items() if p in wanted)


class ProcessTransport(Transport):
  """Nodes are workers placed on processes by `layout`; this process holds its own nodes'
  slots, each on one of its local devices or on a sub-mesh of them (`mesh.tp > 1`).

  Arrays cross processes in the layout the receiver keeps them in: a whole array (replicated
  over a sub-mesh) as one replica, pulled onto one device of the receiver's sub-mesh and
  copied to its others there; a split one (tensor-parallel state) piece by piece onto the
  receiver's sub-mesh split the same way (`runtime.wire`).

  Args:
    cluster: the joined job.
    layout: where every node runs (the same in every process).
    pause: the test hook (see `PauseHook`).
  """

  remote_collectives = True

  def __init__(self, cluster: Cluster, layout: ProcessLayout, pause: PauseHook | None = None):
    me = cluster.process_id
    super().__init__({n: layout.placement(n) for n, (p, _) in layout.slots.items() if p == me})
    # Every node's `Where`, built once: a remote node's is compared and hashed in every
    # reduction (`Interpreter` groups members by it).
    self._where = {n: self.devices[n] if n in self.devices else target(layout.placement(n))
                   for n in layout.slots}
    self.cluster = cluster
    self.layout = layout
    self.pause = pause
    self.step = self.attempt = 0
    self.participants: list[int] = []
    """The processes holding the attempt's nodes."""
    self.doomed: list[str] = []
    self._bytes0 = (0, 0)  # the cluster's byte counts at the attempt's start
    self.inbox = Inbox(cluster)
    """The attempt's pulls of activations and gradients (`expect`)."""

  def device(self, node: int) -> Where:
    return self._where[node]

  def process_of(self, node: int) -> int:
    return self.layout.process_of(node)

  def begin(self, step: int, attempt: int, nodes: Sequence[int] = ()) -> None:
    super().begin(step, attempt)
    self.step, self.attempt = step, attempt
    self._bytes0 = (self.cluster.bytes_offered, self.cluster.bytes_pulled)
    self.participants = self.layout.processes_of(nodes)
    self.doomed = []
    self.inbox.clear()
    if self.pause is not None:
      self.pause(step, "start")

  def _tid(self, key: Key) -> int:
    mb, stage, kind, row = key
    uid = transfer_id(self.step, self.attempt, mb, stage, kind)
    if not row:
      return uid
    # The rows of a piece of a micro-batch (`StepProgram.links`): apart from whole transfers
    # (below 2**60), reductions' (2**60 on) and `Cluster.connect`'s (2**61 on).
    if not 0 < row < PIECE_ROWS:
      raise ValueError(f"a transfer of rows {row}.. of micro-batch {mb}: pieces start below "
                       f"row {PIECE_ROWS} across processes")
    return (1 << 62) + uid * PIECE_ROWS + row

  def send(self, key: Key, value: jax.Array, consumer: int) -> None:
    if self.is_local(consumer):
      super().send(key, value, consumer)
    else:
      self.cluster.offer(self._tid(key), [value])

  def expect(self, key: Key, producer: int, spec: jax.ShapeDtypeStruct, device: Where) -> None:
    """Starts the pull of `key` now (`runtime.inbox` says why computations wait for it)."""
    process = self.process_of(producer)
    self.inbox.put(key, process, self.cluster.pull(process, self._tid(key), [spec], device))

  def arrived(self, key: Key) -> bool:
    return self.inbox.arrived(key)

  def wait_arrival(self, keys: Sequence[Key], what: str) -> None:
    self.inbox.wait_any(keys, what)

  def recv(self, key: Key, producer: int, spec: jax.ShapeDtypeStruct, device: Where):
    if self.is_local(producer):
      return super().recv(key, producer, spec, device)
    if key not in self.inbox:
      self.expect(key, producer, spec, device)
    process, got = self.inbox.take(key)
    if got is None:
      self.doomed.append(f"process {process} unreachable")
      return jnp.zeros(spec.shape, spec.dtype, device=device)
    return got[0]

  def _failed(self, what: str, err: BaseException) -> None:
    self.doomed.append(f"{what}: {str(err).splitlines()[0][:120]}")

  def reduce(
    self, index: int, nodes: Sequence[int], devices: Devices, local: PerDevice
  ) -> PerDevice:
    """`Transport.reduce` across processes: this process's members summed here in the members'
    order, then a ring over the member processes (`_ring`); if a member is lost, keeps the local
    values and marks the attempt doomed."""
    what = f"all-reduce {index}"
    # Lists, not the dicts: a pytree's dict keys are sorted, and sub-meshes' shardings have no
    # order.
    err = self.cluster.wait(list(local.values()), f"this process's gradients for {what}",
                            self.participants)
    if err is not None:  # computed from a lost peer's data: the attempt cannot commit
      self._failed("gradients", err)
      # Fresh zeros, not `zeros_like(v)`: that dispatch would queue behind v's pending inputs
      # (its sharding is known without waiting).
      local = {d: jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype, device=v.sharding), g)
               for d, g in local.items()}
    procs = list(dict.fromkeys(_process_of(d) for d in devices))
    if len(procs) == 1:  # every member is here
      return super().reduce(index, nodes, devices, local)
    # This process's members sum their pieces among themselves (`scatter_sum`), each owner runs
    # the ring of its pieces with their owners in the other processes, and the members gather
    # the totals (`all_gather`).
    mine = [d for d in devices if d in local]
    cut, join = self._ring_programs(local, devices)
    sums = self.scatter_sum(mine, {d: cut(local[d]) for d in mine})
    totals = self._ring(index, procs, sums, _owners(mine, len(sums)))
    if totals is None:
      return local
    out = self.all_gather(mine, totals, join)
    err = self.cluster.wait(list(out.values()), what, procs)
    if err is not None:
      self._failed(what, err)
      return local
    return out

  def pieces_for(self, mine: Sequence[Where], devices: Devices) -> int:
    """`Transport.pieces_for` across processes: spread, `ring.pieces_for` of the members each
    process holds (the most any holds, or a multiple of it that keeps a process that lost a
    member balanced; every process derives the same count from `devices`, so piece j is the
    same elements in each, and its owners run its ring together); else one."""
    if not self._spreads(mine[0]):
      return 1
    per_process: dict[int, int] = {}
    for d in devices:
      per_process[_process_of(d)] = per_process.get(_process_of(d), 0) + 1
    return ring.pieces_for(list(per_process.values()))

  def is_local_where(self, where: Where) -> bool:
    return _process_of(where) == self.cluster.process_id

  def _ring(self, index: int, procs: list[int], partials: list[tuple[jax.Array, ...]],
            owners: list[Where]) -> list[tuple[jax.Array, ...]] | None:
    """The sum over `procs` of each one's `partials` (piece j of this process's sum, as its P
    chunks on its owner `owners[j]`, cut from the gradients' buffers by `_ring_programs`), by a
    ring per piece: a reduce-scatter, then an all-gather, every piece's ring run by its owners
    in step (without spreading, one piece on the first member); returns each piece's summed
    chunks. A piece is P equal chunks (P = len(procs); the hops are `schedule.ring`'s,
    which the simulator's cost model prices): each process sends and receives 2 (P - 1) / P
    buffers' bytes whatever P is (a gather of every member's buffer was P - 1), through each
    owner's device its share. The chunks follow the members, not the job's process count: with a
    fixed count a ring that lost one of P members had a position owning two chunks, which set
    the pace of every hop (about twice the time); a new member count compiles its cut and join
    (two small programs a gradient layout, as a new local member count compiles its sum). Each
    chunk is summed once, in a fixed order (chunk j from position j on around the ring, each
    adding its own part, to its owner j - 1), and then only copied, so every replica holds
    bitwise the same sum. Every pull is waited for before anything adds it (no device's queue
    waits on another process), watching every member: a member that dies or freezes ends the
    wait of all of them (`Cluster.wait`), so it costs its own worker only; None then.
    """
    me, n = self.cluster.process_id, len(procs)
    r = procs.index(me)
    prev = procs[(r - 1) % n]
    own = [list(p) for p in partials]  # each piece already in its n chunks (`_ring_programs`)
    chunks = [list(o) for o in own]
    spec = jax.ShapeDtypeStruct(own[0][0].shape, own[0][0].dtype)
    watch = [q for q in procs if q != me]
    for hop, (send, recv, gather) in enumerate(ring.hops(r, n)):  # gather: sums go round
      for j, piece in enumerate(chunks):
        self.cluster.offer(self._ring_id(index, hop, j), [piece[send]])
      if hop == 0 and self.pause is not None:
        self.pause(self.step, "AR")
      got = [self.cluster.pull(prev, self._ring_id(index, hop, j), [spec], owners[j])
             for j in range(len(chunks))]
      if any(g is None for g in got):
        self.doomed.append(f"all-reduce {index}: process {prev} unreachable")
        return None
      err = self.cluster.wait(got, f"all-reduce {index} from process {prev}", watch)
      if err is not None:
        self._failed(f"all-reduce {index}", err)
        return None
      for j, (x,) in enumerate(got):
        chunks[j][recv] = x if gather else _add(x, own[j][recv])
    return [tuple(piece) for piece in chunks]

  def _ring_programs(self, local: PerDevice, devices: Devices) -> tuple[Callable, Callable]:
    """`(cut, join)` of a group across processes: `cut` reads the gradients (their buffers)
    and writes each of the k pieces of `pieces_for` as the n chunks of its ring (n: the member
    processes) in one program, `join` writes the k x n reduced chunks back into the gradients'
    layout in one program: no flat copy of the whole gradient between them, and no program per
    piece."""
    k = self.pieces_for(list(local), devices)
    n = len({_process_of(d) for d in devices})
    cut, join = _reduce_programs(local, k * n)
    return ((lambda g: _in_pieces(cut(g), n)),
            (lambda *parts: join(*[c for part in parts for c in part])))

  def prepare_reduce(self, local: PerDevice, devices: Devices) -> list[jax.Array]:
    """`Transport.prepare_reduce`, and for a group across processes the ring's own programs
    (cut, add, join)."""
    procs = len({_process_of(d) for d in devices})
    if procs == 1:
      return super().prepare_reduce(local, devices)
    members = sum(self.is_local_where(d) for d in devices)
    cut, join = self._ring_programs(local, devices)
    outs = []
    for g in local.values():
      parts = cut(g)
      outs += jax.tree.leaves(_sum(members)(*[parts[0]] * members))
      outs += [_add(parts[0][0], parts[0][0]), *jax.tree.leaves(join(*parts))]
    return outs

  def _ring_id(self, index: int, hop: int, piece: int = 0) -> int:
    """The transfer id of hop `hop` of piece `piece`'s ring of reduction `index` in this
    attempt (unique on the sending process's server): apart from activations' ids (below
    2**60) and `Cluster.connect`'s (2**61 on).

    Raises:
      ValueError: a field outside its range (2**22 steps, 64 pieces, 4096 hops: 2048 member
        processes).
    """
    if not (0 <= self.step < 1 << 22 and 0 <= hop < 1 << 12 and 0 <= piece < 64):
      raise ValueError(f"reduction transfer id out of range: step {self.step}, hop {hop}, "
                       f"piece {piece}")
    key = (((self.step * 64 + self.attempt % 64) * 1024 + index % 1024) * 64 + piece) * 4096 \
      + hop
    return (1 << 60) + key

  def conclude(
    self, losses: Mapping[int, jax.Array], new_params: Sequence[Any], grad_sumsq: Sequence[Any]
  ) -> Outcome:
    cl = self.cluster
    err = cl.wait((list(new_params), dict(losses), list(grad_sumsq)), "the step's results",
                  self.participants)
    if err is not None:
      self._failed("results", err)
    doomed = self.doomed
    status = {
      "ok": not doomed,
      "why": doomed[:3],
      "losses": {} if doomed else {str(k): float(v) for k, v in losses.items()},
      # A string, so that a non-finite norm survives the key-value store's JSON.
      "sumsq": "0.0" if doomed else repr(float(sum(jax.device_get(list(grad_sumsq))))),
      "stop": self.stop_requested,
      "bytes": [cl.bytes_offered - self._bytes0[0], cl.bytes_pulled - self._bytes0[1]],
      "device_bytes": list(self.device_bytes()),
    }
    base = _attempt_key(self.step, self.attempt)
    if cl.process_id in self.participants:  # a process the plan left idle only follows
      cl.kv_set(f"{base}/end/{cl.process_id}", status)
    what = f"step {self.step}, attempt {self.attempt}"
    decision, statuses = self._agree_outcome(base, self.participants, what)
    detected = time.time()
    if "lost" in decision:
      cl.declared_dead(decision["lost"], what)
      # A lost process takes every node it held with it (the coordinator ignores the ones
      # already failed).
      lost = set(self.layout.nodes_of(decision["lost"]))
      return Outcome(False, {}, lost, detected, remote=True)
    # A micro-batch whose last stage ran in pieces on several processes has a share of its
    # loss from each: summed in process order, the same sum on every process.
    mb_losses: dict[int, float] = {}
    for _, st in sorted(statuses.items()):
      for k, v in st["losses"].items():
        mb_losses[int(k)] = mb_losses.get(int(k), 0.0) + v
    total = sum(float(st["sumsq"]) for st in statuses.values())
    stop = any(st.get("stop") for st in statuses.values())
    sent, received = zip(*(st.get("bytes", (0, 0)) for st in statuses.values()), strict=True)
    dev_sent, dev_received = zip(*(st.get("device_bytes", (0, 0)) for st in statuses.values()),
                                 strict=True)
    return Outcome(True, mb_losses, detected_at=detected, remote=True, grad_sumsq=total,
                   stop=stop, net_bytes=(max(sent), max(received)),
                   device_bytes=(max(dev_sent), max(dev_received)))

  def wait(self, tree: Any, what: str) -> None:
    self.cluster.wait(tree, what, self.participants)

  def exchange(
    self, transfers: Sequence[Transfer], lookup: Lookup, specs: Specs, channel: int, tag: Tag,
    lost_ok: bool = False,
  ) -> dict[int, dict[str, jax.Array]]:
    step, attempt = tag
    cl = self.cluster
    uids = [transfer_id(step, attempt, i, 1023 - channel, STATE) for i in range(len(transfers))]
    for uid, (src, dst, keys) in zip(uids, transfers, strict=True):
      if self.is_local(src) and not self.is_local(dst):
        cl.offer(uid, [lookup(src, k) for k in keys], [specs[k] for k in keys])
    received: dict[int, dict[str, jax.Array]] = {}
    for uid, (src, dst, keys) in zip(uids, transfers, strict=True):
      if not self.is_local(dst) or self.is_local(src):
        continue
      process = self.process_of(src)
      got = cl.pull(process, uid, [specs[k] for k in keys], self.device(dst))
      what = f"state from process {process}"
      if got is None or cl.wait(got, what, [process]) is not None:
        if lost_ok:
          continue
        raise RuntimeError(f"process {cl.process_id}: {what} was lost during the hand-over")
      received.setdefault(dst, {}).update(zip(keys, got, strict=True))
    return received

  # ---------------------------------------------------------------- agreement

  def _agree_outcome(
    self, base: str, participants: list[int], what: str
  ) -> tuple[dict, dict[int, dict]]:
    """The agreed outcome of an attempt whose statuses are under `base`/end, and the statuses
    (all of them if it committed).

    Follows `end/outcome`, proposing `{"commit": true}` once every participant reported
    success, or `{"lost": [...]}` once a participant is proven dead: one that has not
    reported, or any if every status is in and some failed (a failure comes from a dead
    peer's data). A participant that reported success and then died may still be committed
    (its part was complete); the next attempt finds its death.

    Raises:
      RuntimeError: some status failed while every participant stayed alive for longer than
        the heartbeat timeout (a bug, not a failure).
    """
    cl = self.cluster
    directory = f"{base}/end"
    key = f"{directory}/outcome"
    others = [p for p in participants if p != cl.process_id]
    statuses: dict[int, dict] = {}
    failed_since: list[float] = []

    def check() -> dict | None:
      decided, got = _split(cl.kv_dir(directory), "outcome")
      statuses.clear()
      statuses.update({p: st for p, st in got.items() if p in participants})
      if decided is not None:
        return decided
      missing = [p for p in participants if p not in statuses]
      if not missing and all(st["ok"] for st in statuses.values()):
        return cl.decide(key, {"commit": True})
      dead = cl.dead(missing or others)
      if dead:
        return cl.decide(key, {"lost": sorted(dead)})
      if not missing:
        failed_since[:] = failed_since or [time.monotonic()]
        if time.monotonic() - failed_since[0] > cl.cfg.heartbeat_timeout_s + 2:
          bad = {p: st["why"] for p, st in statuses.items() if not st["ok"]}
          raise RuntimeError(f"{what} failed with every process alive: {bad}")
      return None

    decided = cl.poll(f"the outcome of {what}", check, wake_key=key)
    if "commit" in decided and set(statuses) != set(participants):
      statuses.clear()
      got = _split(cl.kv_dir(directory), "outcome")[1]
      statuses.update({p: st for p, st in got.items() if p in participants})
      if set(statuses) != set(participants):
        raise RuntimeError(f"{what} committed without every participant's status")
    return decided, statuses

  # ---------------------------------------------------------------- checkpoints

  def share_state(
    self, step: int, holders: Mapping[int, int], export: Callable[[], tuple[dict, dict]]
  ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Hands one replica of every stage's state to process 0, which returns it all.

    Args:
      step: the committed step (names the transfers).
      holders: for each stage key (any int the processes agree on), the node that hands its
        state over.
      export: this process's own state in the universal layout (every stage it holds).

    Returns:
      On process 0 the whole state, or None if a holder died before handing its state over;
      None on every other process.
    """
    from resilient_jax.checkpoint import universal

    cl = self.cluster
    me = cl.process_id
    # A process holding several holders hands its whole state over once, under its first key.
    keys: dict[int, int] = {}
    for key, node in sorted(holders.items()):
      keys.setdefault(self.process_of(node), key)
    own_params, own_opt = export()
    if me != 0:
      if me in keys:
        entries = {"p/" + k: v for k, v in own_params.items()}
        entries.update({"o/" + k: v for k, v in own_opt.items()})
        names = sorted(entries)
        cl.kv_set(f"state/{step}/{keys[me]}",
                  [[n, list(entries[n].shape), str(entries[n].dtype)] for n in names])
        cl.offer(transfer_id(step, 63, 0, keys[me], STATE), [entries[n] for n in names])
      return None
    params: dict[str, Any] = dict(own_params)
    opt: list[dict[str, Any]] = [own_opt]
    for process, key in sorted(keys.items()):
      if process == me:
        continue
      what = f"state {key} from process {process}"
      spec = cl.await_key(f"state/{step}/{key}", process, what)
      if spec is None:  # the holder died first
        return None
      specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt)) for _, shape, dt in spec]
      got = cl.pull(process, transfer_id(step, 63, 0, key, STATE), specs)
      if got is None or cl.wait(got, what, [process]) is not None:
        return None
      values = dict(zip([n for n, _, _ in spec], got, strict=True))
      params.update({n[2:]: v for n, v in values.items() if n.startswith("p/") and
                     n[2:] not in params})
      opt.append({n[2:]: v for n, v in values.items() if n.startswith("o/")})
    return params, universal.merge(opt)

  def holds_any(self, nodes: Sequence[int]) -> bool:
    """Whether this process holds one of `nodes`."""
    return any(self.is_local(n) for n in nodes)


def _split(entries: Mapping[str, Any], decision: str) -> tuple[Any | None, dict[int, Any]]:
  """A directory of per-process entries and one decision -> (decision or None, {pid: entry})."""
  return entries.get(decision), {int(k): v for k, v in entries.items() if k != decision}


def _attempt_key(step: int, attempt: int) -> str:
  """Where an attempt's statuses and decisions live in the key-value store."""
  return f"step/{step}/{attempt}"


def _in_pieces(chunks: Sequence[jax.Array], n: int) -> list[tuple[jax.Array, ...]]:
  """k x n chunks as k pieces of n chunks each (piece c: chunks c n .. c n + n - 1)."""
  return [tuple(chunks[c:c + n]) for c in range(0, len(chunks), n)]


def _process_of(where: Where) -> int:
  """The process driving a worker's device or sub-mesh."""
  devices = where.device_set if isinstance(where, jax.sharding.NamedSharding) else {where}
  return next(iter(devices)).process_index


def _devices_of(process: int) -> list[jax.Device]:
  """The devices `process` drives, in the order `ProcessLayout`'s local indices count them."""
  return sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)
