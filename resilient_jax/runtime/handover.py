"""State hand-over between plans and processes: which node sends which state to which.

After a failure the new plan's slots take their parameters and optimizer entries from surviving
replicas. Within a process `Interpreter.place` copies between devices itself; what a process
lacks comes from another process, and every process computes the same list of transfers from
the old and the new plan, so the holder offers exactly what the receiver pulls
(`Transport.exchange`). Bamboo's replicas of a successor stage held by another process are
refreshed the same way after every step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from resilient_jax.model.sharding import Where, abstract_mesh, opt_entry_spec
from resilient_jax.programs.packing import Packed
from resilient_jax.programs.state import FlatEntries
from resilient_jax.schedule.pipelines import LayerRange
from resilient_jax.schedule.plan import Slot, StepProgram

Source = tuple[Where | None, Mapping[str, Any], Mapping[str, Any]]
"""State to place from: its worker's device or sub-mesh (`Transport.device`; None: host memory),
parameters and flat optimizer entries."""


def _layout_prefix(split: tuple[LayerRange, ...], stage: int) -> str:
  """The key prefix of a packed stage's buffers: the same in every process."""
  return "L" + hashlib.sha1(repr((tuple(split), stage)).encode()).hexdigest()[:12]


def same_layout(src: Source, prog: Any) -> bool:
  """Whether `src` holds `prog`'s state in `prog`'s own layout (its buffers serve as they are)."""
  return isinstance(src[1], Packed) and src[1].layout == prog.layout and (
    isinstance(src[2], FlatEntries) and src[2].layout == prog.layout
    if prog.flat_opt is not None else True)


def _opt_state(prog: Any, entries: Mapping[str, Any]) -> Any:
  """The optimizer state as `prog` holds it, from a same-layout holder's entries."""
  if isinstance(entries, FlatEntries):
    return entries.state
  from resilient_jax.checkpoint import universal

  return universal.unflatten_state(prog.opt_template, entries, what="optimizer state")


