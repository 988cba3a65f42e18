"""How data crosses slot boundaries: the interpreter's one interface to devices and processes.

`Transport` serves a single process that holds every node of the plan: arrays move with
`jax.device_put` and every step commits. A node is one device, or with tensor parallelism a
sub-mesh of devices (`placement`); `device` is where its whole arrays go (the device, or
replicated over the sub-mesh: `model.sharding.Where`), so the interpreter and the reduction
below move activations and gradient buffers the same way for both.
`runtime.multiprocess.ProcessTransport` extends it to a `jax.distributed` job, where some nodes
live in other processes.

A reduction (the data-parallel gradient sum): each member lays its stage's gradients out as one
float32 buffer cut into k equal pieces, k its process's members (one program); piece c is summed
on member c mod k, from every member's copy in the members' order (one program), and every
member then copies the pieces it does not own and joins them (one program): a reduce-scatter and
an all-gather among the devices of a process, each sending and receiving (k - 1) / k buffers per
phase, so no device carries more than its share however many the process holds. That is for
devices with links of their own (GPUs, TPUs: `Transport.spread`); CPU devices share one memory,
where spreading copies the same bytes in all with k times the dispatches, so there k is 1 and
the first member sums (in one piece the gradients are summed as they are laid out, in float32
and cast back, with no buffer made: no cut or join program). Each piece is summed once and only
copied after, so every replica holds bitwise the same sum. Across processes
(`runtime.multiprocess.ProcessTransport`) k is the most members any process holds (a multiple of
it where a process holds fewer, so that its devices stay near their share:
`schedule.ring.pieces_for`), and between the two phases each piece's owners run a ring
(reduce-scatter, all-gather) among the member processes over the transfer server, every owner
from its own device: 2 (P - 1) / P buffers in and out per process, flat in the number of
processes P, as the simulator's cost model prices it. Growth per reduction: bytes per process
O(1) in dp, and per device O(1) in the devices of a process; 2 (P - 1) sequential transfers
(latency O(P)); host work O(k^2 + k P) dispatches (the copies of the two local phases each a
single `device_put` call). `device_bytes` counts every device's bytes (`metrics.jsonl`:
`device_bytes_out`, `device_bytes_in`).
It is not an XLA collective over the group, for three reasons: a new group after a failure
compiles only the few small programs above for its new k, and across processes the ring's cut
and join for its new process count (never a stage program); a member
frozen inside a collective could not be abandoned (it holds its device's queue), while a pull
from a member declared dead is cut off like any other transfer; and one buffer per member keeps
the host's work per reduction to dispatches per piece instead of one global array per
parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.model.sharding import Where, as_mesh, target
from resilient_jax.programs.compiled import OnEachDevice
from resilient_jax.programs.packing import Layout, Packed
from resilient_jax.schedule import ring

Params = dict[str, jax.Array]
ACT, GRAD, STATE = 0, 1, 2
Key = tuple[int, int, int, int]
"""(micro-batch, producing stage, ACT or GRAD, first row): unique within one step attempt. The
row is 0 but for the rows of a micro-batch split into pieces (`StepProgram.links`)."""
Transfer = tuple[int, int, Sequence[str]]
"""State keys to move from a source node to a destination node (`Transport.exchange`)."""
Lookup = Callable[[int, str], jax.Array]
"""A source node's array of a state key."""
Specs = Mapping[str, jax.ShapeDtypeStruct]
Devices = tuple[Where, ...]
PerDevice = dict[Where, Params]
"""One dict of arrays per device (a reduction's inputs and outputs)."""
Tag = tuple[int, int]
"""The step and attempt a state exchange belongs to."""


@dataclasses.dataclass
class Outcome:
  """How a step attempt ended, the same in every surviving process."""

  committed: bool
  losses: dict[int, float]
  """Every micro-batch's loss (all of them, from every process) when committed."""
  lost: set[int] = dataclasses.field(default_factory=set)
  detected_at: float = 0.0
  remote: bool = False
  """Whether other processes contributed losses (`processed` then comes from them)."""
  grad_sumsq: float = 0.0
  """The squared global norm of the step's gradients, summed over every process's share."""
  stop: bool = False
  """Some participant asked to stop after this step (`Transport.stop_requested`, e.g. on
  SIGTERM): every process that commits the step sees the same value."""
  net_bytes: tuple[int, int] = (0, 0)
  """The most bytes one process sent, and received, over the network in the attempt (the
  largest of every process's count: what the busiest link carried)."""
  device_bytes: tuple[int, int] = (0, 0)
  """The most bytes one device sent, and received, to and from the other devices of its
  process in the attempt's reductions (`Transport.device_bytes`; the largest in any process)."""


