"""Checks that a `Schedule` is well formed, deadlock free and within a memory cap.

Memory is counted in micro-batches, per worker, at every point of its op list:

* *in flight*: micro-batches whose F has run and whose W (or BW) has not, i.e. whose stashed
  state (activations, then the inputs of the weight gradient) is still held. `memory_cap`
  applies to this count.
* *activations*: micro-batches whose F has run and whose B (or BW) has not. This is the Zero
  Bubble paper's M_B accounting: after B only the (smaller) weight-gradient inputs remain, so a
  deferred W costs less than a pending backward.
* *redundant*: outputs of redundant forwards (FR, Bamboo) still held: from FR of a micro-batch
  to this worker's own backward (B or BW) of it, after which the successor has finished that
  micro-batch's backward and the warm copy can no longer be needed in this step; an FR after
  that backward is held to the end of the step. `memory_cap` does not count them: they are
  reported apart, as `peak_redundant`.

Deadlock freedom is checked by replaying the schedule (`cost.simulate`, ~10 us an op), or, when
the planner hands over the start time it gave every compute op (`Timing`: the list scheduler
times what it places), by checking that certificate: each op starts after the op before it on
its worker and after every op it depends on ends (plus the transfer time across workers). Times
that satisfy every dependency, every op taking some time, order the ops (by start), so no
cycle exists; the check is a few
dictionary lookups an op, not a replay, which keeps a validator on the recovery path at scale
(`policy/rerouting.py`). A planner bug that lists ops in an order its own times contradict, or
that starts an op before its input exists, fails it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from resilient_jax.schedule.core import AR, BW, FR, OPT, B, F, Op, Piece, Schedule, W, Worker
from resilient_jax.schedule.cost import DurationFn, OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError

__all__ = [
  "ScheduleError",
  "Timing",
  "ValidationReport",
  "peak_activations",
  "peak_inflight",
  "peak_redundant",
  "validate",
]


@dataclasses.dataclass(frozen=True)
class ValidationReport:
  """What `validate` measured on a valid schedule.

  Attributes:
    peak_inflight: per worker, the most micro-batches between F and W/BW at any point.
    peak_activations: per worker, the most micro-batches between F and B/BW at any point.
    peak_redundant: per worker, the most redundant-forward (FR) outputs held at any point.
  """

  peak_inflight: dict[Worker, int]
  peak_activations: dict[Worker, int]
  peak_redundant: dict[Worker, int] = dataclasses.field(default_factory=dict)

  @property
  def max_peak_inflight(self) -> int:
    return max(self.peak_inflight.values(), default=0)

  @property
  def max_peak_redundant(self) -> int:
    return max(self.peak_redundant.values(), default=0)


def _peaks(ops: Sequence[Op]) -> tuple[int, int, int]:
  """`peak_inflight`, `peak_activations` and `peak_redundant` of one list, in one pass: each
  counts micro-batches from their F (FR) to their first release (W or BW; B or BW)."""
  inflight: set[int] = set()
  active: set[int] = set()
  redundant: set[int] = set()
  peaks = [0, 0, 0]
  for op in ops:
    kind, mb = op.kind, op.mb
    if kind == F:
      inflight.add(mb)
      active.add(mb)
      peaks[0] = max(peaks[0], len(inflight))
      peaks[1] = max(peaks[1], len(active))
    elif kind == B or kind == BW:
      active.discard(mb)
      redundant.discard(mb)
      if kind == BW:
        inflight.discard(mb)
    elif kind == W:
      inflight.discard(mb)
    elif kind == FR:
      redundant.add(mb)
      peaks[2] = max(peaks[2], len(redundant))
  return peaks[0], peaks[1], peaks[2]


def peak_inflight(ops: Sequence[Op]) -> int:
  """Most micro-batches with F done and W/BW not yet done, over a worker's op list."""
  return _peaks(ops)[0]


def peak_activations(ops: Sequence[Op]) -> int:
  """Most micro-batches with F done and B/BW not yet done, over a worker's op list."""
  return _peaks(ops)[1]


def peak_redundant(ops: Sequence[Op]) -> int:
  """Most redundant-forward outputs held at once: from FR of a micro-batch to its B/BW."""
  return _peaks(ops)[2]


@dataclasses.dataclass(frozen=True)
class Timing:
  """A planner's start times, the certificate `validate` checks instead of replaying.

  Attributes:
    starts: per worker, the start of each of its compute ops (F, B, W, BW), in list order; its
      list must end with AR then OPT, which are not timed.
    duration: how long an op takes on a worker (what the planner used).
    comm: the transfer time the planner added to every dependency across workers.
  """

  starts: Mapping[Worker, Sequence[float]]
  duration: DurationFn
  comm: float = 0.0


_TIMED = frozenset((F, B, W, BW))
_TAIL = (Op(AR), Op(OPT))


