"""How data crosses slot boundaries: the interpreter's one interface to devices and processes.

`Transport` serves a single process that holds every node (device) of the plan: arrays
move with `jax.device_put`, a reduction is one `psum` over a mesh of exactly the holders'
devices (`GroupSum`), and every step commits. `runtime.multiprocess.ProcessTransport` extends it
to a `jax.distributed` job, where some nodes live in other processes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Params = dict[str, jax.Array]
ACT, GRAD, STATE = 0, 1, 2
Key = tuple[int, int, int]
"""(micro-batch, producing stage, ACT or GRAD): unique within one step attempt."""
Transfer = tuple[int, int, Sequence[str]]
"""State keys to move from a source node to a destination node (`Transport.exchange`)."""
Lookup = Callable[[int, str], jax.Array]
"""A source node's array of a state key."""
Specs = Mapping[str, jax.ShapeDtypeStruct]
Devices = tuple[jax.Device, ...]
PerDevice = dict[jax.Device, Params]
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


class GroupSum:
  """Sums dicts of arrays over a group of devices with one `psum` collective.

  The group is a mesh of exactly those devices, so a smaller group after a failure is just
  another mesh; one compiled program per group. Works within a process and across processes
  (each process passes its own devices' dicts).
  """

  def __init__(self):
    self._programs: dict[tuple[jax.Device, ...], tuple[Callable, NamedSharding]] = {}

  def _program(self, devices: tuple[jax.Device, ...]) -> tuple[Callable, NamedSharding]:
    if devices not in self._programs:
      mesh = Mesh(np.array(devices), ("dp",))
      spec = PartitionSpec("dp")
      summed = jax.shard_map(
        lambda tree: jax.tree.map(lambda x: jax.lax.psum(x, "dp"), tree),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
      )
      self._programs[devices] = (jax.jit(summed), NamedSharding(mesh, spec))
    return self._programs[devices]

  def __call__(
    self, devices: tuple[jax.Device, ...], local: Mapping[jax.Device, Params]
  ) -> dict[jax.Device, Params]:
    """`local` holds the dicts of the group's devices this process owns; returns their sums."""
    fn, sharding = self._program(devices)
    names = sorted(next(iter(local.values())))
    stacked = {}
    for n in names:
      shards = [local[d][n] for d in devices if d in local]
      shape = (shards[0].shape[0] * len(devices), *shards[0].shape[1:])
      stacked[n] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    out = fn(stacked)
    result: dict[jax.Device, Params] = {d: {} for d in local}
    for n in names:
      for shard in out[n].addressable_shards:
        result[shard.device][n] = shard.data
    return result


class Transport:
  """How data crosses slot boundaries; this base class serves a single process, in which every
  node is a local device (`runtime.multiprocess.ProcessTransport` extends it across processes).

  Args:
    devices: the device of every node.
  """

  remote_collectives = False
  """Whether a reduction may wait on other processes (then groups run in one global order)."""
  stop_requested = False
  """Set (by a signal handler) to stop the job after the step in flight; an attempt that
  commits carries it to every process in `Outcome.stop`."""

  def __init__(self, devices: Mapping[int, jax.Device]):
    self.devices = dict(devices)
    self._box: dict[Key, jax.Array] = {}
    self._group_sum = GroupSum()

  def is_local(self, node: int) -> bool:
    """Whether `node`'s device belongs to this process."""
    return node in self.devices

  def device(self, node: int) -> jax.Device:
    return self.devices[node]

  def begin(self, step: int, attempt: int, nodes: Sequence[int] = ()) -> None:
    """Starts an attempt at `step` on `nodes`: transfers and agreements are named after it."""
    del step, attempt, nodes
    self._box.clear()

  def send(self, key: Key, value: jax.Array, consumer: int) -> None:
    """Offers an activation or gradient to the node that consumes it."""
    del consumer
    self._box[key] = value

  def recv(self, key: Key, producer: int, spec: jax.ShapeDtypeStruct, device: jax.Device):
    """The array `producer` sent under `key`, on `device` (possibly filled asynchronously)."""
    del producer, spec
    return jax.device_put(self._box.pop(key), device)

  def reduce(
    self, index: int, nodes: Sequence[int], devices: Devices, local: PerDevice
  ) -> PerDevice:
    """Sums `local` (one dict per device) over `devices`; `index` names the group."""
    del index, nodes
    return self._group_sum(devices, local)

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
    self, transfers: Sequence[Transfer], lookup: Lookup, specs: Specs, channel: int, tag: Tag
  ) -> dict[int, dict[str, jax.Array]]:
    """Moves state between processes: each (source node, destination node, keys) is offered by
    the source's process (`lookup` gives its arrays) and pulled by the destination's. Every
    process passes the same list; returns {local destination node: {key: array}}."""
    del lookup, specs, channel, tag
    if any(not (self.is_local(a) and self.is_local(b)) for a, b, _ in transfers):
      raise ValueError("a single-process run has no other process to exchange state with")
    return {}  # every node is local: `Interpreter.place` copies between devices itself
