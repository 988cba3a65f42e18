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

Failover: after a failure the pipelines are independent (Bamboo re-routes nothing across
pipelines) and a damaged one keeps its stages, the failed one's running on its predecessor's node
(`bamboo_set`: a `PipelineSet` with two slots on that node). That set is the one construction:
the runtime runs it, and `bamboo_step_time` prices it by replaying its step program
(`price.replay_program`, which lets the shared node run one op at a time), so what the simulator
prices is what the runtime runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from resilient_jax.schedule.core import BW, FR, B, F, Op, Schedule, Worker, make_schedule
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import check_shape, generate
from resilient_jax.schedule.pipelines import LayerRange, Pipeline, PipelineSet
from resilient_jax.schedule.plan import step_program
from resilient_jax.schedule.price import replay_program

__all__ = [
  "BambooUnrecoverableError",
  "bamboo_schedule",
  "bamboo_set",
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
  successor is lost. Laid out stage by stage, the data flows in its real order (stage 0 before
  stage 1, even when the last stage's node runs stage 0). `pipeline` only names the pipeline in
  errors.

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


def bamboo_set(
  dp: int,
  pp: int,
  m: int,
  failed: Iterable[Worker] = (),
  *,
  partition: Sequence[LayerRange] | None = None,
  costs: OpCosts | None = None,
  base: str = "1f1b",
) -> PipelineSet:
  """Bamboo on a DP x PP grid (node of worker (d, s) = `d * pp + s`) after `failed` died.

  Every pipeline keeps its own micro-batches and its stages. A failed stage runs on its
  predecessor's node (the last stage's for stage 0), which held its replica; stages whose node
  and whose successor's node are both alive keep running FR (placed by `redundant_ops` with
  `costs`, so the placement is part of the plan).

  Args:
    partition: the layers of every stage; None: stage s is layer s (a plan priced, not run:
      the runtime names its layers with `PipelineSet.with_partition`).

  Raises:
    BambooUnrecoverableError: two neighbouring stages of one pipeline failed.
    ValueError: a bad shape, or a failed worker outside the grid.
  """
  _check(dp, pp, m)
  dead = {tuple(w) for w in failed}
  for d, s in sorted(dead):
    if not (0 <= d < dp and 0 <= s < pp):
      raise ValueError(f"failed worker {(d, s)} is outside the {dp}x{pp} grid")
  stages = tuple(partition) if partition is not None else tuple((s, s + 1) for s in range(pp))
  lost_in: dict[int, frozenset[int]] = {}
  for d, s in dead:
    lost_in[d] = lost_in.get(d, frozenset()) | {s}
  # One schedule per distinct damage: a healthy grid of 1,024 pipelines places FR once.
  scheds: dict[frozenset[int], Schedule] = {}
  pipes = []
  for d in range(dp):
    lost = lost_in.get(d, frozenset())
    if lost not in scheds:
      ops = redundant_ops(pp, m, lost, costs=costs, base=base, pipeline=d)
      name = f"bamboo-{base}" + (f"-failover{sorted(lost)}" if lost else "")
      scheds[lost] = make_schedule(name, 1, pp, m, {(0, s): ops[s] for s in range(pp)})
    nodes = tuple(d * pp + ((s - 1) % pp if s in lost else s) for s in range(pp))
    pipes.append(Pipeline(stages, nodes, tuple(range(d * m, (d + 1) * m)), scheds[lost]))
  return PipelineSet("bamboo", tuple(pipes), stages[-1][1])


def bamboo_step_time(
  dp: int,
  pp: int,
  m: int,
  costs: OpCosts,
  failed: Iterable[Worker] = (),
  *,
  base: str = "1f1b",
) -> float:
  """Step time of Bamboo on a DP x PP grid, fault-free or after `failed` workers died: the
  replay of `bamboo_set`'s step program under `costs` (every slot priced as its stage).

  Raises:
    BambooUnrecoverableError: two neighbouring stages of one pipeline failed.
  """
  costs.check_stages(pp)
  plan = bamboo_set(dp, pp, m, failed, costs=costs, base=base)
  return replay_program(step_program(plan), costs.duration, comm=costs.comm).makespan
