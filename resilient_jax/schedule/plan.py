"""What one training step runs, as *slots*: the single form the runtime's interpreter executes.

The policies plan in two shapes:

* a `GridPlan`: a DP x PP grid in which every pipeline cuts the model the same way and
  micro-batches may be re-routed to another pipeline's worker of the same stage (ReCycle, naive,
  restart, and `auto` while it re-routes);
* a `PipelineSet`: independent pipelines, each with its own cut of the layers (Oobleck), or a
  grid in which a stage may run on its predecessor's node and stages keep replicas (Bamboo).

`step_program` turns either into a `StepProgram`: per slot (a worker of the grid, or a
`(pipeline, stage)` of a set) the node it runs on, the layer split its stage programs come from,
its op list with *global* micro-batch ids, and for every micro-batch the slot that runs each of
its stages. The interpreter needs nothing else, so one interpreter runs every policy, in one
process or across many.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from resilient_jax.schedule.core import (
  AR,
  BW,
  FR,
  OPT,
  B,
  F,
  Op,
  Piece,
  Schedule,
  W,
  Worker,
  same_rows,
)
from resilient_jax.schedule.pipelines import LayerRange, PipelineSet

Slot = tuple[int, int]
"""`(dp, stage)` of a grid, or `(pipeline, stage)` of a pipeline set."""
Part = tuple[Slot, int, int]
"""A slot and the samples `lo, hi` of a micro-batch it runs a stage on."""
Link = tuple[Slot, Slot, int, int]
"""Rows `lo, hi` of a micro-batch that travel between a slot of stage `s` and one of `s + 1`
(activations forward, their gradients backward)."""


@dataclasses.dataclass(frozen=True)
class GridPlan:
  """A DP x PP grid run with re-routing.

  Attributes:
    schedule: the op lists of the live workers and every micro-batch's route.
    partition: the layers `[lo, hi)` of every stage.
    nodes: the node (device, or process) of every worker of the grid, failed ones included.
  """

  schedule: Schedule
  partition: tuple[LayerRange, ...]
  nodes: Mapping[Worker, int]

  @property
  def name(self) -> str:
    return self.schedule.name

  def to_text(self) -> str:
    return self.schedule.to_text()


Plan = GridPlan | PipelineSet


def describe(plan: Plan) -> str:
  """The plan's layout in a few words, for log lines: `dp=2 pp=4`, or its pipelines."""
  if isinstance(plan, GridPlan):
    return f"dp={plan.schedule.dp} pp={plan.schedule.pp}"
  return f"{len(plan.pipelines)} new {plan.name} pipelines"