class Transport:
  """How data crosses slot boundaries; this base class serves a single process, in which every
  node is a local device (`runtime.multiprocess.ProcessTransport` extends it across processes).

  Args:
    devices: the device of every node, or its sub-mesh (`model.sharding.worker_mesh`).
  """

  remote_collectives = False
  """Whether a reduction may wait on other processes (then groups run in one global order)."""
  spread: bool | None = None
  """Whether a reduction spreads its sums over this process's members (a piece each) or sums
  on the first (one piece); None: spread unless the devices are CPUs. Either way the same
  bytes are copied in all; spreading keeps every device's share at 2 (k - 1) / k buffers,
  which matters where each device has its own link (GPUs, TPUs), and costs k times the
  dispatches, which is all it would change for CPU devices (one memory)."""
  stop_requested = False
  """Set (by a signal handler) to stop the job after the step in flight; an attempt that
  commits carries it to every process in `Outcome.stop`."""

  def __init__(self, devices: Mapping[int, jax.Device | jax.sharding.Mesh]):
    self.placements = dict(devices)
    self.devices: dict[int, Where] = {n: target(p) for n, p in self.placements.items()}
    self._box: dict[Key, jax.Array] = {}
    self._moved: dict[Where, list[int]] = {}  # per device, bytes sent and received (`move`)

  def is_local(self, node: int) -> bool:
    """Whether `node`'s device belongs to this process."""
    return node in self.devices

  def placement(self, node: int) -> jax.sharding.Mesh:
    """The devices of `node`'s worker: a sub-mesh (a 1-device mesh without tensor parallelism)."""
    return as_mesh(self.placements[node])

  def device(self, node: int) -> Where:
    """Where `node`'s whole arrays go: its device, or replicated over its sub-mesh."""
    return self.devices[node]

  def begin(self, step: int, attempt: int, nodes: Sequence[int] = ()) -> None:
    """Starts an attempt at `step` on `nodes`: transfers and agreements are named after it."""
    del step, attempt, nodes
    self._box.clear()
    self._moved.clear()

  def send(self, key: Key, value: jax.Array, consumer: int) -> None:
    """Offers an activation or gradient to the node that consumes it."""
    del consumer
    self._box[key] = value

  def recv(self, key: Key, producer: int, spec: jax.ShapeDtypeStruct, device: Where):
    """The array `producer` sent under `key`, on `device` (possibly filled asynchronously)."""
    del producer, spec
    return jax.device_put(self._box.pop(key), device)

  def expect(self, key: Key, producer: int, spec: jax.ShapeDtypeStruct, device: Where) -> None:
    """Announces, at the start of an attempt, a `recv` of `key` from `producer`, a node of
    another process (none here: every node is local)."""
    del key, producer, spec, device

  def arrived(self, key: Key) -> bool:
    """Whether `recv(key, ...)` can be computed on without waiting for another process (an
    expected array that has landed; always, for one from a local node)."""
    del key
    return True

  def wait_arrival(self, keys: Sequence[Key], what: str) -> None:
    """Blocks (bounded) until one of the expected `keys` `arrived`."""
    del keys, what

  def reduce(
    self, index: int, nodes: Sequence[int], devices: Devices, local: PerDevice
  ) -> PerDevice:
    """Sums `local` (one dict per device this process holds) over `devices` (every member, in
    one order on every member); `index` names the group. Returns one sum per local device, or
    `local` itself when a member's gradients cannot be had (the attempt is then doomed)."""
    del index, nodes
    mine = [d for d in devices if d in local]
    cut, join = self.programs_for(local, devices)
    return self.all_gather(mine, self.scatter_sum(mine, {d: cut(local[d]) for d in mine}), join)

  def pieces_for(self, mine: Sequence[Where], devices: Devices) -> int:
    """How many pieces a reduction over `devices` (every member), `mine` of them here, cuts
    its buffer into: one a member when it spreads (`spread`, `ring.pieces_for` of one process
    holding every member), else one."""
    return ring.pieces_for((len(devices),)) if self._spreads(mine[0]) else 1

  def _spreads(self, where: Where) -> bool:
    if self.spread is not None:
      return self.spread
    device = where if isinstance(where, jax.Device) else next(iter(where.device_set))
    return device.platform != "cpu"

  def scatter_sum(self, mine: list[Where], pieces: dict[Where, tuple[jax.Array, ...]]
                  ) -> list[jax.Array]:
    """The reduce-scatter among this process's members `mine`: each cut its buffer into the
    same k `pieces` (`pieces_for`); piece c is summed on its owner `mine[c % len(mine)]`, from
    every member's copy in `mine`'s order (one program), and only copied after that, so every
    member ends with bitwise the same sum. Returns piece c's sum (on its owner) for each c."""
    k = len(pieces[mine[0]])
    owners = _owners(mine, k)
    moved = iter(self.move([(pieces[d][c], d, owners[c]) for c in range(k) for d in mine
                            if d != owners[c]]))
    add = _sum(len(mine))
    return [add(*(pieces[d][c] if d == owners[c] else next(moved) for d in mine))
            for c in range(k)]

  def all_gather(self, mine: list[Where], sums: list[jax.Array], join: Callable) -> PerDevice:
    """The all-gather after `scatter_sum`: every member copies each piece from its owner and
    joins them (`join`: pieces -> the gradients' own layout)."""
    owners = _owners(mine, len(sums))
    moved = iter(self.move([(x, o, d) for d in mine for x, o in zip(sums, owners, strict=True)
                            if o != d]))
    return {d: join(*(x if o == d else next(moved) for x, o in zip(sums, owners, strict=True)))
            for d in mine}

  def move(self, moves: Sequence[tuple[jax.Array, Where, Where]]) -> list[jax.Array]:
    """Copies each (array, from, to) to its device, in one call, counting every device's bytes
    sent and received (`device_bytes`)."""
    for x, src, dst in moves:
      nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(x))
      self._moved.setdefault(src, [0, 0])[0] += nbytes
      self._moved.setdefault(dst, [0, 0])[1] += nbytes
    return jax.device_put([x for x, _, _ in moves], [dst for _, _, dst in moves]) \
      if moves else []

  def device_bytes(self) -> tuple[int, int]:
    """The most bytes one of this process's devices sent, and received, to and from its other
    devices in the attempt's reductions."""
    return (max((v[0] for v in self._moved.values()), default=0),
            max((v[1] for v in self._moved.values()), default=0))

  def prepare_reduce(self, local: PerDevice, devices: Devices) -> list[jax.Array]:
    """Builds the programs `reduce` over `devices` (every member) runs on gradients laid out as
    `local` (one of this process's members: cut, sum, join) by running them once on it;
    returns their outputs to wait on. A process relaunched into a running job builds them
    before its first step, which would otherwise."""
    members = sum(self.is_local_where(d) for d in devices)
    cut, join = self.programs_for(local, devices)
    outs = []
    for g in local.values():
      pieces = cut(g)
      outs.append(_sum(members)(*[pieces[0]] * members))
      outs.extend(jax.tree.leaves(join(*pieces)))
    return outs

  def programs_for(self, local: PerDevice, devices: Devices) -> tuple[Callable, Callable]:
    """The `(cut, join)` `reduce` over `devices` runs on gradients laid out as `local`: in one
    piece the gradients are summed as they are laid out (no program: `_sum` adds in float32 and
    casts back, as the float32 buffer would be), else `_reduce_programs`."""
    k = self.pieces_for(list(local), devices)
    if k == 1:
      return (lambda g: (g,)), (lambda total: total)
    return _reduce_programs(local, k)

  def is_local_where(self, where: Where) -> bool:
    """Whether `where` (a member of a reduction) is one of this process's devices."""
    del where
    return True

  def conclude(
    self, losses: Mapping[int, jax.Array], new_params: Sequence[Any], grad_sumsq: Sequence[Any]
  ) -> Outcome:
    """Ends the attempt: commit (with every micro-batch's loss and the squared global norm of
    the gradients, from this process's shares `grad_sumsq`) or the nodes lost."""
    values, shares = jax.device_get((dict(losses), list(grad_sumsq)))
    jax.block_until_ready(list(new_params))
    return Outcome(True, {mb: float(v) for mb, v in values.items()}, detected_at=time.time(),
                   grad_sumsq=float(sum(shares)), stop=self.stop_requested,
                   device_bytes=self.device_bytes())

  def wait(self, tree: Any, what: str) -> None:
    """Blocks (bounded, across processes) until `tree` is computed."""
    del what
    jax.block_until_ready(tree)

  def exchange(
    self, transfers: Sequence[Transfer], lookup: Lookup, specs: Specs, channel: int, tag: Tag,
    lost_ok: bool = False,
  ) -> dict[int, dict[str, jax.Array]]:
    """Moves state between processes: each (source node, destination node, keys) is offered by
    the source's process (`lookup` gives its arrays) and pulled by the destination's. Every
    process passes the same list; returns {local destination node: {key: array}}.

    With `lost_ok`, a transfer whose source process died before it was served is left out of
    the result (the caller can do without it); otherwise that raises `RuntimeError`."""
    del lookup, specs, channel, tag, lost_ok
    if any(not (self.is_local(a) and self.is_local(b)) for a, b, _ in transfers):
      raise ValueError("a single-process run has no other process to exchange state with")
    return {}  # every node is local: `Interpreter.place` copies between devices itself