def _certified(schedule: Schedule, timing: Timing) -> bool:
  """Whether `timing` proves `schedule` deadlock free (module docstring); False when it does
  not cover the schedule (another list shape: the caller replays instead).

  Called after `_check_worker`, which puts each backward after its forward and each W after its
  B in their worker's list: with times rising along every list, those dependencies hold, and
  only the ones across workers (a forward's input from the stage below, a backward's gradient
  from the stage above) are looked up.

  Raises:
    ScheduleError: when a time contradicts the list order or a dependency.
  """
  pp, comm, duration = schedule.pp, timing.comm, timing.duration
  end: dict[int, float] = {}  # of F (node * 2) and B or BW (node * 2 + 1); node = mb * pp + s
  for w in schedule.workers:
    ops, starts = schedule.ops[w], timing.starts.get(w)
    if starts is None or len(ops) != len(starts) + 2 or tuple(ops[-2:]) != _TAIL:
      return False
    prev, s = 0.0, w[1]
    for op, t in zip(ops, starts, strict=False):  # AR and OPT untimed
      kind = op.kind
      if kind not in _TIMED:
        return False
      if t < prev * (1 - 1e-12):
        raise ScheduleError(f"schedule {schedule.name}: worker {w}: {op} starts at {t:.6g}, "
                            f"before the op before it ends ({prev:.6g})")
      took = duration(w, op)
      if not took > 0:  # a zero-length op could close a cycle at one instant
        return False
      prev = t + took
      if kind != W:
        # The latest of a split stage's pieces: the next stage gathers them all.
        key = (op.mb * pp + s) * 2 + (kind != F)
        if prev > end.get(key, -1.0):
          end[key] = prev
  for w in schedule.workers:
    s = w[1]
    for op, t in zip(schedule.ops[w], timing.starts[w], strict=False):
      kind, node = op.kind, op.mb * pp + s
      if kind == F:
        if s and end[(node - 1) * 2] + comm > t * (1 + 1e-12):
          raise ScheduleError(f"schedule {schedule.name}: worker {w}: {op} starts at {t:.6g}, "
                              f"before its input from stage {s - 1} arrives")
      elif kind != W and s < pp - 1 and end[(node + 1) * 2 + 1] + comm > t * (1 + 1e-12):
        raise ScheduleError(f"schedule {schedule.name}: worker {w}: {op} starts at {t:.6g}, "
                            f"before the gradient from stage {s + 1} arrives")
  return True


def _check_route(schedule: Schedule) -> None:
  name = schedule.name
  if len(schedule.route) != schedule.num_microbatches:
    raise ScheduleError(
      f"schedule {name}: route has {len(schedule.route)} entries, "
      f"dp*m = {schedule.num_microbatches}"
    )
  for w in schedule.ops:
    if not (0 <= w[0] < schedule.dp and 0 <= w[1] < schedule.pp):
      raise ScheduleError(
        f"schedule {name}: worker {w} is outside the {schedule.dp}x{schedule.pp} grid"
      )
  for mb, r in enumerate(schedule.route):
    if len(r) != schedule.pp:
      raise ScheduleError(f"schedule {name}: route of mb{mb} has {len(r)} stages, pp={schedule.pp}")
    for s, d in enumerate(r):
      if (d, s) not in schedule.ops:
        raise ScheduleError(
          f"schedule {name}: route sends stage {s} of mb{mb} to worker {(d, s)}, not a live worker"
        )


def _check_worker(schedule: Schedule, worker: Worker, routed: set[int]) -> None:
  """Per-worker structure: the right ops, each once, in a runnable local order.

  Positions are keyed by `(kind, mb)` tuples, not `Op`s: hashing a tuple is C, an `Op`'s
  dataclass hash is Python, and the runtime validates on its recovery path."""
  where = f"schedule {schedule.name}: worker {worker}"
  ops = schedule.ops[worker]
  pos: dict[tuple[str, int], int] = {}
  for i, op in enumerate(ops):
    key = (op.kind, op.mb)
    if key in pos:
      raise ScheduleError(f"{where}: {op} appears twice")
    if op.mb >= 0 and op.mb not in routed:
      raise ScheduleError(
        f"{where}: runs {op} but stage {worker[1]} of mb{op.mb} is not routed here"
      )
    pos[key] = i
  get = pos.get
  for mb in sorted(routed):
    f, b, w, bw = get((F, mb)), get((B, mb)), get((W, mb)), get((BW, mb))
    if f is None:
      raise ScheduleError(f"{where}: F{mb} is missing")
    if bw is not None and (b is not None or w is not None):
      raise ScheduleError(f"{where}: mb{mb} mixes BW{mb} with a split B/W backward")
    if bw is None and b is None:
      raise ScheduleError(f"{where}: mb{mb} has no backward (B{mb} or BW{mb})")
    if bw is None and w is None:
      raise ScheduleError(f"{where}: W{mb} is missing")
    first_backward = bw if bw is not None else b
    if first_backward < f:
      raise ScheduleError(f"{where}: {ops[first_backward]} runs before F{mb}")
    if b is not None and w < b:
      raise ScheduleError(f"{where}: W{mb} runs before B{mb}")
    fr = get((FR, mb))
    # On the last stage FR is stage 0's forward, which reads the data, not this stage's output.
    if fr is not None and fr < f and worker[1] < schedule.pp - 1:
      raise ScheduleError(f"{where}: FR{mb} runs before F{mb}, whose output it takes")
  ar, opt = get((AR, -1)), get((OPT, -1))
  if ar is None:
    raise ScheduleError(f"{where}: AR is missing")
  if opt is None:
    raise ScheduleError(f"{where}: OPT is missing")
  last_grad = max((i for (kind, _), i in pos.items() if kind in (W, BW)), default=-1)
  if ar < last_grad:
    raise ScheduleError(f"{where}: AR runs before {ops[last_grad]}")
  # FR reads the replica of the successor's weights, which the step's update must not overtake.
  last_fr = max((i for (kind, _), i in pos.items() if kind == FR), default=-1)
  if ar < last_fr:
    raise ScheduleError(f"{where}: AR runs before {ops[last_fr]}")
  if opt < ar:
    raise ScheduleError(f"{where}: OPT runs before AR")