class StateHandover:
  """The hand-over part of `Interpreter` (which provides `programs`, `transport`,
  `step_program` and `_specs`)."""

  _layouts: dict[str, tuple[tuple[LayerRange, ...], int]]
  """Each packed stage's key prefix (`_layout_prefix`) -> its (split, stage)."""
  handed_over: list[tuple[int, int, int]] = []
  """The last hand-over's transfers between processes: (source node, destination node, bytes);
  the same list in every process (what the log and `recovery.json` say about where state came
  from)."""

  def _state_specs(self, split: tuple[LayerRange, ...], stage: int) -> dict[str, Any]:
    """Every state key a slot of `(split, stage)` holds ("p/" parameter names, "o/" optimizer
    entries) with its shape and dtype, and with `mesh.tp > 1` its split over a worker's
    sub-mesh (a sharding over the abstract sub-mesh: a transfer between processes moves the
    pieces, `Cluster.offer`)."""
    key = (split, stage)
    if key not in self._specs:
      from resilient_jax.checkpoint import universal

      prog = self.programs(split)[stage]
      params = prog.abstract_params()
      opt = universal.flatten_state(prog.opt_template)
      shapes = {n: v.shape for n, v in params.items()}

      def spec(value: Any, split: PartitionSpec) -> jax.ShapeDtypeStruct:
        on = None if prog.tp == 1 else NamedSharding(abstract_mesh(prog.tp), split)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=on)

      specs = {"p/" + n: spec(v, prog.param_specs[n]) for n, v in params.items()}
      specs.update({"o/" + k: spec(v, opt_entry_spec(k, v.shape, prog.param_specs, shapes))
                    for k, v in opt.items()})
      if prog.packed:  # the stage's buffers as they are, for a holder of the same layout
        prefix = _layout_prefix(split, stage)
        self._layouts[prefix] = key
        packed, opt_state = prog.abstract_state()
        specs.update({f"{prefix}/p{b}": spec(v, PartitionSpec())
                      for b, v in enumerate(packed.buffers)})
        specs.update({f"{prefix}/o{i}": spec(v, PartitionSpec())
                      for i, v in enumerate(jax.tree.leaves(opt_state))})
      self._specs[key] = specs
    return self._specs[key]

  def _keys(self, split: tuple[LayerRange, ...], stage: int, whole: bool) -> set[str]:
    """A stage's state keys: its buffers' (`whole`, a packed stage), else by name."""
    layout = whole and self.programs(split)[stage].packed
    return {k for k in self._state_specs(split, stage) if k.startswith("L") == layout}

  def _slot_keys(self, sp: StepProgram, slot: Slot, replica: bool = True) -> set[str]:
    """Every key `slot` holds: by name, and its buffers' where packed."""
    p = sp.slots[slot]
    keys = set(self._state_specs(p.split, p.stage))
    if replica and p.replica is not None:
      keys |= set(self._state_specs(p.split, p.replica))
    return keys

  def _wanted(self, slot: Slot, held: Mapping[int, set[str]]) -> set[str]:
    """The keys `slot` of the current plan lacks on its node: none when the node holds its
    stage's state (in its layout or by name); a holder's buffers whole when a live node holds
    the same layout (no program reads or packs them); else by name."""
    p = self.step_program.slots[slot]
    have = held.get(p.node, set())
    whole, names = self._keys(p.split, p.stage, True), self._keys(p.split, p.stage, False)
    if names <= have or (whole and whole <= have):
      return set()
    if whole and any(whole <= keys for keys in held.values()):
      return whole - have
    return names - have

  def _exchange(
    self, transfers: list[tuple[int, int, list[str]]], sources: Sequence[Source],
    specs: Mapping[str, Any], channel: int, tag: tuple[int, int], lost_ok: bool = False,
  ) -> list[Source]:
    """Runs `transfers` (source node, destination node, keys) between processes; returns what
    arrived here as sources (with `lost_ok`, without what a process that died did not serve:
    `Transport.exchange`)."""

    def lookup(node: int, key: str) -> jax.Array:
      dev = self.transport.device(node)
      if key.startswith("L"):  # a buffer of a holder of that layout
        prefix, what = key.split("/", 1)
        split, stage = self._layouts[prefix]
        prog = self.programs(split)[stage]
        src = next(src for src in sources if src[0] == dev and same_layout(src, prog))
        if what[0] == "p":
          return src[1].buffers[int(what[1:])]
        return jax.tree.leaves(_opt_state(prog, src[2]))[int(what[1:])]
      table = 1 if key.startswith("p/") else 2
      return next(src[table][key[2:]] for src in sources if src[0] == dev and key[2:] in src[table])

    received = self.transport.exchange(transfers, lookup, specs, channel, tag, lost_ok)
    out: list[Source] = []
    for node, got in sorted(received.items()):
      dev = self.transport.device(node)
      by_name = ({k[2:]: v for k, v in got.items() if k.startswith("p/")},
                 {k[2:]: v for k, v in got.items() if k.startswith("o/")})
      if by_name[0] or by_name[1]:
        out.append((dev, *by_name))
      for prefix in sorted({k.split("/", 1)[0] for k in got if k.startswith("L")}):
        split, stage = self._layouts[prefix]
        prog = self.programs(split)[stage]
        packed, opt_state = prog.abstract_state()
        params = Packed(prog.layout, [got[f"{prefix}/p{b}"] for b in range(len(packed.buffers))])
        leaves = [got[f"{prefix}/o{i}"] for i in range(len(jax.tree.leaves(opt_state)))]
        out.append((dev, params, prog.opt_entries(jax.tree.unflatten(
          jax.tree.structure(opt_state), leaves))))
    return out

  def _handover(
    self, old: StepProgram, dead: set[int], sources: Sequence[Source], tag: tuple[int, int]
  ) -> list[Source]:
    """What the current plan's slots need from other processes after a failure, exchanged."""
    transfers = self.handover_transfers(old, dead)
    specs: dict[str, Any] = {}
    for p in self.step_program.slots.values():
      specs.update(self._state_specs(p.split, p.stage))
    self.handed_over = [
      (src, dst, sum(math.prod(specs[k].shape) * specs[k].dtype.itemsize for k in keys))
      for src, dst, keys in transfers
    ]
    return self._exchange(transfers, sources, specs, channel=0, tag=tag)

  def handover_transfers(self, old: StepProgram, dead: set[int]
                         ) -> list[tuple[int, int, list[str]]]:
    """(source node, destination node, state keys) the current plan's slots need after
    `dead` failed under `old`, between any two nodes (a process runs those between itself and
    another).

    Every process computes the same list from the old and the new plan: each key a node lacks
    comes from the lowest live node that held it in the old plan. A replica (Bamboo) of a
    stage whose node is among `dead` does not count as held: its last refresh may not have
    arrived (that node can die before serving it, `refresh_replicas`), which only its holder
    knows, so its holder takes the stage from a live node that ran it, if any; where none did,
    `place` uses the replica if it arrived.
    """
    held: dict[int, set[str]] = {}
    for slot, p in old.slots.items():
      if p.node in dead:
        continue
      source = old.slots[(slot[0], p.replica)].node if p.replica is not None else None
      held.setdefault(p.node, set()).update(self._slot_keys(old, slot,
                                                            replica=source not in dead))
    wanted: dict[tuple[int, int], set[str]] = {}
    for slot, p in sorted(self.step_program.slots.items()):
      for key in sorted(self._wanted(slot, held)):
        owners = sorted(n for n, keys in held.items() if key in keys)
        if owners:  # none: `place` reports the missing key
          wanted.setdefault((owners[0], p.node), set()).add(key)
    return [(src, dst, sorted(keys)) for (src, dst), keys in sorted(wanted.items())]
