"""How data crosses slot boundaries: the interpreter's one interface to devices and processes.

`Transport` serves a single process that holds every node of the plan: arrays move with
`jax.device_put` and every step commits. A node is one device, or with tensor parallelism a
sub-mesh of devices (`placement`); `device` is where its whole arrays go (the device, or
replicated over the sub-mesh: `model.sharding.Where`), so the interpreter and the reduction
below move activations and gradient buffers the same way for both.
`runtime.multiprocess.ProcessTransport` extends it to a `jax.distributed` job, where some nodes
live in other processes.

A reduction (the data-parallel gradient sum): each member lays its stage's gradients out as one
flat float32 buffer; within a process one device receives the other local members' buffers (a
device copy) and adds them in the members' order, and the process's other members get copies
of that sum, so every replica holds bitwise the same sum. Across processes
(`runtime.multiprocess.ProcessTransport`) each process first sums its own members this way, then
the member processes run a ring (reduce-scatter, all-gather) over the transfer server: 2 (P - 1)
/ P buffers in and out per process, flat in the number of processes P, as the simulator's cost
model prices it. Growth per reduction: bytes per process O(1) in dp; 2 (P - 1) sequential
transfers (latency O(P)); host work O(local members + P) dispatches.
It is not an XLA collective over the group, for three reasons: a new group after a failure
compiles nothing (the programs are per stage, `compiled.OnEachDevice`, and the ring's chunking is
fixed for the job); a member frozen inside a collective could not be abandoned (it holds its
device's queue), while a pull from a member declared dead is cut off like any other transfer;
and one buffer per member keeps the host's work per reduction to a few dispatches instead of one
global array per parameter. Within one process the local sum still lands on one device (D - 1
copies in and out at D local members): fine for simulated CPU devices, and the part a real
multi-GPU host would rather give to a device collective (not built).
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

Params = dict[str, jax.Array]
ACT, GRAD, STATE = 0, 1, 2
Key = tuple[int, int, int]
"""(micro-batch, producing stage, ACT or GRAD): unique within one step attempt."""
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


class Transport:
  """How data crosses slot boundaries; this base class serves a single process, in which every
  node is a local device (`runtime.multiprocess.ProcessTransport` extends it across processes).

  Args:
    devices: the device of every node, or its sub-mesh (`model.sharding.worker_mesh`).
  """

  remote_collectives = False
  """Whether a reduction may wait on other processes (then groups run in one global order)."""
  stop_requested = False
  """Set (by a signal handler) to stop the job after the step in flight; an attempt that
  commits carries it to every process in `Outcome.stop`."""

  def __init__(self, devices: Mapping[int, jax.Device | jax.sharding.Mesh]):
    self.placements = dict(devices)
    self.devices: dict[int, Where] = {n: target(p) for n, p in self.placements.items()}
    self._box: dict[Key, jax.Array] = {}

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
    flatten, unflatten = _reduce_programs(local)
    parts = self._gather(index, nodes, devices, {d: flatten(g) for d, g in local.items()})
    if parts is None:
      return local
    # One local device sums, in the members' order (every process uses the same order, so all
    # replicas hold bitwise the same sum); this process's other devices get copies of it: 2D
    # dispatches for D local members rather than D^2.
    first, *others = local
    total = None
    for member in devices:
      part = jax.device_put(parts[member], first)
      total = part if total is None else _add(total, part)
    out = {first: unflatten(total)}
    for d in others:
      out[d] = unflatten(jax.device_put(total, d))
    return out

  def prepare_reduce(self, local: PerDevice) -> list[jax.Array]:
    """Builds the programs `reduce` runs on gradients laid out as `local` (flatten, add,
    unflatten) by running them once on it; returns their outputs to wait on. A process
    relaunched into a running job builds them before its first step, which would otherwise."""
    flatten, unflatten = _reduce_programs(local)
    outs = []
    for g in local.values():
      flat = flatten(g)
      outs.append(_add(flat, flat))
      outs.extend(jax.tree.leaves(unflatten(flat)))
    return outs

  def _gather(
    self, index: int, nodes: Sequence[int], devices: Devices, flats: dict[jax.Device, jax.Array]
  ) -> dict[jax.Device, jax.Array] | None:
    """Every member's flat gradient buffer (`flats` are this process's); None if one is lost."""
    del index, nodes, devices
    return flats

  def conclude(
    self, losses: Mapping[int, jax.Array], new_params: Sequence[Any], grad_sumsq: Sequence[Any]
  ) -> Outcome:
    """Ends the attempt: commit (with every micro-batch's loss and the squared global norm of
    the gradients, from this process's shares `grad_sumsq`) or the nodes lost."""
    values, shares = jax.device_get((dict(losses), list(grad_sumsq)))
    jax.block_until_ready(list(new_params))
    return Outcome(True, {mb: float(v) for mb, v in values.items()}, detected_at=time.time(),
                   grad_sumsq=float(sum(shares)), stop=self.stop_requested)

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


def _reduce_programs(local: PerDevice) -> tuple[Callable, Callable]:
  """`_flatten` and `_unflatten` for gradients laid out as `local`: a dict by name, or packed
  (`programs.packing`; one float32 buffer is reduced as it is, no program either way)."""
  some = next(iter(local.values()))
  if isinstance(some, Packed):
    return _packed_programs(some.layout)
  names = tuple(sorted(some))
  layout = tuple((some[n].shape, some[n].dtype) for n in names)
  return _flatten(names), _unflatten(names, layout)


@functools.cache
def _packed_programs(layout: Layout) -> tuple[Callable, Callable]:
  """`_reduce_programs` of packed gradients: their buffers as one float32 buffer and back."""
  if layout.groups == (np.dtype(np.float32),):
    return (lambda g: g.buffers[0]), (lambda flat: Packed(layout, (flat,)))

  def split(flat: jax.Array) -> Packed:
    bounds = np.cumsum((0, *layout.sizes))
    return Packed(layout, tuple(flat[a:b].astype(d) for a, b, d in
                                zip(bounds[:-1], bounds[1:], layout.groups, strict=True)))

  return (OnEachDevice(_in_ar_scope(lambda g: jnp.concatenate(
    [b.astype(jnp.float32) for b in g.buffers]))), OnEachDevice(_in_ar_scope(split)))


@functools.cache
def _flatten(names: tuple[str, ...]) -> Callable[[Mapping[str, jax.Array]], jax.Array]:
  """One program that lays a stage's gradients out as one float32 buffer."""
  return OnEachDevice(_in_ar_scope(
    lambda g: jnp.concatenate([g[n].astype(jnp.float32).ravel() for n in names])))


@functools.cache
def _unflatten(names: tuple[str, ...], layout: tuple) -> Callable:
  """The inverse of `_flatten` for gradients of these shapes and dtypes."""

  def split(flat: jax.Array) -> dict[str, jax.Array]:
    out, at = {}, 0
    for n, (shape, dtype) in zip(names, layout, strict=True):
      size = math.prod(shape)
      out[n] = flat[at:at + size].reshape(shape).astype(dtype)
      at += size
    return out

  return OnEachDevice(_in_ar_scope(split))


_add = OnEachDevice(_in_ar_scope(jnp.add))
