"""Re-routing (ReCycle): a failed worker's micro-batches go to its stage's peers in the other
pipelines, and the step is replanned so the extra work fills bubbles; the global batch never
changes.

`recycle` plans with `adaptive.plan`'s bubble-filling planner, `naive` with the same re-routing
and no bubble filling. Small grids (at most `exact_ops` compute ops) are planned whole, cached by
failed set. Past that, planning every op of the grid is too slow for the recovery path (minutes
at 16k workers), and two cheaper forms stand in:

* the simulator's step times (`step_time`) plan the reduced grid of `schedule/reduce.py` (same
  per-survivor load), cached by failure pattern;
* the runtime's schedule (`plan`) plans the pipelines the failure touches and expands that plan
  to the grid (`schedule/expand.py`): the same lists as the full grid's plan, built per worker on
  use, cached by the failure's footprint (placement-free, like the pattern). What is validated
  is what changed, the footprint's sub-grid plan: recycle's by the list scheduler's own start
  times (`validate.Timing`, a certificate checked in a few lookups an op: ~0.13 s for the 75k
  ops four failures on 1024 x 16 x 32 touch, where a replay takes ~0.6 s), naive's by a replay
  when it has at most `VALIDATE_MAX_OPS` compute ops. The expansion itself is checked against
  whole plans in tests on grids small enough to plan whole; the full grid is never simulated.

When every worker of a stage has failed no re-routing can go on: the policy then runs as
checkpoint-restart until the stage has a live worker again.

Stragglers (`Grid.speeds`): the same planners re-weight each stage's micro-batches by its
workers' speeds (`routing.proportional_loads`), on grids planned whole (at most `exact_ops`
compute ops; a larger grid's footprint and reduction know no speeds, so there its plan stays
the one without them and the step runs at the slow worker's pace).
"""

from __future__ import annotations

from collections.abc import Hashable

from resilient_jax.policy.base import (
  Grid,
  InPlacePolicy,
  Layout,
  PlanCosts,
  RecoveryParams,
  stage_lost,
)
from resilient_jax.policy.restart import RestartPolicy
from resilient_jax.schedule import adaptive, expand
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.plan import GridPlan, Plan
from resilient_jax.schedule.reduce import failure_pattern, reduce_pattern
from resilient_jax.schedule.routing import FailureState, speed_scaled
from resilient_jax.schedule.validate import validate

DEFAULT_EXACT_OPS = 12_000
"""Grids with at most this many compute ops (3 * D * p * m) are planned whole, not reduced:
planning 12k ops takes well under a second."""
VALIDATE_MAX_OPS = 20_000
"""The runtime validates a plan of at most this many compute ops before it runs it; of a larger,
expanded one (built per worker on use), the failure's sub-grid plan (`_expanded`). Tests
validate the planners on small grids."""