@dataclasses.dataclass(frozen=True)
class SlotProgram:
  """One slot's part of a step.

  Attributes:
    node: where it runs.
    split: the layer split of its pipeline (which stage programs it uses).
    stage: its stage index in that split.
    ops: its ops in order, micro-batch ids global (for a grid plan, a `_LazyOps` that reads
      the schedule's list on first use).
    replica: the stage of its split whose replica it keeps and runs `FR` on, or None.
  """

  node: int
  split: tuple[LayerRange, ...]
  stage: int
  ops: Sequence[Op]
  replica: int | None = None

  @property
  def last(self) -> bool:
    return self.stage == len(self.split) - 1


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """A whole step: every slot's ops and every micro-batch's route through the slots.

  Attributes:
    name: the planner or policy that made it.
    slots: every live slot's program.
    route: `route[mb][s]` is the slot running stage `s` of micro-batch `mb` (stages of the
      split of the pipeline that owns `mb`); for a stage split into pieces, its first piece's.
    pieces: `{(mb, stage): ((slot, lo, hi), ...)}`: the stages of micro-batches split into
      pieces (`core.Piece`), in sample order, tiling `0 .. samples` (a grid plan's
      `Schedule.pieces`, as slots).
    samples: samples in one micro-batch.
  """

  name: str
  slots: Mapping[Slot, SlotProgram]
  route: Sequence[tuple[Slot, ...]]
  pieces: Mapping[tuple[int, int], tuple[Part, ...]] = dataclasses.field(default_factory=dict)
  samples: int = 1

  @property
  def num_microbatches(self) -> int:
    return len(self.route)

  @property
  def nodes(self) -> list[int]:
    return sorted({p.node for p in self.slots.values()})

  def forward_only(self) -> StepProgram:
    """The same slots and routes running their forward ops (F) only, each slot's in its
    order: every micro-batch's loss on its last stage, no backward, reduction, optimizer step
    or replica forward (an evaluation). Forward ops depend only on the stage before, so the
    filtered lists cannot deadlock; a slot's list is filtered on first use, as a grid's are
    read (`_LazyOps`)."""
    def forward(ops: Sequence[Op]) -> _LazyOps:
      return _LazyOps(lambda: (op for op in ops if op.kind == F))

    slots = {s: dataclasses.replace(p, ops=forward(p.ops), replica=None)
             for s, p in self.slots.items()}
    return StepProgram(self.name, slots, self.route, self.pieces, self.samples)

  def parts(self, mb: int, stage: int) -> tuple[Part, ...]:
    """The slots that run stage `stage` of `mb`, each with its samples: one, or its pieces."""
    split = self.pieces.get((mb, stage)) if self.pieces else None
    return split if split is not None else ((self.route[mb][stage], 0, self.samples),)

  def op_at(self, part: Part, kind: str, mb: int) -> Op:
    """The op of kind `kind` that `part` (of `parts`) runs of `mb`."""
    _, lo, hi = part
    return Op(kind, mb) if (lo, hi) == (0, self.samples) else Piece(kind, mb, lo, hi,
                                                                    self.samples)

  def links(self, mb: int, stage: int) -> list[Link]:
    """The rows of `mb` that travel between stage `stage` and `stage + 1`: one link per pair
    of their parts that share samples, in row order (one, unless either side is split). A
    consumer gathers its links' rows in this order; a producer sends each its rows."""
    out = []
    for a, alo, ahi in self.parts(mb, stage):
      for b, blo, bhi in self.parts(mb, stage + 1):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo < hi:
          out.append((a, b, lo, hi))
    return sorted(out, key=lambda link: link[2])

  def _backward_of(self, slot: Slot, mb: int) -> Op:
    """The B or BW of `mb` on `slot` (the first, as a list scan would find it)."""
    index = self._backward.get(slot)
    if index is None:
      # Per slot, on demand: a process asks about its own slots and their neighbours, and
      # indexing every slot would read every op list of a 16k-worker plan.
      index = self._backward[slot] = {}
      for op in self.slots[slot].ops:
        if op.kind in (B, BW):
          index.setdefault(op.mb, op)
    return index[mb]

  @functools.cached_property
  def _backward(self) -> dict[Slot, dict[int, Op]]:
    return {}

  @functools.cached_property
  def holders(self) -> dict[tuple[LayerRange, ...], dict[int, list[Slot]]]:
    """Slots per (split, stage), for looking up who holds which parameters."""
    out: dict[tuple[LayerRange, ...], dict[int, list[Slot]]] = {}
    for slot, prog in sorted(self.slots.items()):
      out.setdefault(prog.split, {}).setdefault(prog.stage, []).append(slot)
    return out

  def dependencies(self, slot: Slot, op: Op) -> Iterator[tuple[Slot, Op]]:
    """The ops (on any slot) that must be dispatched before `op` on `slot`.

    AR's dependencies are local (this slot's weight-gradient ops); the collective's
    synchronisation with the other holders is the interpreter's. OPT depends on this slot's AR.
    FR depends on this slot's own F of the micro-batch, except on the last stage (its input is
    the data).
    """
    prog = self.slots[slot]
    s = prog.stage
    if op.kind == F:
      if s > 0:
        # Every part of the stage before (a split one sends each piece's rows: a whole
        # micro-batch is gathered from its pieces).
        for part in self.parts(op.mb, s - 1):
          yield part[0], self.op_at(part, F, op.mb)
    elif op.kind in (B, BW):
      yield slot, same_rows(op, F)
      if not prog.last:
        for nxt, _, _ in self.parts(op.mb, s + 1):
          yield nxt, self._backward_of(nxt, op.mb)
    elif op.kind == W:
      yield slot, same_rows(op, B)
    elif op.kind == AR:
      for other in prog.ops:
        if other.kind in (W, BW):
          yield slot, other
    elif op.kind == OPT:
      yield slot, Op(AR)
    elif op.kind == FR and not prog.last:
      yield slot, same_rows(op, F)


