"""Cost model: replays a `Schedule` as a discrete-event timeline.

The same replay serves three callers: generators and tests (analytic per-op costs, `OpCosts`),
the runtime (measured per-(worker, op) durations, `replay`) and the adaptive planner
(`lower_bound`). All of them run the dependency graph once in topological order with a ready
queue, so the cost is O(#ops + #dependencies) even for grids of thousands of workers.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from resilient_jax.checks import is_number
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
  dependencies,
)
from resilient_jax.schedule.errors import ScheduleError

PerStage = float | tuple[float, ...]
"""One time for every stage, or a tuple with one time per stage."""

DurationFn = Callable[[Worker, Op], float]
"""`(worker, op) -> seconds`: how long `op` takes on `worker`."""

# How many stuck workers a deadlock message lists before it elides the rest: the message must stay
# one readable line even for a grid of thousands of workers.
_MAX_STUCK_LISTED = 8


def _check_per_stage(name: str, value: PerStage | None) -> PerStage | None:
  """Normalises `value` to a float or a tuple of floats and checks it is a valid duration."""
  if value is None:
    return None
  values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
  if not values:
    raise ValueError(f"OpCosts.{name}: a per-stage tuple needs at least one entry")
  for v in values:
    if not is_number(v):
      raise ValueError(f"OpCosts.{name}: {v!r} is not a finite non-negative time")
  if isinstance(value, (tuple, list)):
    return tuple(float(v) for v in values)
  return float(value)


def _at(name: str, value: PerStage, stage: int) -> float:
  if isinstance(value, tuple):
    if not 0 <= stage < len(value):
      raise ValueError(f"OpCosts.{name} has {len(value)} per-stage entries, stage {stage} asked")
    return value[stage]
  return value


@dataclasses.dataclass(frozen=True)
class OpCosts:
  """Analytic op times, in seconds (or any consistent unit).

  Every time is either one number for all stages or a tuple with one entry per stage.

  Attributes:
    f: forward time.
    b: input-gradient backward time (B).
    w: weight-gradient backward time (W).
    bw: fused backward time (BW); None means `b + w`.
    ar: gradient all-reduce time of a stage (the whole collective, start to end).
    opt: optimizer-step time.
    comm: latency of any transfer, i.e. of any dependency between two different workers.
    fr: redundant-forward time (FR) of each stage, i.e. of its successor's forward; None means
      the forward time of stage `(s + 1) % pp` (the stages form a ring).
    fixed: the share of a whole micro-batch's compute op that does not shrink with its samples
      (launch, weights read once, per-op set-up): a piece of a fraction `x` of the samples
      (`core.Piece`) takes `fixed + (1 - fixed) * x` of the whole op's time, so an op's time is
      `fixed_s + per_sample_s * samples`, the fit `benchmarks/piece_cost.py` measures. Tiny
      pieces are not free.
  """

  f: PerStage = 1.0
  b: PerStage = 1.0
  w: PerStage = 1.0
  bw: PerStage | None = None
  ar: PerStage = 0.0
  opt: PerStage = 0.0
  comm: float = 0.0
  fr: PerStage | None = None
  fixed: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = _check_per_stage(field.name, getattr(self, field.name))
      # Frozen: normalise lists to tuples and ints to floats in place.
      object.__setattr__(self, field.name, value)
    if isinstance(self.comm, tuple):
      raise ValueError("OpCosts.comm is one latency, not a per-stage tuple")
    if isinstance(self.fixed, tuple) or not self.fixed < 1:
      raise ValueError(f"OpCosts.fixed is one share in [0, 1), got {self.fixed!r}")

  def piece_scale(self, op: Op) -> float:
    """The share of the whole op's time `op` takes: 1, or for a piece `fixed + (1 - fixed) *
    its share of the samples`."""
    if isinstance(op, Piece):
      return self.fixed + (1.0 - self.fixed) * op.fraction
    return 1.0

  def check_stages(self, pp: int) -> None:
    """Raises ValueError unless every per-stage tuple has exactly `pp` entries."""
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, tuple) and len(value) != pp:
        raise ValueError(f"OpCosts.{field.name} has {len(value)} per-stage entries, pp={pp}")

  def f_at(self, stage: int) -> float:
    return _at("f", self.f, stage)

  def b_at(self, stage: int) -> float:
    return _at("b", self.b, stage)

  def w_at(self, stage: int) -> float:
    return _at("w", self.w, stage)

  def bw_at(self, stage: int) -> float:
    if self.bw is None:
      return self.b_at(stage) + self.w_at(stage)
    return _at("bw", self.bw, stage)

  def ar_at(self, stage: int) -> float:
    return _at("ar", self.ar, stage)

  def opt_at(self, stage: int) -> float:
    return _at("opt", self.opt, stage)

  def fr_at(self, stage: int) -> float:
    if self.fr is None:
      # The successor's forward; with per-stage times the tuple's length is pp, so the last
      # stage's successor wraps to stage 0.
      successor = (stage + 1) % len(self.f) if isinstance(self.f, tuple) else stage
      return self.f_at(successor)
    return _at("fr", self.fr, stage)

  def duration(self, worker: Worker, op: Op) -> float:
    """How long `op` takes on `worker`; usable wherever a `DurationFn` is expected."""
    stage = worker[1]
    kind = op.kind
    if isinstance(op, Piece):
      return self.piece_scale(op) * self.duration(worker, Op(kind, op.mb))
    if kind == F:
      return self.f_at(stage)
    if kind == B:
      return self.b_at(stage)
    if kind == W:
      return self.w_at(stage)
    if kind == BW:
      return self.bw_at(stage)
    if kind == AR:
      return self.ar_at(stage)
    if kind == OPT:
      return self.opt_at(stage)
    if kind == FR:
      return self.fr_at(stage)
    raise ValueError(f"unknown op kind {kind!r}")


@dataclasses.dataclass(frozen=True)
class Span:
  """One op's execution interval on a worker."""

  worker: Worker
  op: Op
  start: float
  end: float

  @property
  def duration(self) -> float:
    return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The result of replaying a schedule.

  Attributes:
    spans: every op, grouped by worker (workers in sorted order), each worker's in list order.
    makespan: end of the last op.
    busy: per worker, the summed duration of its ops (AR and OPT included).
  """

  spans: list[Span]
  makespan: float
  busy: dict[Worker, float]

  @property
  def bubble_fraction(self) -> float:
    """Idle share of the grid: 1 - total busy time / (#workers * makespan)."""
    if not self.busy or self.makespan <= 0:
      return 0.0
    return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)

  def worker_spans(self, worker: Worker) -> list[Span]:
    """The spans of one worker, in execution order."""
    return [s for s in self.spans if s.worker == worker]


def _as_duration_fn(
  schedule: Schedule, costs: OpCosts | DurationFn, comm: float | None
) -> tuple[DurationFn, float]:
  if isinstance(costs, OpCosts):
    costs.check_stages(schedule.pp)
    return costs.duration, costs.comm if comm is None else comm
  if not callable(costs):
    raise TypeError(f"costs must be OpCosts or a (worker, op) -> seconds callable, got {costs!r}")
  return costs, 0.0 if comm is None else comm


def _index_ops(
  schedule: Schedule,
) -> tuple[list[Worker], list[int], list[Op], dict[Worker, dict[Op, int]]]:
  """Numbers every op of `schedule`: workers sorted, each worker's ops in list order.

  Returns:
    `(node_worker, node_wid, node_op, index)`: per node its worker, that worker's rank and its
    op, and per worker the node of each of its ops.

  Raises:
    ScheduleError: when a worker runs an op twice.
  """
  workers = schedule.workers
  wid = {w: i for i, w in enumerate(workers)}
  node_worker: list[Worker] = []
  node_wid: list[int] = []
  node_op: list[Op] = []
  index: dict[Worker, dict[Op, int]] = {}
  for w in workers:
    idx = index[w] = {}
    for op in schedule.ops[w]:
      if op in idx:
        raise ScheduleError(f"worker {w} runs {op} twice")
      idx[op] = len(node_op)
      node_op.append(op)
      node_worker.append(w)
      node_wid.append(wid[w])
  return node_worker, node_wid, node_op, index


def _dependency_graph(
  schedule: Schedule,
  node_worker: list[Worker],
  node_wid: list[int],
  node_op: list[Op],
  index: dict[Worker, dict[Op, int]],
  sequential: bool,
) -> tuple[list[list[int]], list[int]]:
  """The edges between the nodes of `_index_ops`: data dependencies and, when `sequential`,
  each op after its predecessor in its worker's list.

  Returns:
    `(succ, indeg)`: per node the nodes that wait for it, and how many nodes it waits for.

  Raises:
    ScheduleError: on a dependency on a missing op or worker.
  """
  n = len(node_op)
  succ: list[list[int]] = [[] for _ in range(n)]
  indeg = [0] * n
  for i in range(n):
    w, op = node_worker[i], node_op[i]
    try:
      deps = list(dependencies(schedule, w, op))
    except KeyError as e:
      # backward_op / worker_of fail when the producer of a dependency does not exist.
      msg = f"{op} on worker {w} depends on a missing op or worker: {e.args[0]}"
      raise ScheduleError(msg) from None
    for dw, dop in deps:
      j = index.get(dw, {}).get(dop)
      if j is None:
        where = "missing" if dw in index else "not a live worker"
        raise ScheduleError(f"{op} on worker {w} depends on {dop} on worker {dw} ({where})")
      succ[j].append(i)
      indeg[i] += 1
    if sequential and i > 0 and node_wid[i - 1] == node_wid[i]:
      succ[i - 1].append(i)
      indeg[i] += 1
  return succ, indeg


def _allreduce_groups(
  schedule: Schedule, node_worker: list[Worker], node_op: list[Op]
) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
  """Which collective each AR node joins.

  AR is a collective over the stage's live workers: the k-th AR of every worker of a stage forms
  one instance that starts when its last participant is ready and ends together.

  Returns:
    `(group_of, group_size)`: per AR node its instance `(stage, k)`, and per stage how many
    workers every instance of it waits for.
  """
  group_of: dict[int, tuple[int, int]] = {}
  ar_seen: dict[Worker, int] = {}
  for i, op in enumerate(node_op):
    if op.kind == AR:
      w = node_worker[i]
      k = ar_seen.get(w, 0)
      ar_seen[w] = k + 1
      group_of[i] = (w[1], k)
  group_size = {s: len(schedule.stage_workers(s)) for s in range(schedule.pp)}
  return group_of, group_size


def _sweep(
  node_worker: list[Worker],
  node_wid: list[int],
  node_op: list[Op],
  succ: list[list[int]],
  indeg: list[int],
  group_of: dict[int, tuple[int, int]],
  group_size: dict[int, int],
  duration: DurationFn,
  comm: float,
) -> tuple[list[float], list[float], list[bool], int]:
  """Times the nodes in topological order with a ready queue (consumes `indeg`).

  Returns:
    `(start, end, done, finished)`: per node its times and whether it ran, and how many ran
    (fewer than all on a deadlock).
  """
  waiting: dict[tuple[int, int], list[int]] = {}
  n = len(node_op)
  ready = [0.0] * n
  start = [0.0] * n
  end = [0.0] * n
  done = [False] * n
  queue = deque(i for i in range(n) if indeg[i] == 0)
  finished = 0
  while queue:
    i = queue.popleft()
    if i in group_of:
      key = group_of[i]
      members = waiting.setdefault(key, [])
      members.append(i)
      if len(members) < group_size[key[0]]:
        continue
      t0 = max(ready[j] for j in members)
      dur = max(_checked(duration, node_worker[j], node_op[j]) for j in members)
      batch = members
      times = [(t0, t0 + dur)] * len(members)
    else:
      t0 = ready[i]
      batch = [i]
      times = [(t0, t0 + _checked(duration, node_worker[i], node_op[i]))]
    for j, (s0, e0) in zip(batch, times, strict=True):
      start[j], end[j] = s0, e0
      done[j] = True
      finished += 1
      src = node_wid[j]
      for k in succ[j]:
        t = e0 + comm if node_wid[k] != src else e0
        if t > ready[k]:
          ready[k] = t
        indeg[k] -= 1
        if indeg[k] == 0:
          queue.append(k)
  return start, end, done, finished


def _deadlock(
  schedule: Schedule,
  node_worker: list[Worker],
  node_wid: list[int],
  node_op: list[Op],
  done: list[bool],
) -> ScheduleError:
  """The error of a sweep that could not run every op: the stuck op at each blocked worker's
  head, at most `_MAX_STUCK_LISTED` of them."""
  n = len(node_op)
  stuck = []
  for i in range(n):
    if not done[i] and (i == 0 or node_wid[i - 1] != node_wid[i] or done[i - 1]):
      stuck.append(f"{node_worker[i]}:{node_op[i]}")
  listed = ", ".join(stuck[:_MAX_STUCK_LISTED])
  if len(stuck) > _MAX_STUCK_LISTED:
    listed += f", ... ({len(stuck) - _MAX_STUCK_LISTED} more)"
  return ScheduleError(
    f"schedule {schedule.name}: deadlock, {n - sum(done)} ops can never run; "
    f"stuck at each worker's head: {listed}"
  )


def _propagate(
  schedule: Schedule, duration: DurationFn, comm: float, sequential: bool
) -> tuple[list[Worker], list[Op], list[float], list[float]]:
  """Times every op of `schedule` by a topological sweep of its dependency graph.

  Args:
    schedule: the schedule to time.
    duration: per-(worker, op) duration.
    comm: added to every dependency between two different workers.
    sequential: whether a worker runs its list strictly in order (the real replay). Without it
      only data dependencies and collectives constrain start times: the critical path.

  Returns:
    `(node_worker, node_op, start, end)`, one entry per op, workers sorted, lists in order.

  Raises:
    ScheduleError: on duplicate ops, dependencies on missing ops or workers, or a deadlock.
  """
  node_worker, node_wid, node_op, index = _index_ops(schedule)
  succ, indeg = _dependency_graph(schedule, node_worker, node_wid, node_op, index, sequential)
  group_of, group_size = _allreduce_groups(schedule, node_worker, node_op)
  start, end, done, finished = _sweep(
    node_worker, node_wid, node_op, succ, indeg, group_of, group_size, duration, comm
  )
  if finished < len(node_op):
    raise _deadlock(schedule, node_worker, node_wid, node_op, done)
  return node_worker, node_op, start, end


def _checked(duration: DurationFn, worker: Worker, op: Op) -> float:
  d = duration(worker, op)
  if not d >= 0:  # also rejects NaN
    raise ScheduleError(f"duration of {op} on worker {worker} is {d!r}, not a non-negative time")
  return float(d)


def simulate(
  schedule: Schedule, costs: OpCosts | DurationFn, *, comm: float | None = None
) -> Timeline:
  """Replays `schedule`: every worker runs its list in order, as early as dependencies allow.

  An op starts at the latest of its worker's previous op end and the end of each dependency
  (plus `comm` when the dependency ran on another worker). An AR starts on all live workers of
  its stage at once, when the last of them is ready, and they all end together.

  Args:
    schedule: the schedule to replay.
    costs: analytic `OpCosts`, or a `(worker, op) -> seconds` callable (e.g. measured times).
    comm: transfer latency between different workers; defaults to `costs.comm` for `OpCosts`
      and to 0 for a callable.

  Returns:
    The `Timeline`.

  Raises:
    ScheduleError: when the schedule deadlocks (the message lists the stuck op at each blocked
      worker's head) or refers to ops that do not exist.
  """
  duration, comm = _as_duration_fn(schedule, costs, comm)
  node_worker, node_op, start, end = _propagate(schedule, duration, comm, sequential=True)
  spans = [Span(w, op, s, e) for w, op, s, e in zip(node_worker, node_op, start, end, strict=True)]
  busy = {w: 0.0 for w in schedule.workers}
  for span in spans:
    busy[span.worker] += span.end - span.start
  return Timeline(spans=spans, makespan=max(end, default=0.0), busy=busy)


def replay(
  schedule: Schedule, durations: Mapping[tuple[Worker, Op], float], *, comm: float = 0.0
) -> Timeline:
  """`simulate` with measured durations, one per `(worker, op)` of the schedule.

  Args:
    schedule: the schedule that was run.
    durations: seconds each op took on its worker.
    comm: transfer latency between different workers.

  Returns:
    The `Timeline` those durations imply.

  Raises:
    ScheduleError: when a duration is missing, or as `simulate`.
  """

  return simulate(schedule, measured(durations, "worker"), comm=comm)


def measured(durations: Mapping[tuple[Any, Op], float], where: str) -> DurationFn:
  """A duration function reading `durations` by `(worker or slot, op)`; a missing one raises
  `ScheduleError` naming it (`where`: "worker" or "slot")."""

  def duration(at: Any, op: Op) -> float:
    try:
      return durations[(at, op)]
    except KeyError:
      raise ScheduleError(f"no measured duration for {op} on {where} {at}") from None

  return duration


def lower_bound(
  schedule: Schedule, costs: OpCosts | DurationFn, *, comm: float | None = None
) -> float:
  """A makespan no ordering of the same ops can beat.

  The larger of the critical path through the dependencies alone (any number of ops of a worker
  may overlap) and the busiest worker's total work (ops of a worker may not overlap at all).

  Args:
    schedule: the schedule whose ops and routes to bound (the order within lists is ignored).
    costs: as for `simulate`.
    comm: as for `simulate`.

  Returns:
    The bound, in the unit of `costs`.
  """
  duration, comm = _as_duration_fn(schedule, costs, comm)
  _, _, _, end = _propagate(schedule, duration, comm, sequential=False)
  busiest = max(
    (sum(_checked(duration, w, op) for op in ops) for w, ops in schedule.ops.items()), default=0.0
  )
  return max(max(end, default=0.0), busiest)
