"""Bamboo's redundant computation: every stage keeps its successor's state and runs its forward
in its bubbles, so a failed stage fails over to its predecessor's node at once.

Every pipeline keeps its own micro-batches. The step is the slowest pipeline, and a pipeline's
makespan depends only on which of its stages failed, so planning one pipeline per distinct set
of failed stages (plus one healthy pipeline) gives exactly the full grid's step time, at any
scale. Two failed neighbours in one pipeline cannot be recovered: the job restarts from a
checkpoint and, until the pipeline is whole again, runs as checkpoint-restart.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from resilient_jax.policy.base import (
  Grid,
  InPlacePolicy,
  Layout,
  PlanCosts,
  PolicyUnavailableError,
  RecoveryParams,
)
from resilient_jax.policy.restart import RestartPolicy
from resilient_jax.schedule.bamboo import bamboo_step_time
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.pipelines import PipelineSet, bamboo_set
from resilient_jax.schedule.plan import Plan


def _pipelines_lost(failed: frozenset[Worker]) -> dict[int, frozenset[int]]:
  lost: dict[int, set[int]] = {}
  for d, s in failed:
    lost.setdefault(d, set()).add(s)
  return {d: frozenset(s) for d, s in lost.items()}


class BambooPolicy(InPlacePolicy):
  """Bamboo (see the module docstring).

  Args:
    params: recovery times.
    restart: the policy used when adjacent failures make Bamboo unrecoverable.
  """

  name = "bamboo"
  description = "Bamboo: redundant forward of the successor stage, failover to predecessor"

  def __init__(self, params: RecoveryParams, restart: RestartPolicy):
    super().__init__(params, restart)
    self._cache: dict[Hashable, float] = {}
    self.plans = 0

  def check(self, grid: Grid, costs: PlanCosts) -> None:
    del costs
    if grid.pp < 2:
      raise PolicyUnavailableError("bamboo needs pp >= 2: a stage's replica lives on another")

  def _reduced(self, grid: Grid, failed: frozenset[Worker]) -> tuple[int, frozenset[Worker]]:
    """One pipeline per distinct set of failed stages, plus a healthy one if the grid has one."""
    lost = _pipelines_lost(failed)
    kinds = sorted(set(lost.values()), key=sorted)
    reduced = frozenset((i, s) for i, stages in enumerate(kinds) for s in stages)
    return len(kinds) + (1 if len(lost) < grid.dp else 0), reduced

  def unrecoverable(self, grid: Grid, failed: frozenset[Worker]) -> bool:
    """Whether some pipeline lost two neighbouring stages (a replica and its holder)."""
    return any(
      (s + 1) % grid.pp in stages for stages in _pipelines_lost(failed).values() for s in stages
    )

  def plan(
    self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts
  ) -> dict[Worker, Worker] | None:
    """Which worker runs each failed worker's stage (its predecessor in the same pipeline);
    None when Bamboo cannot recover."""
    self.check(grid, costs)
    if self.unrecoverable(grid, failed):
      return None
    return {(d, s): (d, (s - 1) % grid.pp) for d, s in sorted(failed)}

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
    if self.plan(grid, failed, costs) is None:
      return self.restart.step_time(grid, failed, costs)
    dp, reduced = self._reduced(grid, failed)
    live = grid.live_per_stage(failed)
    key = (grid, live, reduced, dp, costs)
    if key not in self._cache:
      self.plans += 1
      op = costs.op_costs(live)
      self._cache[key] = bamboo_step_time(dp, grid.pp, grid.m, op, reduced, base=grid.base)
    return self._cache[key]

  def cannot_run(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> bool:
    del costs
    return self.unrecoverable(grid, failed)

  # -- the runtime's side (`base.InPlacePolicy`)

  min_pp = 2  # a stage's replica lives on another stage's node

  def runtime_plan(self, planned: dict[Worker, Worker], layout: Layout,
                   costs: PlanCosts) -> PipelineSet:
    grid = layout.grid
    return bamboo_set(grid.dp, grid.pp, grid.m, layout.partition, frozenset(planned),
                      costs=costs.op, base=grid.base).on_nodes(layout.nodes)

  def report(self, planned: dict[Worker, Worker], plan: Plan, layout: Layout,
             workers: frozenset[Worker], failed: frozenset[Worker], *,
             rejoin: bool = False) -> list[str]:
    if rejoin:
      return [f"  bamboo: {len(failed)} failover(s) left; stages of the returned workers run "
              "on them again, with their successors' replicas"]
    pp = layout.grid.pp
    return [f"  failover: stage {s} of pipeline {d} now runs on node "
            f"{layout.nodes[d * pp + (s - 1) % pp]}, its predecessor, from the replica it kept"
            for d, s in sorted(workers)]

  def why_not(self, failed: frozenset[Worker], nodes: Sequence[int], step: int,
              configured: str) -> str:
    return (f"bamboo cannot continue after nodes {list(nodes)} failed at step {step}: a stage "
            "and the replica of it failed together")
