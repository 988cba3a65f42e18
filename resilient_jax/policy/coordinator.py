"""The run's coordinator: which nodes are alive, and what the policy runs on them.

It holds no JAX state. Nodes are ints (devices in a single-process run, processes in a
multi-process job); the initial grid's worker `(d, s)` is `nodes[d * pp + s]`. On a failure
(one node, or a host's several at once) the policy in force decides, and `fail` returns the
`Decision`:

* `recycle` / `naive`: re-route the failed workers' micro-batches to their stage's peers and
  replan (`adaptive.plan`); the global batch never changes.
* `oobleck`: re-instantiate the pipeline templates on the survivors; the runtime then copies the
  layers a node lacks from surviving replicas.
* `bamboo`: a failed stage runs on its predecessor's node, from the replica it kept.
* `restart`: restore the latest checkpoint onto the largest grid the survivors form.
* `auto`: starts as `recycle`; at each failure it takes re-routing or re-templating (Oobleck
  from the grid as it stands), whichever the cost model predicts faster, and restores only when
  neither can go on; once it has re-templated it stays with Oobleck.

When a policy cannot go on (a stage lost every worker, a layer lost every replica, two
neighbouring Bamboo stages died) the decision is a restore onto a fresh plan on the survivors:
Oobleck's templates on all of them, else a grid of the same stage count with as many pipelines
as they fill (`restore_layout`, the simulator's rule too; fewer stages only when not one pipeline
of that depth is left). Planning inputs are deterministic
(grid shape, failed set, FLOP-based costs), so every process of a job derives the same plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

from resilient_jax.config import POLICIES, FaultsConfig, MeshConfig, RunConfig
from resilient_jax.policy.costs import even_partition, stage_costs
from resilient_jax.policy.phases import Phase, PhaseLog
from resilient_jax.policy.templates import (
  auto_choice,
  instantiate_on,
  plan_templates,
)
from resilient_jax.schedule import adaptive, bamboo, oobleck
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.pipelines import PipelineSet, bamboo_set, oobleck_set
from resilient_jax.schedule.plan import GridPlan, Plan
from resilient_jax.schedule.validate import validate

PIPELINE_SET_POLICIES = ("oobleck", "bamboo")
PLANNER = {"recycle": "adaptive", "naive": "naive", "restart": "adaptive"}
"""The `adaptive.plan` planner of each grid policy (every name in `config.POLICIES` is either
here, in `PIPELINE_SET_POLICIES` or `auto`)."""
assert set(POLICIES) == {*PLANNER, *PIPELINE_SET_POLICIES, "auto"}
VALIDATE_MAX_OPS = 20_000
"""Plans with more compute ops than this skip `validate` on the recovery path (tests and small
grids validate every plan)."""


class StageLost(RuntimeError):
  """Every worker of a stage is dead and `resilience.restore_on_stage_loss` is false."""

  def __init__(self, stage: int, step: int):
    super().__init__(
      f"every worker of stage {stage} has failed (step {step}); its weights have no live "
      "replica, so training cannot continue by re-routing"
    )
    self.stage = stage
    self.step = step


class NoDevicesLeft(RuntimeError):
  """No surviving node can hold even a one-stage pipeline."""


class _CannotGoOn(Exception):
  """The policy in force cannot continue on the survivors: restore from a checkpoint."""


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the runtime does next.

  Attributes:
    plan: the plan to run (every node in it is live).
    restore: load the latest checkpoint onto `plan` and redo the steps since.
    reason: one line for the log when `restore`.
  """

  plan: Plan
  restore: bool
  reason: str = ""


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
  num_live: int,
  pp: int,
  num_layers: int,
  global_batch: int,
  microbatches: int,
  min_pp: int = 1,
) -> tuple[int, int]:
  """The grid a restore goes on with: the same stage count (the depth that makes a stage fit
  in memory), with as many pipelines as the survivors fill and the global batch divides into
  evenly; fewer stages only when not one pipeline of that depth is left (`largest_layout`).

  The simulator's restart follows the same rule (`floor(live / pp)` pipelines; it may deal the
  micro-batches unevenly, the runtime needs equal micro-batches to keep the mathematics).

  Raises:
    NoDevicesLeft: no layout fits.
  """
  for dp in range(num_live // pp, 0, -1):
    if global_batch % (dp * microbatches) == 0:
      return dp, pp
  return largest_layout(num_live, num_layers, global_batch, microbatches, min_pp)


class RunCoordinator(PhaseLog):
  """Live nodes and the plan the policy runs on them.

  Args:
    cfg: the run configuration (grid, base schedule, micro-batches, policy).
    nodes: the nodes the run may use, in order.
    log: where decisions are reported.
  """

  def __init__(self, cfg: RunConfig, nodes: Sequence[int], log: Callable[[str], None] = print):
    self.cfg = cfg
    self.log = log
    self.live: set[int] = set(nodes)
    self.failed: list[tuple[int, int]] = []
    self.base = cfg.pipeline.schedule
    configured = cfg.resilience.policy
    self.policy = "recycle" if configured == "auto" else configured
    self._grid(cfg.mesh.dp, cfg.mesh.pp, list(nodes)[: cfg.mesh.num_workers])
    if self.policy in PIPELINE_SET_POLICIES:
      self._start_pipeline_set(sorted(self.live))
    self.fault_free_makespan = self.predicted_makespan()
    self.phases: list[Phase] = [Phase(self.plan_name, self.live_count, 1.0)]

  # ---------------------------------------------------------------- layouts

  def _grid(self, dp: int, pp: int, nodes: Sequence[int]) -> None:
    """Makes a DP x PP grid on `nodes` (worker (d, s) on `nodes[d * pp + s]`) the layout."""
    cfg = self.cfg
    counts = cfg.pipeline.partition if pp == cfg.mesh.pp else ()
    self.layout = dataclasses.replace(
      cfg,
      mesh=MeshConfig(dp=dp, pp=pp),
      pipeline=dataclasses.replace(cfg.pipeline, partition=counts),
      faults=FaultsConfig(),  # named in the initial grid; this layout is only for planning
    )
    self.partition = (
      tuple((r.start, r.stop) for r in self.layout.partition) if counts
      else even_partition(cfg.model.num_layers, pp)
    )
    self.grid_nodes = list(nodes)
    self.node_of: dict[Worker, int] = {
      (d, s): self.grid_nodes[d * pp + s] for d in range(dp) for s in range(pp)
    }
    self.dead_workers: set[Worker] = set()
    self.costs = stage_costs(self.layout, self.partition)
    self.schedule = None if self.policy in PIPELINE_SET_POLICIES else self._replan()

  def _start_pipeline_set(self, nodes: list[int]) -> None:
    if self.policy == "oobleck":
      self.templates = plan_templates(self.layout, len(nodes))
      self.instance = instantiate_on(self.layout, nodes, self.templates)
      self.pipeline_set = oobleck_set(self.instance, self.cfg.model.num_layers, self.base)
    else:
      self.pipeline_set = self._bamboo()

  def _bamboo(self) -> PipelineSet:
    """Bamboo on the grid with its dead workers, its node numbers mapped to ours."""
    dp, pp = self.layout.mesh.dp, self.layout.mesh.pp
    raw = bamboo_set(dp, pp, self.layout.pipeline.microbatches, self.partition,
                     self.dead_workers, costs=self.costs, base=self.base)
    pipes = tuple(
      dataclasses.replace(p, nodes=tuple(self.grid_nodes[n] for n in p.nodes))
      for p in raw.pipelines
    )
    return dataclasses.replace(raw, pipelines=pipes)

  def _replan(self) -> Schedule:
    lay = self.layout
    schedule = adaptive.plan(
      PLANNER[self.policy],
      lay.mesh.dp,
      lay.mesh.pp,
      lay.pipeline.microbatches,
      frozenset(self.dead_workers),
      self.costs,
      memory_cap=self.cfg.resilience.memory_cap or None,
      base=self.base,
    )
    if sum(len(ops) for ops in schedule.ops.values()) <= VALIDATE_MAX_OPS:
      validate(schedule)
    return schedule

  # ---------------------------------------------------------------- what runs now

  @property
  def plan(self) -> Plan:
    if self.policy in PIPELINE_SET_POLICIES:
      return self.pipeline_set
    return GridPlan(self.schedule, self.partition, dict(self.node_of))

  @property
  def plan_name(self) -> str:
    return self.policy if self.policy in PIPELINE_SET_POLICIES else self.schedule.name

  @property
  def live_count(self) -> int:
    if self.policy in PIPELINE_SET_POLICIES:
      return len(self.pipeline_set.nodes)
    return len(self.schedule.workers)

  def plan_text(self) -> str:
    return self.plan.to_text()

  def predicted_makespan(self) -> float:
    """The cost model's step time of the current plan, in block units."""
    if self.policy == "oobleck":
      return oobleck.oobleck_step_time(self.instance, base=self.base)
    if self.policy == "bamboo":
      lay = self.layout
      return bamboo.bamboo_step_time(lay.mesh.dp, lay.mesh.pp, lay.pipeline.microbatches,
                                     self.costs, sorted(self.dead_workers), base=self.base)
    return simulate(self.schedule, self.costs).makespan

  # ---------------------------------------------------------------- failures

  def fail(self, nodes: Collection[int], step: int, *, mid_step: bool = False) -> Decision:
    """Marks `nodes` dead and decides what runs next.

    Raises:
      StageLost: a stage lost every worker and `resilience.restore_on_stage_loss` is false.
      NoDevicesLeft: no plan fits on the survivors.
    """
    new = sorted(n for n in nodes if n in self.live)
    if not new:
      return Decision(self.plan, False)
    before = self.predicted_makespan()
    when = "during" if mid_step else "at the start of"
    for n in new:
      self.live.discard(n)
      self.failed.append((step, n))
    try:
      if self.policy in PIPELINE_SET_POLICIES:
        for n in new:
          self.log(f"FAILURE: node {n} failed {when} step {step}")
        self._fail_pipeline_set(new, step)
      else:
        self._fail_grid(new, step, when)
    except _CannotGoOn as e:
      return self._restore(str(e), step)
    after = self.predicted_makespan()
    self.log(f"  predicted step time x{after / before:.2f}")
    self._new_phase(self.plan_name, self.live_count, after / self.fault_free_makespan)
    return Decision(self.plan, False)

  def _fail_grid(self, new: list[int], step: int, when: str) -> None:
    workers = sorted(w for w, n in self.node_of.items() if n in new)
    for d, s in workers:
      self.log(f"FAILURE: worker (dp={d}, stage={s}) failed {when} step {step}")
    self.dead_workers |= set(workers)
    pp = self.layout.mesh.pp
    live_workers = set(self.node_of) - self.dead_workers
    for _, s in workers:
      if not any(w[1] == s for w in live_workers):
        lost = StageLost(s, step)
        if not self.cfg.resilience.restore_on_stage_loss:
          raise lost
        raise _CannotGoOn(str(lost))
    if self.policy == "restart":
      d, s = workers[0]
      raise _CannotGoOn(f"worker (dp={d}, stage={s}) failed at step {step} and "
                        "resilience.policy=restart")
    self.schedule = self._replan()
    m = self.layout.pipeline.microbatches
    for d, s in workers:
      takers: dict[int, list[int]] = {}
      for mb in range(d * m, (d + 1) * m):
        takers.setdefault(self.schedule.route[mb][s], []).append(mb)
      moved = ", ".join(
        f"(dp={p}, stage={s}) takes micro-batches {mbs}" for p, mbs in sorted(takers.items())
      )
      self.log(f"  re-routed: {moved}")
    self.log(f"  replanned with the {self.schedule.name} planner on {len(live_workers)} live "
             f"workers of {pp} stages")
    if self.cfg.resilience.policy == "auto":
      self._auto(simulate(self.schedule, self.costs).makespan)

  def _auto(self, recycle_makespan: float) -> None:
    """`auto`: keeps re-routing unless re-templating is predicted faster, then switches."""
    choice = auto_choice(self.layout, self.dead_workers, recycle_makespan)
    options = ", ".join(f"{k} {v:.1f}" for k, v in sorted(choice.predicted.items()))
    self.log(f"  auto: predicted step times (block units) {options}: {choice.policy}")
    if choice.policy != "oobleck":
      return
    self.policy = "oobleck"
    self.templates = plan_templates(self.layout, len(self.live))
    # The instance numbers nodes d * pp + s of the current grid: map them to ours.
    mapping = dict(enumerate(self.grid_nodes))
    self.instance = _renumber(choice.instance, mapping)
    self.pipeline_set = oobleck_set(self.instance, self.cfg.model.num_layers, self.base)
    self.log("  re-templated: " + self.instance.describe().replace("\n", "\n  "))

  def _fail_pipeline_set(self, new: list[int], step: int) -> None:
    try:
      if self.policy == "oobleck":
        for n in new:
          self.instance = self._reinstantiate(n)
        self.pipeline_set = oobleck_set(self.instance, self.cfg.model.num_layers, self.base)
        idle = sorted(self.live - set(self.instance.nodes))
        if idle:
          self.log(f"  nodes {idle} stay idle: templates of sizes {self.templates.sizes} "
                   f"cannot cover all {len(self.live)} survivors")
        self.log("  re-instantiated: " + self.instance.describe().replace("\n", "\n  "))
        return
      pp = self.layout.mesh.pp
      for n in new:
        if n in self.grid_nodes:
          self.dead_workers.add(divmod(self.grid_nodes.index(n), pp))
      self.pipeline_set = self._bamboo()
    except ScheduleError as e:
      raise _CannotGoOn(f"{self.policy} cannot continue after nodes {new} failed at step "
                        f"{step}: {e}") from None
    for n in new:
      if n not in self.grid_nodes:
        continue
      d, s = divmod(self.grid_nodes.index(n), pp)
      host = self.grid_nodes[d * pp + (s - 1) % pp]
      self.log(f"  failover: stage {s} of pipeline {d} now runs on node {host}, its "
               "predecessor, from the replica it kept")

  def _reinstantiate(self, node: int) -> oobleck.OobleckInstance:
    """Oobleck's re-instantiation after `node` died; on a subset of the survivors when the
    templates cannot cover them all (state still comes from every surviving replica)."""
    if node not in self.instance.nodes:
      return self.instance
    using_all = set(self.instance.nodes) - {node} == self.live
    if using_all:
      try:
        return oobleck.reinstantiate(
          self.instance, [node], self.templates, tolerate=self.cfg.resilience.tolerate
        )
      except oobleck.InstantiationError:  # the templates cannot cover every survivor
        pass
    held = self.instance.layers_of()
    covered = {layer for n in self.live if n in held for layer in range(*held[n])}
    lost = sorted(set(range(self.cfg.model.num_layers)) - covered)
    if lost:
      raise oobleck.LayersLostError(f"layers {lost} lost every replica: restart from a checkpoint")
    return instantiate_on(self.layout, sorted(self.live), self.templates)

  def _restore(self, reason: str, step: int) -> Decision:
    """A fresh plan on every survivor, to restore the latest checkpoint onto."""
    alive = sorted(self.live)
    configured = self.cfg.resilience.policy
    if self.policy == "oobleck" and configured == "oobleck":
      self._start_pipeline_set(alive)
    else:
      if configured == "auto":
        self.policy = "recycle"  # after a restore `auto` goes on re-routing
      dp, pp = restore_layout(
        len(alive),
        self.layout.mesh.pp,
        self.cfg.model.num_layers,
        self.cfg.train.global_batch,
        self.cfg.pipeline.microbatches,
        min_pp=2 if self.policy == "bamboo" else 1,
      )
      self._grid(dp, pp, alive[: dp * pp])
      if self.policy == "bamboo":
        self.pipeline_set = self._bamboo()
    ratio = self.predicted_makespan() / self.fault_free_makespan
    self._new_phase(self.plan_name, self.live_count, ratio)
    del step
    return Decision(self.plan, True, reason)


def _renumber(
  instance: oobleck.OobleckInstance, mapping: dict[int, int]
) -> oobleck.OobleckInstance:
  pipes = tuple(
    dataclasses.replace(p, nodes=tuple(mapping[n] for n in p.nodes)) for p in instance.pipelines
  )
  return dataclasses.replace(instance, pipelines=pipes)
