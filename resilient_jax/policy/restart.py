"""Checkpoint-restart: the policy every other one falls back to, and the layout a restore uses.

A failure loses the work since the last checkpoint and pays detection plus a restart
(rescheduling, start-up, restore). Training goes on with the same stage count (the depth that
makes a stage fit in memory) and as many pipelines as the survivors fill: `floor(live / p)`, or
fewer where the global batch must split into equal micro-batches (`Grid.global_batch`, the
runtime's case; the simulator deals `ceil(D*m / D'')` micro-batches to each pipeline instead).
With no pipeline of that depth left the simulator waits for a repair; the runtime, which has no
repair to wait for, goes on with fewer stages (`largest_layout`). A repair that lets the layout
grow is taken with a planned restart (checkpoint first: nothing lost).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from resilient_jax.exit_codes import EXIT_NO_DEVICES
from resilient_jax.policy.base import (
  Grid,
  InPlacePolicy,
  Layout,
  PlanCosts,
  Planned,
  Recovery,
  RecoveryParams,
  Transition,
)
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.plan import Plan


class NoDevicesLeft(RuntimeError):
  """No surviving node can hold even a one-stage pipeline."""

  exit_code = EXIT_NO_DEVICES


def largest_layout(
  num_devices: int, num_layers: int, global_batch: int, microbatches: int, min_pp: int = 1
) -> tuple[int, int]:
  """The dp x pp grid (pp >= `min_pp`) using the most of `num_devices` (then the most data
  parallelism, which has the smaller pipeline bubble) that the model and batch allow.

  Raises:
    NoDevicesLeft: no layout fits.
  """
  best = None
  for pp in range(min_pp, min(num_layers, num_devices) + 1):
    for dp in range(1, num_devices // pp + 1):
      if global_batch % (dp * microbatches) == 0:
        key = (dp * pp, dp)
        if best is None or key > best[0]:
          best = (key, (dp, pp))
  if best is None:
    raise NoDevicesLeft(f"no device is left to continue on ({num_devices} survivors)")
  return best[1]


def restore_layout(
  grid: Grid, num_live: int, num_layers: int | None = None, min_pp: int = 1
) -> tuple[int, int]:
  """The `(dp, pp)` grid a restore goes on with from `grid` with `num_live` nodes left: the same
  stage count with as many pipelines as they fill (and, with `grid.global_batch`, as split it
  into equal micro-batches); with none of that depth, `(0, pp)`, or when `num_layers` is given
  the `largest_layout` with fewer stages.

  Raises:
    NoDevicesLeft: no layout fits.
  """
  for dp in range(num_live // grid.pp, 0, -1):
    if grid.global_batch is None or grid.global_batch % (dp * grid.m) == 0:
      return dp, grid.pp
  if num_layers is None:
    return 0, grid.pp
  return largest_layout(num_live, num_layers, grid.global_batch or grid.m, grid.m, min_pp)


class RestartPolicy:
  """Checkpoint-restart onto the layout of the survivors (see the module docstring)."""

  name = "restart"
  description = "checkpoint-restart on the largest D'' x p grid of survivors"

  chooses = False
  reroutes = True
  reweights = False
  min_pp = 1
  fault_free: InPlacePolicy | None = None
  """The planner whose fault-free schedule it runs until a failure makes it restore
  (`registry.build_policies` sets it: recycle's)."""

  def __init__(self, params: RecoveryParams):
    self.params = params
    self._cache: dict[Hashable, float] = {}

  def plans_speeds(self, grid: Grid) -> bool:
    """A restart's layout runs at its slowest worker's pace."""
    del grid
    return False

  def reset(self, horizon_s: float) -> None:
    del horizon_s

  @property
  def current(self) -> RestartPolicy:
    return self

  def revert(self, policy: object) -> None:
    del policy

  def check(self, grid: Grid, costs: PlanCosts) -> None:
    del grid, costs  # any grid

  def pipelines(self, grid: Grid, failed: frozenset[Worker]) -> int:
    """Pipelines `D''` the survivors form after a restart (0: none of depth `p`)."""
    return restore_layout(grid, grid.workers - len(failed))[0]

  def plan(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> tuple[int, int]:
    """The `(dp, pp)` grid a restore goes on with; `(0, p)` when none of depth `p` is left."""
    del costs
    return restore_layout(grid, grid.workers - len(failed))

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
    dp = self.pipelines(grid, failed)
    key = (grid, dp, costs)
    if key not in self._cache:
      if dp == 0:
        self._cache[key] = math.inf
      else:
        # Pipelines of a fault-free grid are independent and identical, and every stage's
        # all-reduce is one collective: one pipeline with the all-reduce of D'' gives the makespan
        # of the whole grid. The busiest pipelines carry ceil(D*m / D'') micro-batches.
        m = -(-grid.dp * grid.m // dp)
        op = costs.op_costs((dp,) * grid.pp)
        self._cache[key] = simulate(generate(grid.base, 1, grid.pp, m), op).makespan
    return self._cache[key]

  def recovery(self, t: Transition) -> Recovery:
    if t.before == t.after:
      return Recovery(0.0)
    if t.failure:
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    if self.pipelines(t.grid, t.after) > self.pipelines(t.grid, t.before):
      return Recovery(self.params.restart_s, restart=True)
    return Recovery(0.0)

  # -- the runtime's side (`base.InPlacePolicy`): the fault-free schedule while it can

  def runs(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
           previous: Planned | None, *, switched: bool) -> Planned | None:
    return None if failed else self.fault_free.plan(grid, failed, costs)

  def planned_step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
                        planned: Planned) -> float:
    return self.fault_free.planned_step_time(grid, failed, costs, planned)

  def runtime_plan(self, planned: Planned, layout: Layout, costs: PlanCosts) -> Plan:
    return self.fault_free.runtime_plan(planned, layout, costs)

  def report(self, planned: Planned, plan: Plan, layout: Layout, workers: frozenset[Worker],
             failed: frozenset[Worker], *, rejoin: bool = False) -> list[str]:
    return self.fault_free.report(planned, plan, layout, workers, failed, rejoin=rejoin)

  def why_not(self, failed: frozenset[Worker], nodes: Sequence[int], step: int,
              configured: str) -> str:
    d, s = next(iter(sorted(failed)))
    chose = f" and {configured} chose restart" if configured != self.name else ""
    return (f"worker (dp={d}, stage={s}) failed at step {step} and "
            f"resilience.policy={configured}{chose}")

  def restore_on(self, grid: Grid, costs: PlanCosts, positions: Sequence[int]) -> Planned | None:
    return None
