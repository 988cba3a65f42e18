"""Bamboo (Thorpe et al., NSDI'23) as a scheduling policy: redundant computation.

Every node of a pipeline also holds its successor stage's layers (the stages form a ring: the
last stage holds stage 0's) and, in every step, runs that successor's forward of each of its
micro-batches again (`FR` ops): a warm replica of the successor's activations. When worker
`(d, s)` fails, its predecessor `(d, s - 1)` (stage `pp - 1` for stage 0) already has the
layers and the forward outputs, and takes over stage s's work: pipeline d goes on with
`pp - 1` workers, one of them running two stages. The predecessor holds no replica of the
stage after s, so two failures next to each other on the ring lose a stage for good.

Redundancy is not free: FR runs in every fault-free step. It is placed into the pipeline's idle
gaps where it fits and otherwise right before the micro-batch's own backward (after which the
successor has finished that micro-batch and the copy is useless), so the extra compute shows in
the makespan wherever bubbles cannot hide it (always once m >= pp under 1F1B); each worker also
holds two stages' state and the FR outputs until that backward (`validate(...).peak_redundant`).

Failover and the data model: a `Schedule` identifies a worker with one stage (ops carry no
stage, AR groups and per-stage costs key on the worker's stage, and the runtime dispatches that
way), so a worker running two stages does not fit it. After a failure the pipelines are
independent (Bamboo re-routes nothing across pipelines), so `bamboo_failover` represents the
step as one `dp=1` schedule per pipeline: healthy pipelines as before, a damaged one as an
equivalent pipeline of its surviving workers in which a host's stage is the two stages merged
(their F, B, W, AR and OPT costs added), replayed by `cost.simulate`; the step is the slowest
pipeline. For a host of consecutive stages (s - 1, s) that runs them back to back, as one fused
stage, this is exact. When stage 0 fails, its host is the last stage, whose merged work the
equivalent places at the end of the pipeline: per-micro-batch work per worker, and so the steady
state, is the same; the fill and drain are approximated (stage 0's forward is modelled after,
not before, the other stages').
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable

from resilient_jax.schedule.core import BW, FR, B, F, Op, Schedule, Worker, make_schedule
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import check_shape, generate

__all__ = [
  "BambooFailover",
  "BambooPipeline",
  "BambooUnrecoverableError",
  "bamboo_failover",
  "bamboo_schedule",
  "bamboo_step_time",
  "redundant_ops",
]

# Relative slack when deciding whether an FR fits an idle gap: gaps come out of float sums.
_FIT_EPS = 1e-9


class BambooUnrecoverableError(ScheduleError):
  """Two neighbouring stages of one pipeline failed: the replica of one of them died with it.

  Attributes:
    pipeline: the pipeline.
    stages: its failed stages.
  """

  def __init__(self, pipeline: int, stages: list[int], pairs: list[tuple[int, int]]):
    listed = ", ".join(f"{a} and {b}" for a, b in pairs)
    super().__init__(
      f"pipeline {pipeline}: stages {listed} failed together; the only replica of a stage "
      "lives on its predecessor, so Bamboo cannot recover (restart from a checkpoint)"
    )
    self.pipeline = pipeline
    self.stages = stages


def _check(dp: int, pp: int, m: int) -> None:
  check_shape(dp, pp, m)
  if pp < 2:
    raise ValueError("Bamboo needs pp >= 2: a stage's replica lives on another stage's node")


def _with_redundancy(
  pipe: Schedule, costs: OpCosts, redundant: list[bool]
) -> dict[Worker, list[Op]]:
  """Inserts FR of every micro-batch into the lists of `pipe` (dp=1) for stages in `redundant`.

  One pass over each worker's base timeline: an FR whose input exists fills an idle gap before
  the next op when it fits (then nothing moves: no op depends on FR); an FR still unplaced when
  its micro-batch's own backward comes goes right before it (the last useful moment), delaying
  that worker. The input is the worker's own F output, except on the last stage, whose FR is
  stage 0's forward on the data: those are ready from the start and fill the last stage's long
  wait for its first forward.
  """
  timeline = simulate(pipe, costs)
  out: dict[Worker, list[Op]] = {}
  for w in pipe.workers:
    if not redundant[w[1]]:
      out[w] = list(pipe.ops[w])
      continue
    fr = costs.duration(w, Op(FR, 0))
    ops: list[Op] = []
    last = w[1] == pipe.pp - 1
    pending: deque[int] = deque(pipe.microbatches_of(w) if last else ())
    prev_end = 0.0
    for span in timeline.worker_spans(w):
      gap = span.start - prev_end
      while pending and fr <= gap + _FIT_EPS * max(1.0, span.start):
        ops.append(Op(FR, pending.popleft()))
        gap -= fr
      op = span.op
      if op.kind in (B, BW) and op.mb in pending:
        pending.remove(op.mb)
        ops.append(Op(FR, op.mb))
      ops.append(op)
      if op.kind == F and not last:
        pending.append(op.mb)
      prev_end = span.end
    assert not pending, "every micro-batch has a backward after its forward"
    out[w] = ops
  return out


def bamboo_schedule(
  dp: int, pp: int, m: int, base: str = "1f1b", costs: OpCosts | None = None
) -> Schedule:
  """A fault-free Bamboo step: the `base` schedule plus FR of every micro-batch on every worker.

  Args:
    dp: data-parallel pipelines.
    pp: pipeline stages (>= 2).
    m: micro-batches per pipeline.
    base: "gpipe", "1f1b" or "zb-h1".
    costs: the costs that decide which idle gaps an FR fits; default unit costs.

  Returns:
    The schedule (named `bamboo-<base>`); FR on worker (d, s) runs stage `(s + 1) % pp`'s
    forward of the micro-batch.
  """
  _check(dp, pp, m)
  costs = costs or OpCosts()
  costs.check_stages(pp)
  pipe = generate(base, 1, pp, m)
  local = _with_redundancy(pipe, costs, [True] * pp)
  per_worker = {
    (d, s): [Op(op.kind, op.mb + d * m) if op.mb >= 0 else op for op in local[(0, s)]]
    for d in range(dp)
    for s in range(pp)
  }
  return make_schedule(f"bamboo-{base}", dp, pp, m, per_worker)


def redundant_ops(
  pp: int,
  m: int,
  lost: Iterable[int] = (),
  *,
  costs: OpCosts | None = None,
  base: str = "1f1b",
  pipeline: int = 0,
) -> dict[int, list[Op]]:
  """Per stage of one pipeline, its op list (local micro-batch ids) as the runtime executes it.

  A lost stage keeps its own list (its predecessor's node runs it); a stage runs FR only if its
  node and its successor's node both still hold their own stage, i.e. neither it nor its
  successor is lost. This is the same redundancy as `bamboo_failover`'s merged equivalent, laid
  out stage by stage so the data can flow in its real order (stage 0 before stage 1, even when
  the last stage's node runs stage 0). `pipeline` only names the pipeline in errors.

  Raises:
    BambooUnrecoverableError: two neighbouring stages are lost.
  """
  _check(1, pp, m)
  costs = costs or OpCosts()
  costs.check_stages(pp)
  gone = set(lost)
  pairs = sorted((s, (s + 1) % pp) for s in gone if (s + 1) % pp in gone)
  if pairs:
    raise BambooUnrecoverableError(pipeline, sorted(gone), pairs)
  redundant = [s not in gone and (s + 1) % pp not in gone for s in range(pp)]
  ops = _with_redundancy(generate(base, 1, pp, m), costs, redundant)
  return {s: ops[(0, s)] for s in range(pp)}


@dataclasses.dataclass(frozen=True)
class BambooPipeline:
  """One pipeline of a Bamboo step after failures, as its own `dp=1` schedule.

  Attributes:
    index: the pipeline's dp index in the grid; its micro-batches are
      `index * m .. index * m + m - 1` (local ids `0 .. m - 1` in `schedule`).
    stages: per surviving worker, in pipeline order, the original stages it runs; a host runs
      two, its own first.
    redundant: per worker, whether it still runs FR (it holds its successor's replica; a host
      does not hold the replica of the stage after the one it took over).
    schedule: the equivalent pipeline (worker j runs `stages[j]` merged).
    costs: its per-stage costs (merged for hosts).
  """

  index: int
  stages: tuple[tuple[int, ...], ...]
  redundant: tuple[bool, ...]
  schedule: Schedule
  costs: OpCosts

  @property
  def makespan(self) -> float:
    return simulate(self.schedule, self.costs).makespan

  @property
  def held_stages(self) -> tuple[tuple[int, ...], ...]:
    """Per worker, the stages whose state it holds: its block, plus its successor's replica."""
    n = len(self.stages)
    return tuple(
      block + ((self.stages[(j + 1) % n][0],) if self.redundant[j] else ())
      for j, block in enumerate(self.stages)
    )


@dataclasses.dataclass(frozen=True)
class BambooFailover:
  """A Bamboo step with failed workers: every pipeline on its own (see the module docstring).

  Attributes:
    dp: pipelines in the grid.
    pp: stages per healthy pipeline.
    microbatches: micro-batches per pipeline (unchanged by failures).
    failed: the failed workers `(dp, stage)`.
    pipelines: one entry per pipeline (healthy ones included).
  """

  dp: int
  pp: int
  microbatches: int
  failed: frozenset[Worker]
  pipelines: tuple[BambooPipeline, ...]

  @property
  def step_time(self) -> float:
    """The slowest pipeline's simulated makespan (AR and OPT at the end of each)."""
    cache: dict[tuple, float] = {}
    worst = 0.0
    for p in self.pipelines:
      key = (p.stages, p.redundant)
      if key not in cache:
        cache[key] = p.makespan
      worst = max(worst, cache[key])
    return worst


def _hosts(pp: int, lost: set[int]) -> list[tuple[int, ...]]:
  """Per surviving stage, in order, the stages it runs: its own, then its successor if lost."""
  return [
    (s,) + (((s + 1) % pp,) if (s + 1) % pp in lost else ()) for s in range(pp) if s not in lost
  ]


def _merged_costs(costs: OpCosts, pp: int, blocks: list[tuple[int, ...]]) -> OpCosts:
  def add(at, block: tuple[int, ...]) -> float:
    return sum(at(s) for s in block)

  return OpCosts(
    f=tuple(add(costs.f_at, b) for b in blocks),
    b=tuple(add(costs.b_at, b) for b in blocks),
    w=tuple(add(costs.w_at, b) for b in blocks),
    bw=None if costs.bw is None else tuple(add(costs.bw_at, b) for b in blocks),
    ar=tuple(add(costs.ar_at, b) for b in blocks),
    opt=tuple(add(costs.opt_at, b) for b in blocks),
    comm=costs.comm,
    # A worker's FR is its original successor's forward, i.e. that of the stage after its own.
    fr=tuple(costs.fr_at(b[0]) for b in blocks),
  )


def bamboo_failover(
  dp: int,
  pp: int,
  m: int,
  failed: Iterable[Worker],
  *,
  costs: OpCosts | None = None,
  base: str = "1f1b",
) -> BambooFailover:
  """The Bamboo step after `failed` workers died: predecessors take over their stages.

  Args:
    dp: data-parallel pipelines.
    pp: pipeline stages (>= 2).
    m: micro-batches per pipeline.
    failed: failed workers `(dp, stage)`; in every pipeline no two may be neighbours on the
      ring of stages (s and s + 1, or pp - 1 and 0).
    costs: per-stage costs of the healthy grid (FR placement and the step time); default unit.
    base: "gpipe", "1f1b" or "zb-h1".

  Returns:
    The per-pipeline schedules and the step time.

  Raises:
    BambooUnrecoverableError: for neighbouring failures in one pipeline.
    ValueError: for a bad shape or a worker outside the grid.
  """
  _check(dp, pp, m)
  costs = costs or OpCosts()
  costs.check_stages(pp)
  dead = frozenset(tuple(w) for w in failed)
  for d, s in dead:
    if not (0 <= d < dp and 0 <= s < pp):
      raise ValueError(f"failed worker {(d, s)} is outside the {dp}x{pp} grid")
  cache: dict[frozenset[int], BambooPipeline] = {}
  pipelines = []
  for d in range(dp):
    lost = frozenset(s for dd, s in dead if dd == d)
    pairs = sorted((s, (s + 1) % pp) for s in lost if (s + 1) % pp in lost)
    if pairs:
      raise BambooUnrecoverableError(d, sorted(lost), pairs)
    if lost not in cache:
      blocks = _hosts(pp, set(lost))
      redundant = [len(b) == 1 for b in blocks]
      pipe_costs = _merged_costs(costs, pp, blocks)
      pipe = generate(base, 1, len(blocks), m)
      ops = _with_redundancy(pipe, pipe_costs, redundant)
      name = f"bamboo-{base}" + (f"-failover{sorted(lost)}" if lost else "")
      sched = make_schedule(name, 1, len(blocks), m, ops)
      cache[lost] = BambooPipeline(d, tuple(blocks), tuple(redundant), sched, pipe_costs)
    pipelines.append(dataclasses.replace(cache[lost], index=d))
  return BambooFailover(dp, pp, m, dead, tuple(pipelines))


def bamboo_step_time(
  dp: int,
  pp: int,
  m: int,
  costs: OpCosts,
  failed: Iterable[Worker] = (),
  *,
  base: str = "1f1b",
) -> float:
  """Step time of Bamboo on a DP x PP grid, fault-free or after `failed` workers died.

  Args:
    dp: data-parallel pipelines.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    costs: per-stage costs of the healthy grid.
    failed: failed workers.
    base: "gpipe", "1f1b" or "zb-h1".

  Returns:
    The step time; fault-free, the makespan of `bamboo_schedule` under `costs`.
  """
  dead = list(failed)
  if not dead:
    return simulate(bamboo_schedule(dp, pp, m, base, costs), costs).makespan
  return bamboo_failover(dp, pp, m, dead, costs=costs, base=base).step_time