class PlannerPolicy(InPlacePolicy):
  """A re-routing policy: one of `adaptive.plan`'s planners on the survivors.

  Args:
    name: the policy's name ("recycle", "naive").
    planner: the `adaptive.plan` policy ("adaptive", "naive").
    description: one line for reports.
    params: recovery times.
    restart: the policy used while a stage has no live worker.
    exact_ops: grids with at most this many compute ops are planned whole, not reduced.
    keep_sources: passed to `reduce_pattern` (the naive planner needs it).
  """


  def __init__(
    self,
    name: str,
    planner: str,
    description: str,
    params: RecoveryParams,
    restart: RestartPolicy,
    exact_ops: int = DEFAULT_EXACT_OPS,
    *,
    keep_sources: bool = False,
  ):
    super().__init__(params, restart)
    self.name = name
    self.planner = planner
    self.description = description
    self.exact_ops = exact_ops
    self.keep_sources = keep_sources
    self._cache: dict[Hashable, float] = {}
    self._plans: dict[Hashable, Schedule] = {}
    self._timed: dict[Hashable, float] = {}
    """The planner's own makespan of a plan in `_plans` (it times what it plans), by key."""
    self._footprints: dict[Hashable, tuple[Schedule | None, float]] = {}
    self.plans = 0

  def check(self, grid: Grid, costs: PlanCosts) -> None:
    del grid, costs  # any grid

  reweights = True

  def plans_speeds(self, grid: Grid) -> bool:
    return bool(grid.speeds) and grid.compute_ops <= self.exact_ops

  def planning_grid(
    self, grid: Grid, failed: frozenset[Worker], *, reduce: bool | None = None
  ) -> tuple[int, frozenset[Worker], Hashable]:
    """`(dp, failed, cache key)` of the grid actually planned for this failure state.

    Args:
      grid: the full grid.
      failed: its failed workers.
      reduce: True: always the reduced grid; False: always the full one; None: reduced once the
        full grid has more than `exact_ops` compute ops.
    """
    state = self._state(grid, failed, reduce)
    if state[0] == "exact":
      return grid.dp, failed, state
    dp, reduced = reduce_pattern(grid.dp, grid.pp, grid.m, state[1], keep_sources=self.keep_sources)
    return dp, reduced, state

  def _state(self, grid: Grid, failed: frozenset[Worker], reduce: bool | None) -> tuple:
    """What the step time depends on: the failed set on a small grid, else its pattern."""
    if reduce is None:
      reduce = grid.compute_ops > self.exact_ops
    if not reduce or self.plans_speeds(grid):
      return ("exact", failed)
    return ("pattern", failure_pattern(grid.dp, grid.pp, failed))

  def schedule(
    self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts, *, reduce: bool | None = None
  ) -> tuple[Schedule, OpCosts]:
    """The schedule this policy runs for `failed` (on the planning grid) and its op costs.

    The op costs carry the full grid's all-reduce (live workers per stage of `grid`).

    Raises:
      StageLostError: when a stage has no live worker.
    """
    op = costs.op_costs(grid.live_per_stage(failed))
    dp, planned_failed, state = self.planning_grid(grid, failed, reduce=reduce)
    key = (grid, state, costs)
    if key not in self._plans:
      self.plans += 1
      self._plans[key], makespan = adaptive.plan_timed(
        self.planner,
        FailureState(dp, grid.pp, grid.m, planned_failed,
                     grid.speeds if self.plans_speeds(grid) else (),
                     # Pieces on grids planned whole: a reduced grid has fewer peers to spread
                     # them over than the grid it stands for, so it keeps micro-batches whole.
                     grid.samples if state[0] == "exact" and self.planner == "adaptive" else 1),
        op,
        memory_cap=grid.memory_cap,
        base=grid.base,
      )
      if makespan is not None:
        self._timed[key] = makespan
    return self._plans[key], op

  def plan(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> Schedule | None:
    """The full grid's re-routed schedule; None when a stage has no live worker.

    Planned whole on a grid of at most `exact_ops` compute ops, else on the pipelines the
    failure touches and expanded (`schedule/expand.py`): the same lists, built per worker on use.
    """
    if stage_lost(grid, failed):
      return None
    if grid.compute_ops <= self.exact_ops:
      return self.schedule(grid.with_speeds(grid.speeds, failed), failed, costs, reduce=False)[0]
    return self._expanded(grid, failed, costs)[0]

  def plan_step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
    """The cost model's step time of the very schedule `plan` returns (no reduction); the
    restart policy's while a stage has no live worker.

    On a large grid this is the touched sub-grid's makespan, which is the full schedule's: the
    runtime predicts its step time without simulating 16k workers.
    """
    if stage_lost(grid, failed):
      return self.restart.step_time(grid, failed, costs)
    if grid.compute_ops <= self.exact_ops:
      return self.step_time(grid.with_speeds(grid.speeds, failed), failed, costs, reduce=False)
    return self._expanded(grid, failed, costs)[1]

  def _expanded(
    self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts
  ) -> tuple[Schedule, float]:
    """`plan`'s expanded schedule of a large grid and its makespan.

    The sub-grid's plan is cached by the footprint's key: a failure that touches the grid in the
    same way elsewhere (one worker of the same stage in another pipeline behind the takers) is
    only expanded again. Without failures: the base schedule, built per worker on use.
    """
    op = costs.op_costs(grid.live_per_stage(failed))
    fp = expand.footprint(grid.dp, grid.pp, grid.m, failed)
    if not failed:
      key = ("fault-free", grid.pp, grid.m, grid.base, op)
      if key not in self._footprints:
        fault_free = simulate(generate(grid.base, 1, grid.pp, grid.m), op).makespan
        self._footprints[key] = (None, fault_free)
      return expand.expand(None, fp, grid.base), self._footprints[key][1]
    key = (fp.key, grid.base, grid.memory_cap, op)
    if key not in self._footprints:
      self.plans += 1
      # Validated where it changed: the sub-grid is all that changed (every untouched pipeline
      # runs the spare's lists, planned and validated with it), and a closed grid of its own.
      # The adaptive plan by its planner's times (a few lookups an op); the naive one, which
      # has none, by a replay (~10 us an op), within the same bound as a whole plan.
      sub, makespan = adaptive.plan_on_route(
        self.planner, len(fp.pipelines), grid.pp, grid.m, fp.failed, fp.route, op,
        memory_cap=grid.memory_cap, base=grid.base,
        check=self.planner == "adaptive" or fp.compute_ops <= VALIDATE_MAX_OPS,
      )
      if makespan is None:  # the naive planner does not time its lists
        makespan = simulate(sub, op).makespan
      self._footprints[key] = (sub, makespan)
    sub, makespan = self._footprints[key]
    return expand.expand(sub, fp, grid.base), makespan

  def step_time(
    self,
    grid: Grid,
    failed: frozenset[Worker],
    costs: PlanCosts,
    *,
    reduce: bool | None = None,
  ) -> float:
    if stage_lost(grid, failed):
      return self.restart.step_time(grid, failed, costs)
    grid = grid.with_speeds(grid.speeds, failed)
    key = (grid, self._state(grid, failed, reduce), costs)
    if key not in self._cache:
      sched, op = self.schedule(grid, failed, costs, reduce=reduce)
      # The planner timed its plan as `simulate` would (same costs): not replayed again.
      timed = self._timed.get(key)
      speeds = grid.speeds if self.plans_speeds(grid) else ()
      self._cache[key] = timed if timed is not None else simulate(
        sched, speed_scaled(op, speeds), comm=op.comm).makespan
    return self._cache[key]

  def cannot_run(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> bool:
    del costs
    return stage_lost(grid, failed)

  # -- the runtime's side (`base.InPlacePolicy`)

  reroutes = True

  def planned_step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
                        planned: Schedule) -> float:
    return self.plan_step_time(grid, failed, costs)

  def runtime_plan(self, planned: Schedule, layout: Layout, costs: PlanCosts) -> GridPlan:
    if planned.pieces:
      # The coordinator's grid has `samples` 1, so this is a caller's mistake, not a failure.
      raise ValueError("the runtime's interpreter does not run pieces of micro-batches yet: "
                       "plan with Grid.samples=1")
    # Counting the plan's ops would build every worker's list of an expanded plan: a larger
    # grid's plan was validated where it changed, its footprint's sub-grid (`_expanded`).
    if layout.grid.compute_ops <= VALIDATE_MAX_OPS:
      validate(planned)
    return GridPlan(planned, layout.partition, layout.node_of)

  def report(self, planned: Schedule, plan: Plan, layout: Layout, workers: frozenset[Worker],
             failed: frozenset[Worker], *, rejoin: bool = False) -> list[str]:
    grid = layout.grid
    live = f"{grid.workers - len(failed)} live workers of {grid.pp} stages"
    if rejoin:
      return [f"  replanned with the {planned.name} planner on {live}"
              + ("" if failed else " (the fault-free schedule)")]
    lines = []
    for d, s in sorted(workers):
      takers: dict[int, list[int]] = {}
      for mb in range(d * grid.m, (d + 1) * grid.m):
        takers.setdefault(planned.route[mb][s], []).append(mb)
      moved = ", ".join(
        f"(dp={p}, stage={s}) takes micro-batches {mbs}" for p, mbs in sorted(takers.items()))
      lines.append(f"  re-routed: {moved}")
    return [*lines, f"  replanned with the {planned.name} planner on {live}"]
