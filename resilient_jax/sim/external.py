"""Adapters for the Oobleck and Bamboo planners (`resilient_jax/schedule/oobleck.py`,
`bamboo.py`), so that they answer the simulator's `Policy` questions.

Both planners price their schedules with the library's cost model (`cost.simulate`), as the
re-routing policies do; the adapters only translate the grid, the failed set and the costs.

* Bamboo: every pipeline keeps its own micro-batches; a failed worker's predecessor takes over
  its stage. The step is the slowest pipeline, and a pipeline's makespan depends only on which
  of its stages failed, so planning one pipeline per distinct set of failed stages (plus one
  healthy pipeline) gives exactly the full grid's step time, at any scale. Two failed
  neighbours in one pipeline cannot be recovered: the job restarts from a checkpoint.
* Oobleck: one Oobleck node per worker. Templates are planned from a per-layer profile derived
  from the spec cost model (each stage's times and bytes split evenly over its layers; node
  memory is the worker's), the fault-free job is `instantiate`d with `tolerate + 1` pipelines or
  more, and a failure state is `reinstantiate`d from it. Re-instantiation plans over every
  surviving node (a knapsack over node counts and an assignment over nodes), so it is run only
  up to `OobleckPolicy.max_workers` workers; beyond that the policy reports itself unavailable
  rather than guess. A measured per-stage profile has no per-layer memory, so Oobleck needs the
  spec cost model.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from resilient_jax.schedule.bamboo import BambooUnrecoverableError, bamboo_step_time
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.oobleck import (
  LayerProfile,
  OobleckInstance,
  TemplateSet,
  instantiate,
  oobleck_step_time,
  plan_templates,
  reinstantiate,
)
from resilient_jax.sim.cost_model import CostModel
from resilient_jax.sim.policy_base import (
  Grid,
  PolicyUnavailableError,
  Recovery,
  RecoveryParams,
  RestartPolicy,
  Transition,
)

__all__ = ["BambooPolicy", "OobleckPolicy", "oobleck_profile"]


def _pipelines_lost(grid: Grid, failed: frozenset[Worker]) -> dict[int, frozenset[int]]:
  lost: dict[int, set[int]] = {}
  for d, s in failed:
    lost.setdefault(d, set()).add(s)
  return {d: frozenset(s) for d, s in lost.items()}


class BambooPolicy:
  """Bamboo's redundant computation (see the module docstring).

  Args:
    params: recovery times.
    restart: the policy used when adjacent failures make Bamboo unrecoverable.
  """

  name = "bamboo"
  available = True
  description = "Bamboo: redundant forward of the successor stage, failover to predecessor"

  def __init__(self, params: RecoveryParams, restart: RestartPolicy):
    self.params = params
    self.restart = restart
    self._cache: dict[Hashable, float] = {}
    self.plans = 0

  def check(self, grid: Grid, costs: CostModel) -> None:
    del costs
    if grid.pp < 2:
      raise PolicyUnavailableError("bamboo needs pp >= 2: a stage's replica lives on another")

  def _reduced(self, grid: Grid, failed: frozenset[Worker]) -> tuple[int, frozenset[Worker]]:
    """One pipeline per distinct set of failed stages, plus a healthy one if the grid has one."""
    lost = _pipelines_lost(grid, failed)
    kinds = sorted(set(lost.values()), key=sorted)
    reduced = frozenset((i, s) for i, stages in enumerate(kinds) for s in stages)
    return len(kinds) + (1 if len(lost) < grid.dp else 0), reduced

  def _unrecoverable(self, grid: Grid, failed: frozenset[Worker]) -> bool:
    return any(
      (s + 1) % grid.pp in stages
      for stages in _pipelines_lost(grid, failed).values()
      for s in stages
    )

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    self.check(grid, costs)
    if self._unrecoverable(grid, failed):
      return self.restart.step_time(grid, failed, costs)
    dp, reduced = self._reduced(grid, failed)
    live = grid.live_per_stage(failed)
    key = (grid, live, reduced, dp, costs)
    if key not in self._cache:
      self.plans += 1
      try:
        op = costs.op_costs(live)
        self._cache[key] = bamboo_step_time(dp, grid.pp, grid.m, op, reduced, base=grid.base)
      except BambooUnrecoverableError:  # pragma: no cover - `_unrecoverable` catches it first
        self._cache[key] = self.restart.step_time(grid, failed, costs)
    return self._cache[key]

  def recovery(self, t: Transition) -> Recovery:
    if t.before == t.after:
      return Recovery(0.0)
    lost_before = self._unrecoverable(t.grid, t.before)
    lost_after = self._unrecoverable(t.grid, t.after)
    if lost_after and not lost_before:
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    if lost_before and not lost_after:
      return Recovery(self.params.restart_s, restart=True)
    if lost_before:
      return self.restart.recovery(t)
    if t.failure:
      lost = t.step_time_before / 2 if math.isfinite(t.step_time_before) else 0.0
      return Recovery(self.params.detect_s + self.params.regroup_s + lost)
    return Recovery(self.params.regroup_s)


def oobleck_profile(costs: CostModel) -> LayerProfile:
  """A per-layer Oobleck profile from a spec cost model: each stage split evenly over its layers.

  Times are a worker's (its `tp` devices together), bytes a worker's; a stage's transfer
  latency goes to `oobleck_step_time`'s `comm`, not to the profile.

  Raises:
    PolicyUnavailableError: for a cost model without per-layer memory (a measured profile).
  """
  mem = costs.memory
  if mem is None:
    raise PolicyUnavailableError(
      "oobleck re-partitions layers and needs per-layer memory, which only the spec cost model "
      "has (this one is a measured per-stage profile)"
    )
  per: dict[str, list[float]] = {k: [] for k in ("f", "b", "w", "g", "state", "act", "opt")}
  for s, n in enumerate(mem.layers):
    params = mem.params[s] / n
    for _ in range(n):
      per["f"].append(costs.f[s] / n)
      per["b"].append(costs.b[s] / n)
      per["w"].append(costs.w[s] / n)
      per["g"].append(costs.ar_bytes[s] * mem.tp / n)
      per["state"].append(params * mem.state_bytes_per_param)
      per["act"].append(mem.stash_bytes[s] / n)
      per["opt"].append(costs.opt[s] / n)
  return LayerProfile(
    forward=per["f"],
    backward_input=per["b"],
    backward_weight=per["w"],
    param_bytes=per["g"],
    state_bytes=per["state"],
    activation_bytes=per["act"],
    optimizer=per["opt"],
  )


class OobleckPolicy:
  """Oobleck's templates and re-instantiation (see the module docstring).

  Args:
    params: recovery times.
    restart: the policy used when a layer loses every replica.
    tolerate: failures the instance is built to survive (`f`; it runs `f + 1` pipelines or more).
    max_workers: largest grid (in workers) re-instantiation is run on.
  """

  name = "oobleck"
  available = True
  description = "Oobleck: heterogeneous pipeline templates, re-instantiated on the survivors"

  def __init__(
    self,
    params: RecoveryParams,
    restart: RestartPolicy,
    *,
    tolerate: int = 1,
    max_workers: int = 4096,
  ):
    self.params = params
    self.restart = restart
    self.tolerate = tolerate
    self.max_workers = max_workers
    self._setup: dict[Hashable, tuple[TemplateSet, OobleckInstance]] = {}
    self._instances: dict[Hashable, OobleckInstance | None] = {}
    self.plans = 0

  def check(self, grid: Grid, costs: CostModel) -> None:
    oobleck_profile(costs)
    if grid.workers > self.max_workers:
      raise PolicyUnavailableError(
        f"oobleck re-instantiates over every node (a knapsack over node counts and an "
        f"assignment over nodes); {grid.workers} workers exceed the simulator's limit of "
        f"{self.max_workers}"
      )

  def _start(self, grid: Grid, costs: CostModel) -> tuple[TemplateSet, OobleckInstance]:
    key = (grid, costs)
    if key not in self._setup:
      self.check(grid, costs)
      profile = oobleck_profile(costs)
      templates = plan_templates(
        profile, 1, profile.num_layers, costs.memory.worker_memory, microbatches=grid.m
      )
      inst = instantiate(templates, grid.workers, self.tolerate, grid.dp * grid.m)
      self._setup[key] = (templates, inst)
    return self._setup[key]

  def instance(
    self, grid: Grid, failed: frozenset[Worker], costs: CostModel
  ) -> OobleckInstance | None:
    """The instance Oobleck runs with `failed` down (re-instantiated from the fault-free one);
    None when some layer lost every replica or the survivors cannot be covered."""
    templates, inst0 = self._start(grid, costs)
    if not failed:
      return inst0
    nodes = {d * grid.pp + s for d, s in failed}
    # Nodes are interchangeable: the result depends on the damaged pipelines (their template
    # and how many of their nodes failed), not on which nodes.
    damaged = sorted(
      (p.template.num_nodes, len(nodes.intersection(p.nodes)))
      for p in inst0.pipelines
      if nodes.intersection(p.nodes)
    )
    key = (grid, costs, tuple(damaged))
    if key not in self._instances:
      self.plans += 1
      try:
        self._instances[key] = reinstantiate(inst0, nodes, templates)
      except ScheduleError:
        self._instances[key] = None
    return self._instances[key]

  def _allreduce_bandwidth(self, costs: CostModel) -> float:
    return costs.ar_bandwidth * costs.memory.tp

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    inst = self.instance(grid, failed, costs)
    if inst is None:
      return self.restart.step_time(grid, failed, costs)
    return oobleck_step_time(
      inst, base=grid.base, comm=costs.comm, allreduce_bandwidth=self._allreduce_bandwidth(costs)
    )

  def _copy_seconds(self, inst: OobleckInstance, costs: CostModel) -> float:
    # A re-instantiation generally moves every node's stage boundaries: the node that receives
    # most receives at most one stage's state, over its own link.
    worst = max(
      inst.profile.range_sum("state_bytes", lo, hi)
      for p in inst.pipelines
      for lo, hi in p.template.stages
    )
    return worst / self._allreduce_bandwidth(costs)

  def recovery(self, t: Transition) -> Recovery:
    if t.before == t.after:
      return Recovery(0.0)
    old, new = self.instance(t.grid, t.before, t.costs), self.instance(t.grid, t.after, t.costs)
    if new is None and old is not None:
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    if old is None and new is not None:
      return Recovery(self.params.restart_s, restart=True)
    if new is None:
      return self.restart.recovery(t)
    copy = self._copy_seconds(new, t.costs)
    if t.failure:
      lost = t.step_time_before / 2 if math.isfinite(t.step_time_before) else 0.0
      return Recovery(self.params.detect_s + self.params.regroup_s + copy + lost)
    return Recovery(self.params.regroup_s + copy)