class _LazyOps(Sequence[Op]):
  """An op list built on first use by `make`.

  A grid plan of 16k workers is expanded lazily (`expand.ExpandedOps`); the runtime builds every
  slot's program (node, split, stage) to find its own, and this keeps that from building every
  op list as well (a worker's list read from its schedule, or a slot's forward ops).
  """

  def __init__(self, make: Callable[[], Iterable[Op]]):
    self._make = make

  @functools.cached_property
  def _list(self) -> tuple[Op, ...]:
    return tuple(self._make())

  def __getitem__(self, i):  # int -> Op; slice -> tuple[Op, ...]
    return self._list[i]

  def __len__(self) -> int:
    return len(self._list)

  def __iter__(self) -> Iterator[Op]:
    return iter(self._list)

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Sequence):
      return NotImplemented
    return self._list == tuple(other)

  __hash__ = None  # type: ignore[assignment]  # equal to tuples, which hash differently

  def __repr__(self) -> str:
    return repr(self._list)


class _SlotRoute(Sequence[tuple[Slot, ...]]):
  """A grid schedule's routes as slots, each built on use (the route may be lazy too)."""

  def __init__(self, route: Sequence[tuple[int, ...]]):
    self._route = route

  def __getitem__(self, mb):  # int -> tuple[Slot, ...]; slice -> tuple of those
    if isinstance(mb, slice):
      return tuple(self[i] for i in range(*mb.indices(len(self))))
    return tuple((d, s) for s, d in enumerate(self._route[mb]))

  def __len__(self) -> int:
    return len(self._route)


def step_program(plan: Plan) -> StepProgram:
  """The slots of `plan` (see the module docstring).

  For a grid plan the op lists and routes are read from its schedule on use, so a process of a
  large job reads only what its own slots run and receive.
  """
  if isinstance(plan, GridPlan):
    sched = plan.schedule
    split = tuple(plan.partition)
    slots = {
      w: SlotProgram(plan.nodes[w], split, w[1], _LazyOps(lambda w=w: sched.ops[w]))
      for w in sched.ops
    }
    pieces = {key: tuple(((d, key[1]), lo, hi) for d, lo, hi in split)
              for key, split in sched.pieces.items()}
    return StepProgram(sched.name, slots, _SlotRoute(sched.route), pieces, sched.samples)
  slots = {}
  route: list[tuple[Slot, ...] | None] = [None] * plan.num_microbatches
  for p, pipe in enumerate(plan.pipelines):
    gid = pipe.microbatches
    for s in range(pipe.num_stages):
      ops = tuple(
        Op(op.kind, gid[op.mb]) if op.mb >= 0 else op for op in pipe.schedule.ops[(0, s)]
      )
      slots[(p, s)] = SlotProgram(pipe.nodes[s], pipe.stages, s, ops, pipe.replica_of(s))
    for mb in gid:
      route[mb] = tuple((p, s) for s in range(pipe.num_stages))
  return StepProgram(plan.name, slots, tuple(route))  # type: ignore[arg-type]


__all__ = ["GridPlan", "Link", "Part", "Plan", "Slot", "SlotProgram", "StepProgram", "step_program"]
