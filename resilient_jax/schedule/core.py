"""Pipeline schedules as plain data.

A `Schedule` says, for every live worker `(dp, stage)`, the ordered list of ops it runs in one
training step, and for every micro-batch which data-parallel worker runs each of its stages (its
*route*). Nothing here imports JAX: the same objects are printed, validated, costed, executed by
the runtime, replanned by the coordinator and replayed by the simulator.

Micro-batch ids run over the whole global batch: pipeline `d` owns ids `d*m .. d*m + m - 1`
(m = micro-batches per pipeline). In a fault-free schedule every stage of micro-batch `mb` runs in
its owner's pipeline; after failures the planner re-routes some stages to peers, so a route like
`(0, 1, 0)` means stage 1 of that micro-batch runs on worker (1, 1) and the activations travel
(0, 0) -> (1, 1) -> (0, 2) and the gradients back the same way.

Communication is implicit: every dependency between ops of two different workers is a transfer
(activation forward, activation-gradient backward), costed by the cost model and carried out by
the runtime when the consumer's op is dispatched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence

Worker = tuple[int, int]
"""A worker is `(dp, stage)`: one device (or sub-mesh) of the DP x PP grid."""

F = "F"  # forward: keeps what the backward needs
B = "B"  # input gradient only (activation gradient for the previous stage)
W = "W"  # weight gradient only, from what B captured; deferrable
BW = "BW"  # fused backward (B then W as one program): what GPipe and 1F1B run
AR = "AR"  # all-reduce of this stage's weight gradients over its live data-parallel peers
OPT = "OPT"  # this stage's optimizer step
# Redundant forward (Bamboo, NSDI'23): the worker also runs its successor stage's forward of `mb`
# (stage 0's for the last stage: the stages form a ring) on a replica of the successor's layers,
# so that a warm copy exists if the successor fails. Nothing depends on it in a fault-free step.
FR = "FR"

COMPUTE_KINDS = (F, B, W, BW, FR)
ALL_KINDS = (F, B, W, BW, AR, OPT, FR)


@dataclasses.dataclass(frozen=True, order=True)
class Op:
  """One op in a worker's list. `mb` is the micro-batch id for F/B/W/BW/FR and -1 otherwise."""

  kind: str
  mb: int = -1

  def __post_init__(self):
    if self.kind not in ALL_KINDS:
      raise ValueError(f"unknown op kind {self.kind!r}")
    if (self.kind in COMPUTE_KINDS) != (self.mb >= 0):
      raise ValueError(f"op {self.kind} needs mb >= 0 exactly when it is a compute op")

  def __str__(self) -> str:
    return f"{self.kind}{self.mb}" if self.mb >= 0 else self.kind


@dataclasses.dataclass(frozen=True, order=True)
class Piece(Op):
  """A compute op on part of a micro-batch: samples `lo .. hi - 1` of the `size` it holds.

  Sample-granular re-routing (`routing.split_route`) spreads a failed or slow worker's samples
  over more of its stage's peers than it has micro-batches: each peer runs a piece, the stage
  before sends each piece its rows of the activations and the stage after gathers them. Loss
  weights over the global batch make a sample the unit, so a piece's gradients add up to the
  whole micro-batch's. On a worker a piece stands where the whole op would: one per
  micro-batch, its F, B and W all on the same rows. A `Piece` never equals the `Op` of the whole
  micro-batch (dataclass equality compares the class).
  """

  lo: int = 0
  hi: int = 0
  size: int = 0

  def __post_init__(self):
    super().__post_init__()
    if self.kind not in COMPUTE_KINDS:
      raise ValueError(f"a piece is a compute op, not {self.kind}")
    if not 0 <= self.lo < self.hi <= self.size or (self.lo, self.hi) == (0, self.size):
      raise ValueError(f"piece {self.lo}:{self.hi} of {self.size} samples is not a proper part")

  @property
  def fraction(self) -> float:
    """The share of the micro-batch's samples this piece holds."""
    return (self.hi - self.lo) / self.size

  def like(self, kind: str) -> Piece:
    """The op of kind `kind` on the same rows."""
    return Piece(kind, self.mb, self.lo, self.hi, self.size)

  def __str__(self) -> str:
    return f"{self.kind}{self.mb}[{self.lo}:{self.hi}]"


def same_rows(op: Op, kind: str) -> Op:
  """The op of kind `kind` on the rows `op` runs on (the whole micro-batch or its piece)."""
  return op.like(kind) if isinstance(op, Piece) else Op(kind, op.mb)


