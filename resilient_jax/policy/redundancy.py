"""Bamboo's redundant computation: every stage keeps its successor's state and runs its forward
in its bubbles, so a failed stage fails over to its predecessor's node at once.

What it plans is what runs: `plan` is `schedule.bamboo.bamboo_set` on the grid's positions (the
runtime only names the layers and the nodes), and `step_time` is that plan's replay
(`schedule.price`). Every pipeline keeps its own micro-batches and meets the others only in the
all-reduce, and a pipeline's timing depends only on which of its stages failed, so the replay of
one pipeline per distinct set of failed stages (plus one healthy pipeline) is the full grid's
step time at any scale (a test checks it against the full plan's replay). Two failed neighbours
in one pipeline cannot be recovered: the job restarts from a checkpoint and, until the pipeline
is whole again, runs as checkpoint-restart.
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
from resilient_jax.schedule.bamboo import bamboo_set
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import Plan, step_program
from resilient_jax.schedule.price import replay_program


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

  def plan(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> PipelineSet | None:
    """Every pipeline of the grid, a failed stage on its predecessor's node (grid positions
    `d * pp + s`, stage s as layer s); None when Bamboo cannot recover."""
    self.check(grid, costs)
    if self.unrecoverable(grid, failed):
      return None
    op = costs.op_costs(grid.live_per_stage(failed))
    return bamboo_set(grid.dp, grid.pp, grid.m, failed, costs=op, base=grid.base)

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
    """The replay of `plan`, on one pipeline per distinct damage (the same step time)."""
    if self.unrecoverable(grid, failed):
      return self.restart.step_time(grid, failed, costs)
    dp, reduced = self._reduced(grid, failed)
    live = grid.live_per_stage(failed)
    key = (grid, live, reduced, dp, costs)
    if key not in self._cache:
      self.plans += 1
      op = costs.op_costs(live)
      plan = bamboo_set(dp, grid.pp, grid.m, reduced, costs=op, base=grid.base)
      self._cache[key] = replay_program(step_program(plan), op.duration, comm=op.comm).makespan
    return self._cache[key]

  def cannot_run(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> bool:
    del costs
    return self.unrecoverable(grid, failed)

  # -- the runtime's side (`base.InPlacePolicy`)

  min_pp = 2  # a stage's replica lives on another stage's node

  def runtime_plan(self, planned: PipelineSet, layout: Layout, costs: PlanCosts) -> PipelineSet:
    return planned.with_partition(layout.partition).on_nodes(layout.nodes)

  def report(self, planned: PipelineSet, plan: Plan, layout: Layout,
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