def _in_ar_scope(fn: Callable) -> Callable:
  """`fn` traced under `jax.named_scope("AR")`: its compiled ops are the reduction's in a
  `jax.profiler` trace."""

  @functools.wraps(fn)
  def scoped(*args):
    with jax.named_scope("AR"):
      return fn(*args)

  return scoped


def _reduce_programs(local: PerDevice, k: int) -> tuple[Callable, Callable]:
  """`pieces` of gradients laid out as `local` (a dict by name, or packed: `programs.packing`):
  `cut` lays them out as one float32 buffer in `k` equal pieces (zero-padded), `join` takes
  the pieces back to the gradients' own layout."""
  some = next(iter(local.values()))
  if isinstance(some, Packed):
    form: Form = some.layout
  else:
    names = tuple(sorted(some))
    form = (names, tuple((some[n].shape, some[n].dtype) for n in names))
  return pieces(form, k)


Form = Layout | tuple | int
"""What `pieces` cuts: packed gradients' `Layout`, (names, their (shape, dtype)s) of a dict of
gradients, or the length of a flat float32 buffer."""


@functools.cache
def pieces(form: Form, k: int) -> tuple[Callable, Callable]:
  """`(cut, join)`: one program that lays `form` out as one float32 buffer (zero-padded to a
  multiple of `k`) cut into `k` equal pieces, and one that joins the pieces back into `form`.
  Packed gradients in one float32 buffer, in one piece, need neither (no program)."""
  flatten, unflatten, length = _flat(form)
  if k == 1 and isinstance(form, Layout) and form.groups == (np.dtype(np.float32),):
    return (lambda g: (g.buffers[0],)), (lambda flat: Packed(form, (flat,)))
  size = -(-length // k)

  def cut(g: Any) -> tuple[jax.Array, ...]:
    flat = jnp.pad(flatten(g), (0, size * k - length))
    return tuple(flat[i * size:(i + 1) * size] for i in range(k))

  def join(*parts: jax.Array) -> Any:
    return unflatten(jnp.concatenate(parts)[:length])

  return OnEachDevice(_in_ar_scope(cut)), OnEachDevice(_in_ar_scope(join))


def _flat(form: Form) -> tuple[Callable, Callable, int]:
  """(flatten, unflatten, length) of `form` as one float32 buffer, traced inside `pieces`'s
  programs."""
  if isinstance(form, int):
    return (lambda flat: flat), (lambda flat: flat), form
  if isinstance(form, Layout):
    bounds = np.cumsum((0, *form.sizes))
    return ((lambda g: jnp.concatenate([b.astype(jnp.float32) for b in g.buffers])),
            (lambda flat: Packed(form, tuple(flat[a:b].astype(d) for a, b, d in zip(
              bounds[:-1], bounds[1:], form.groups, strict=True)))), int(bounds[-1]))
  names, shapes = form
  bounds = np.cumsum((0, *(math.prod(shape) for shape, _ in shapes)))

  def unflatten(flat: jax.Array) -> dict[str, jax.Array]:
    return {n: flat[a:b].reshape(shape).astype(dtype) for n, a, b, (shape, dtype) in zip(
      names, bounds[:-1], bounds[1:], shapes, strict=True)}

  return (lambda g: jnp.concatenate([g[n].astype(jnp.float32).ravel() for n in names])), \
    unflatten, int(bounds[-1])


def _owners(mine: list[Where], k: int) -> list[Where]:
  """The member that sums piece c, for each of `k` pieces: `mine[c % len(mine)]`."""
  return [mine[c % len(mine)] for c in range(k)]


@functools.cache
def _sum(n: int) -> Callable[..., Any]:
  """One program that adds its `n` arguments (arrays, or trees of arrays laid out alike) in
  order, in float32, each leaf cast back to its dtype (the argument itself for one)."""
  if n == 1:
    return lambda x: x

  def add(*xs: Any) -> Any:  # named so: `jit(add)/AR/add` in a profile
    return jax.tree.map(lambda *leaves: functools.reduce(
      jnp.add, [x.astype(jnp.float32) for x in leaves]).astype(leaves[0].dtype), *xs)

  return OnEachDevice(_in_ar_scope(add))


_add = _sum(2)