PieceMap = Mapping[tuple[int, int], tuple[tuple[int, int, int], ...]]
"""`{(mb, stage): ((dp, lo, hi), ...)}`: the stages of micro-batches split into pieces, each
piece's worker and samples, in sample order, tiling `0 .. samples`."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One training step for a DP x PP grid, possibly with failed workers.

  Attributes:
    name: the generator or planner that made it (`gpipe`, `1f1b`, `zb-h1`, `adaptive`, ...).
    dp: number of data-parallel pipelines in the grid (failed ones included).
    pp: number of pipeline stages.
    microbatches: micro-batches per pipeline (m); the step has `dp * m` micro-batches.
    route: `route[mb][stage]` is the dp index of the worker running that stage of `mb` (a
      tuple, or for a plan expanded from part of the grid an `expand.ExpandedRoute` that
      builds entries on use).
    ops: ordered ops of every live worker (a dict, or an `expand.ExpandedOps` that builds a
      worker's list on first use: a process of a large job only reads its own workers').
    pieces: the stages of micro-batches split into pieces (`PieceMap`); for those,
      `route[mb][stage]` names the first piece's worker and the ops are `Piece`s.
    samples: samples in one micro-batch (what pieces divide).
  """

  name: str
  dp: int
  pp: int
  microbatches: int
  route: Sequence[tuple[int, ...]]
  ops: Mapping[Worker, tuple[Op, ...]]
  pieces: PieceMap = dataclasses.field(default_factory=dict)
  samples: int = 1

  @property
  def num_microbatches(self) -> int:
    return self.dp * self.microbatches

  def owner(self, mb: int) -> int:
    """The pipeline whose share of the global batch `mb` is."""
    return mb // self.microbatches

  def worker_of(self, mb: int, stage: int) -> Worker:
    return (self.route[mb][stage], stage)

  @property
  def workers(self) -> list[Worker]:
    return sorted(self.ops)

  def stage_workers(self, stage: int) -> list[Worker]:
    """Live workers of `stage`: the data-parallel group its gradients are reduced over."""
    return [w for w in self.workers if w[1] == stage]

  def microbatches_of(self, worker: Worker) -> list[int]:
    """Micro-batches whose stage `worker[1]` runs on `worker` (whole or a piece), in id order."""
    d, s = worker
    if not self.pieces:
      return [mb for mb in range(self.num_microbatches) if self.route[mb][s] == d]
    return [mb for mb in range(self.num_microbatches)
            if (any(p[0] == d for p in self.pieces[(mb, s)]) if (mb, s) in self.pieces
                else self.route[mb][s] == d)]

  def stage_ops(self, mb: int, stage: int, kind: str) -> list[tuple[Worker, Op]]:
    """The ops of kind `kind` that run stage `stage` of `mb`: one, or one per piece."""
    split = self.pieces.get((mb, stage)) if self.pieces else None
    if split is None:
      return [((self.route[mb][stage], stage), Op(kind, mb))]
    return [((d, stage), Piece(kind, mb, lo, hi, self.samples)) for d, lo, hi in split]

  def samples_of(self, worker: Worker, mb: int) -> tuple[int, int]:
    """The samples `lo, hi` of `mb` that `worker` runs its stage on (`0, samples`: all)."""
    split = self.pieces.get((mb, worker[1])) if self.pieces else None
    if split is None:
      return 0, self.samples
    for d, lo, hi in split:
      if d == worker[0]:
        return lo, hi
    raise KeyError(f"worker {worker} runs no piece of micro-batch {mb}")

  def backward_op(self, mb: int, stage: int) -> Op:
    """The op that produces the activation gradient of `mb` at `stage` (B or BW)."""
    return self.backward_op_at(self.worker_of(mb, stage), mb, stage)

  def backward_ops(self, mb: int, stage: int) -> list[tuple[Worker, Op]]:
    """Every op that produces part of the activation gradient of `mb` at `stage`: one, or one
    per piece."""
    split = self.pieces.get((mb, stage)) if self.pieces else None
    if split is None:
      worker = self.worker_of(mb, stage)
      return [(worker, self.backward_op_at(worker, mb, stage))]
    return [((d, stage), self.backward_op_at((d, stage), mb, stage)) for d, _, _ in split]

  def backward_op_at(self, worker: Worker, mb: int, stage: int) -> Op:
    """The B or BW of `mb` on `worker` (of stage `stage`)."""
    index = self._backward_index.get(worker)
    if index is None:
      # Built once per worker, and only for the workers asked about, so that `dependencies()`
      # stays O(1) per op (the cost model walks every op of 1000s of workers) and a lookup does
      # not expand a whole lazily expanded plan. The first B/BW of a micro-batch wins, as a list
      # scan would.
      index = self._backward_index[worker] = {}
      for op in self.ops[worker]:
        if op.kind in (B, BW):
          index.setdefault(op.mb, op)
    op = index.get(mb)
    if op is None:
      raise KeyError(f"no backward for micro-batch {mb} at stage {stage}")
    return op

  @functools.cached_property
  def _backward_index(self) -> dict[Worker, dict[int, Op]]:
    return {}

  def to_text(self) -> str:
    """A printable form: one line per worker, plus the routes that leave their pipeline.

    The healthy pipelines that an expanded plan runs on one shared template of lists
    (`ExpandedOps.folded`) are summed up in one line, so the text of a 16k-worker plan is as long
    as what the failure changed. Built once per schedule: the trainer compares it every step.
    """
    if "_text" not in self.__dict__:
      self.__dict__["_text"] = self._render()
    return self.__dict__["_text"]

  def _render(self) -> str:
    folded = getattr(self.ops, "folded", frozenset())
    lines = [f"schedule {self.name}: dp={self.dp} pp={self.pp} m={self.microbatches}"]
    for w in self.workers:
      if w[0] not in folded:
        lines.append(f"  d{w[0]} s{w[1]} | " + " ".join(str(op) for op in self.ops[w]))
    if folded:
      lines.append(f"  the other {len(folded)} pipelines {self.ops.folded_note}")
    m = self.microbatches
    shown = (mb for d in range(self.dp) if d not in folded for mb in range(d * m, (d + 1) * m))
    moved = [
      f"  mb{mb}: " + " -> ".join(f"({d},{s})" for s, d in enumerate(self.route[mb]))
      for mb in shown
      if any(d != self.owner(mb) for d in self.route[mb])
    ]
    if moved:
      lines.append("re-routed micro-batches:")
      lines.extend(moved)
    if self.pieces:
      lines.append(f"split into pieces (of {self.samples} samples):")
      lines.extend(f"  mb{mb} s{s}: " + " ".join(f"d{d}[{lo}:{hi}]" for d, lo, hi in split)
                   for (mb, s), split in sorted(self.pieces.items()))
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.to_text()