def _check_pieces(schedule: Schedule, routed: dict[Worker, set[int]]) -> None:
  """A split stage's pieces tile the micro-batch's samples on distinct live workers, and each
  of those runs its piece's rows, where an unsplit stage runs whole ops.

  Adds each piece's micro-batch to its worker's `routed` set (the route names only the first).
  """
  name, size = schedule.name, schedule.samples
  for (mb, s), split in schedule.pieces.items():
    if not (0 <= mb < schedule.num_microbatches and 0 <= s < schedule.pp):
      raise ScheduleError(f"schedule {name}: pieces of mb{mb} stage {s} are outside the grid")
    at = 0
    for d, lo, hi in split:
      if lo != at or hi <= lo:
        raise ScheduleError(f"schedule {name}: pieces of mb{mb} at stage {s} do not tile its "
                            f"{size} samples: {lo}:{hi} after {at}")
      at = hi
      if (d, s) not in schedule.ops:
        raise ScheduleError(f"schedule {name}: a piece of mb{mb} goes to {(d, s)}, not a live "
                            "worker")
      routed[(d, s)].add(mb)
    if at != size or len({d for d, _, _ in split}) != len(split) or len(split) < 2:
      raise ScheduleError(f"schedule {name}: pieces of mb{mb} at stage {s} must cover its "
                          f"{size} samples on at least two distinct workers")
  for w in schedule.workers:
    for op in schedule.ops[w]:
      if op.mb < 0:
        continue
      want = schedule.samples_of(w, op.mb) if (op.mb, w[1]) in schedule.pieces else None
      got = (op.lo, op.hi) if isinstance(op, Piece) else None
      if got != want or (isinstance(op, Piece) and op.size != size):
        raise ScheduleError(f"schedule {name}: worker {w} runs {op}, but its share of "
                            f"mb{op.mb} is {'the whole micro-batch' if want is None else want}")


def validate(schedule: Schedule, memory_cap: int | None = None, timing: Timing | None = None
             ) -> ValidationReport:
  """Checks `schedule` and measures its memory.

  Args:
    schedule: the schedule to check.
    memory_cap: if given, the most micro-batches any worker may hold in flight (F done, W/BW
      not done) at once.
    timing: the planner's start times: checked as a certificate of deadlock freedom instead of
      a replay (module docstring), where they cover the schedule.

  Returns:
    The per-worker memory peaks.

  Raises:
    ScheduleError: with a one-line reason, for a bad route, pieces that do not tile their
      micro-batch or an op on other rows than its worker's piece, a missing, duplicated or
      misplaced op, an op for a micro-batch not routed to its worker, a deadlock, or a worker
      above `memory_cap`.
  """
  _check_route(schedule)
  routed: dict[Worker, set[int]] = {w: set() for w in schedule.ops}
  pieces = schedule.pieces
  for mb, r in enumerate(schedule.route):
    for s, d in enumerate(r):
      if not pieces or (mb, s) not in pieces:
        routed[(d, s)].add(mb)
  if pieces:
    _check_pieces(schedule, routed)
  for w in schedule.workers:
    _check_worker(schedule, w, routed[w])
  # Local orders are fine; a cross-worker cycle shows up as a deadlock of the replay. Unit
  # costs make every op take time so that the message reflects the order, not a tie.
  if timing is None or not _certified(schedule, timing):
    simulate(schedule, OpCosts(f=1.0, b=1.0, w=1.0, ar=1.0, opt=1.0))
  peaks = {w: _peaks(schedule.ops[w]) for w in schedule.workers}
  report = ValidationReport(
    peak_inflight={w: p[0] for w, p in peaks.items()},
    peak_activations={w: p[1] for w, p in peaks.items()},
    peak_redundant={w: p[2] for w, p in peaks.items()},
  )
  if memory_cap is not None:
    for w, peak in report.peak_inflight.items():
      if peak > memory_cap:
        raise ScheduleError(
          f"schedule {schedule.name}: worker {w} holds {peak} micro-batches in flight, "
          f"above the memory cap of {memory_cap}"
        )
  return report
