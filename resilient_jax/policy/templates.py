"""Oobleck's pipeline templates: heterogeneous pipelines planned ahead for every node count,
instantiated on the survivors after each failure.

Templates are planned from a per-layer profile (`PlanCosts.layer_profile`: the simulator's spec
model splits each stage evenly over its layers; the runtime's analytic model prices each block
and the head), within a worker's memory where the costs know it. The smallest template is
`min_nodes` when set (`resilience.min_pipeline_nodes`), else the smallest pipeline that fits in
memory (1 node, when memory is known) or, with no memory model, the grid's stage count (the
depth the run was configured with is taken as what fits).

The fault-free job is instantiated on every worker with `tolerate + 1` pipelines or more. After a
failure the running instance is re-instantiated (`schedule.oobleck.reinstantiate`: local repair
or a global re-plan, survivors placed to keep the layers they hold); where the templates cannot
cover every survivor, a fresh instance takes as many as they can and the rest stay idle; where a
layer lost every replica the policy cannot go on (restore from a checkpoint). Re-instantiation
plans over every surviving node, so it runs only up to `max_workers` workers; beyond that the
policy reports itself unavailable rather than guess.
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
  Transition,
)
from resilient_jax.policy.restart import NoDevicesLeft, RestartPolicy
from resilient_jax.schedule import oobleck
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.pipelines import PipelineSet, oobleck_set
from resilient_jax.schedule.plan import Plan


class OobleckPolicy(InPlacePolicy):
  """Oobleck's templates and re-instantiation (see the module docstring).

  Args:
    params: recovery times.
    restart: the policy used when a layer loses every replica.
    tolerate: failures the instance is built to survive (`f`; it runs `f + 1` pipelines or more).
    min_nodes: the smallest template; 0: the rule of the module docstring.
    max_workers: largest grid (in workers) re-instantiation is run on.
  """

  name = "oobleck"
  description = "Oobleck: heterogeneous pipeline templates, re-instantiated on the survivors"

  def __init__(
    self,
    params: RecoveryParams,
    restart: RestartPolicy,
    *,
    tolerate: int = 1,
    min_nodes: int = 0,
    max_workers: int = 4096,
  ):
    super().__init__(params, restart)
    self.tolerate = tolerate
    self.min_nodes = min_nodes
    self.max_workers = max_workers
    self._templates: dict[Hashable, oobleck.TemplateSet] = {}
    self._instances: dict[Hashable, oobleck.OobleckInstance | None] = {}
    self._typical_instances: dict[Hashable, tuple] = {}
    self.plans = 0

  def check(self, grid: Grid, costs: PlanCosts) -> None:
    costs.layer_profile()
    if grid.workers > self.max_workers:
      raise PolicyUnavailableError(
        f"oobleck re-instantiates over every node (a knapsack over node counts and an "
        f"assignment over nodes); {grid.workers} workers exceed the limit of {self.max_workers}"
      )

  def templates(self, grid: Grid, costs: PlanCosts) -> oobleck.TemplateSet:
    """The template set for this grid's model and memory."""
    key = (grid, costs)
    if key not in self._templates:
      self.check(grid, costs)
      profile = costs.layer_profile()
      smallest = self.min_nodes or (1 if costs.node_memory is not None else grid.pp)
      lo = min(smallest, profile.num_layers, grid.workers)
      self._templates[key] = oobleck.plan_templates(
        profile, lo, max(lo, profile.num_layers), costs.node_memory, microbatches=grid.m,
        allreduce_bandwidth=costs.allreduce_bandwidth,
      )
    return self._templates[key]

  def instantiate_on(
    self, grid: Grid, costs: PlanCosts, nodes: Sequence[int]
  ) -> oobleck.OobleckInstance:
    """The fastest instance on as many of `nodes` as templates can cover (all when possible),
    with `tolerate + 1` pipelines, or fewer if the nodes do not allow that many.

    Raises:
      oobleck.InstantiationError: no template fits in `nodes`.
    """
    templates = self.templates(grid, costs)
    total = grid.dp * grid.m
    for n in range(len(nodes), 0, -1):
      for f in range(min(self.tolerate, total - 1), -1, -1):
        try:
          return oobleck.instantiate(templates, n, f, total, nodes=list(nodes[:n]))
        except oobleck.InstantiationError:
          continue
    raise oobleck.InstantiationError(
      f"no pipeline template (sizes {templates.sizes}) fits in {len(nodes)} nodes"
    )

  def next_instance(
    self,
    grid: Grid,
    costs: PlanCosts,
    current: oobleck.OobleckInstance,
    failed: frozenset[Worker],
  ) -> oobleck.OobleckInstance | None:
    """What Oobleck runs after `failed` (every failed worker of the grid) when `current` ran;
    None when a layer lost every replica. Nodes are positions `d * pp + s` of the grid."""
    dead = {d * grid.pp + s for d, s in failed}
    live = set(range(grid.workers)) - dead
    if not dead.intersection(current.nodes):
      return current
    templates = self.templates(grid, costs)
    self.plans += 1
    if set(current.nodes) - dead == live:
      try:
        return oobleck.reinstantiate(current, dead & set(current.nodes), templates,
                                     tolerate=self.tolerate)
      except oobleck.LayersLostError:
        return None
      except oobleck.InstantiationError:  # the templates cannot cover every survivor
        pass
    held = current.layers_of()
    covered = {layer for n in live if n in held for layer in range(*held[n])}
    if len(covered) < templates.profile.num_layers:
      return None
    try:
      return self.instantiate_on(grid, costs, sorted(live))
    except oobleck.InstantiationError:
      return None

  def plan(
    self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts
  ) -> oobleck.OobleckInstance | None:
    """The instance re-instantiated from the fault-free one with `failed` down (None: a layer
    lost every replica)."""
    key = (grid, costs, failed)
    if key not in self._instances:
      self._instances[key] = (
        self.next_instance(grid, costs, self.plan(grid, frozenset(), costs), failed) if failed
        else self.instantiate_on(grid, costs, range(grid.workers))
      )
    return self._instances[key]

  def instance_step_time(
    self, grid: Grid, costs: PlanCosts, inst: oobleck.OobleckInstance
  ) -> float:
    """The cost model's step time of `inst`."""
    return oobleck.oobleck_step_time(
      inst, base=grid.base, comm=costs.comm, allreduce_bandwidth=costs.allreduce_bandwidth
    )

  def _typical(
    self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts
  ) -> tuple[oobleck.OobleckInstance | None, float | None]:
    """`plan` and its step time for a failed set like `failed`, cached by pattern: nodes are
    interchangeable, so the step time and the copies depend on the damaged pipelines of the
    fault-free instance (their template and how many of their nodes failed), not on which."""
    inst0 = self.plan(grid, frozenset(), costs)
    nodes = {d * grid.pp + s for d, s in failed}
    key = (grid, costs, tuple(sorted(
      (p.template.num_nodes, len(nodes.intersection(p.nodes)))
      for p in inst0.pipelines
      if nodes.intersection(p.nodes)
    )))
    if key not in self._typical_instances:
      inst = self.plan(grid, failed, costs)
      time = None if inst is None else self.instance_step_time(grid, costs, inst)
      self._typical_instances[key] = (inst, time)
    return self._typical_instances[key]

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
    inst, time = self._typical(grid, failed, costs)
    if inst is None:
      return self.restart.step_time(grid, failed, costs)
    return time

  def cannot_run(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> bool:
    return self._typical(grid, failed, costs)[0] is None

  def copy_seconds(self, t: Transition) -> float:
    """A re-instantiation generally moves every node's stage boundaries: the node that
    receives most receives at most one stage's state, over its own link."""
    bandwidth = t.costs.allreduce_bandwidth
    inst = self._typical(t.grid, t.after, t.costs)[0]
    if bandwidth is None or inst is None:
      return 0.0
    worst = max(
      inst.profile.range_sum("state_bytes", lo, hi)
      for p in inst.pipelines
      for lo, hi in p.template.stages
    )
    return worst / bandwidth

  # -- the runtime's side (`base.InPlacePolicy`)

  def runs(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
           previous: oobleck.OobleckInstance | None, *, switched: bool
           ) -> oobleck.OobleckInstance | None:
    """Re-instantiates the running instance (`previous`), or, newly in force, the fault-free
    one with `failed` down."""
    if switched or previous is None:
      return self.plan(grid, failed, costs)
    return self.next_instance(grid, costs, previous, failed)

  def planned_step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
                        planned: oobleck.OobleckInstance) -> float:
    return self.instance_step_time(grid, costs, planned)

  def runtime_plan(self, planned: oobleck.OobleckInstance, layout: Layout,
                   costs: PlanCosts) -> PipelineSet:
    return oobleck_set(planned, layout.num_layers, layout.grid.base).on_nodes(layout.nodes)

  def report(self, planned: oobleck.OobleckInstance, plan: Plan, layout: Layout,
             workers: frozenset[Worker], failed: frozenset[Worker], *,
             rejoin: bool = False) -> list[str]:
    lines = []
    idle = sorted(layout.live - set(plan.nodes))
    if idle:
      lines.append(f"  nodes {idle} stay idle: the templates cannot cover all "
                   f"{len(layout.live)} survivors")
    return [*lines, "  re-instantiated: " + planned.describe().replace("\n", "\n  ")]

  def restore_on(self, grid: Grid, costs: PlanCosts, positions: Sequence[int]
                 ) -> oobleck.OobleckInstance:
    """Oobleck keeps its grid of positions: a fresh instance on the live ones."""
    try:
      return self.instantiate_on(grid, costs, sorted(positions))
    except oobleck.InstantiationError as e:
      raise NoDevicesLeft(f"no pipeline fits on the {len(positions)} survivors: {e}") from None