def dependencies(schedule: Schedule, worker: Worker, op: Op) -> Iterator[tuple[Worker, Op]]:
  """The ops (on any worker) that must finish before `op` can start on `worker`.

  The order within a worker's own list is an extra, implicit dependency. AR is a collective
  over `schedule.stage_workers(stage)`; its dependencies here are the local ones only (every
  weight-gradient op of this worker), the cost model and runtime add the synchronisation.

  FR of `mb` on stage `s` takes the input the successor stage gets, i.e. the output of this
  worker's own F of `mb`; on the last stage it is stage 0's forward, whose input is the data, so it
  depends on nothing. No op depends on FR.
  """
  d, s = worker
  if schedule.pieces:
    yield from _piece_dependencies(schedule, worker, op)
    return
  if op.kind == F:
    if s > 0:
      yield schedule.worker_of(op.mb, s - 1), Op(F, op.mb)
  elif op.kind in (B, BW):
    yield worker, Op(F, op.mb)
    if s < schedule.pp - 1:
      yield schedule.worker_of(op.mb, s + 1), schedule.backward_op(op.mb, s + 1)
  elif op.kind == W:
    yield worker, Op(B, op.mb)
  elif op.kind == AR:
    for other in schedule.ops[worker]:
      if other.kind in (W, BW):
        yield worker, other
  elif op.kind == OPT:
    yield worker, Op(AR)
  elif op.kind == FR:
    if s < schedule.pp - 1:
      yield worker, Op(F, op.mb)


def _piece_dependencies(schedule: Schedule, worker: Worker, op: Op
                        ) -> Iterator[tuple[Worker, Op]]:
  """`dependencies` of a schedule with pieces: a forward waits for every piece of the stage
  before (each sends its rows; a whole micro-batch is gathered from its pieces), a backward
  for every piece of the stage after, and a piece's own ops chain on its rows."""
  s = worker[1]
  if op.kind == F:
    if s > 0:
      yield from schedule.stage_ops(op.mb, s - 1, F)
  elif op.kind in (B, BW):
    yield worker, same_rows(op, F)
    if s < schedule.pp - 1:
      yield from schedule.backward_ops(op.mb, s + 1)
  elif op.kind == W:
    yield worker, same_rows(op, B)
  elif op.kind == AR:
    for other in schedule.ops[worker]:
      if other.kind in (W, BW):
        yield worker, other
  elif op.kind == OPT:
    yield worker, Op(AR)
  elif op.kind == FR:
    if s < schedule.pp - 1:
      yield worker, same_rows(op, F)


def fault_free_route(dp: int, pp: int, microbatches: int) -> tuple[tuple[int, ...], ...]:
  """Every micro-batch runs all its stages in its owner's pipeline."""
  return tuple((mb // microbatches,) * pp for mb in range(dp * microbatches))


def make_schedule(
  name: str,
  dp: int,
  pp: int,
  microbatches: int,
  per_worker: Mapping[Worker, Iterable[Op]],
  route: tuple[tuple[int, ...], ...] | None = None,
  pieces: PieceMap | None = None,
  samples: int = 1,
) -> Schedule:
  """Builds a `Schedule`, freezing the per-worker lists."""
  return Schedule(
    name=name,
    dp=dp,
    pp=pp,
    microbatches=microbatches,
    route=route if route is not None else fault_free_route(dp, pp, microbatches),
    ops={w: tuple(ops) for w, ops in sorted(per_worker.items())},
    pieces=dict(pieces or {}),
    samples=samples,
  )
