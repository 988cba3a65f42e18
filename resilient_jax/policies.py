"""The Oobleck, Bamboo and auto policies at run time: host-side planning, no JAX.

`resilience.policy` picks how a run survives failures; all of them run on the same stage
programs, data and executors, so they compare honestly:

* `recycle` / `naive` / `restart`: the DP x PP grid of `coordinator.Coordinator`.
* `oobleck`: pipeline templates (`schedule/oobleck.py`) planned from this model's per-layer
  profile (`layer_profile`), at least `resilience.tolerate + 1` pipelines on all the grid's
  devices, the global batch dealt in proportion to pipeline speed. A failure re-instantiates the
  templates on the survivors; the runtime then copies the layers a node lacks from surviving
  replicas. When some layer lost every replica (more failures than the instance tolerates), the
  run restores the latest checkpoint onto a fresh instance on the survivors.
* `bamboo`: the grid, every stage also holding its successor's state and running its forward
  redundantly (`FR`); a failed stage's predecessor takes over its work at once. Two failed
  neighbours in one pipeline are unrecoverable: restore from the checkpoint.
* `auto`: starts as `recycle`; at each failure it asks the cost model which plan is fastest on
  the survivors: re-routing (`recycle`) or re-templating (`oobleck`, built from the grid as it
  stands), and restores from the checkpoint only when neither can continue (a stage lost every
  worker). Once it has re-templated it stays with Oobleck (a heterogeneous set of pipelines is
  not a grid to re-route on).

Costs are in the units of `coordinator.stage_costs` (one transformer block's forward FLOPs), so
the grid planners and the templates are priced by the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from resilient_jax.config import RunConfig
from resilient_jax.coordinator import (
  NeedsRestore,
  Phase,
  PhaseLog,
  block_and_head_flops,
  stage_costs,
)
from resilient_jax.schedule import bamboo, oobleck
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.pipelines import PipelineSet, bamboo_set, oobleck_set

PIPELINE_SET_POLICIES = ("oobleck", "bamboo")


def layer_profile(cfg: RunConfig) -> oobleck.LayerProfile:
  """Per-layer costs of this model for Oobleck's templates.

  Times in block-forward units as `coordinator.stage_costs` (B and W each cost a forward; the
  head is added to the last layer, the embeddings to the first cost nothing); bytes from the
  parameter counts, fp32 with AdamW's two moments and a gradient (16 bytes per parameter).
  """
  m = cfg.model
  t, d, f = m.seq_len, m.d_model, m.mlp_ratio * m.d_model
  block, head = block_and_head_flops(cfg)
  n = m.num_layers
  fwd = [1.0] * n
  fwd[-1] += head / block
  block_params = 4 * d * d + 2 * d * f + 9 * d + f
  params = [float(block_params)] * n
  params[0] += (m.vocab_size + m.seq_len) * d
  params[-1] += 2 * d + (0 if m.tied_head else d * m.vocab_size + m.vocab_size)
  act = float(cfg.microbatch_size * t * d * 4 * 8)
  return oobleck.LayerProfile(
    forward=fwd,
    backward_input=fwd,
    backward_weight=fwd,
    param_bytes=[4 * p for p in params],
    state_bytes=[16 * p for p in params],
    activation_bytes=[act] * n,
  )


def _ranges(cfg: RunConfig) -> tuple[tuple[int, int], ...]:
  return tuple((r.start, r.stop) for r in cfg.partition)


def min_pipeline_nodes(cfg: RunConfig) -> int:
  """The smallest pipeline Oobleck may build: `resilience.min_pipeline_nodes`, else the grid's
  stage count (the depth the run was configured with is taken as what fits in memory)."""
  return cfg.resilience.min_pipeline_nodes or cfg.mesh.pp


def plan_templates(cfg: RunConfig, num_nodes: int) -> oobleck.TemplateSet:
  lo = min(min_pipeline_nodes(cfg), cfg.model.num_layers, num_nodes)
  return oobleck.plan_templates(layer_profile(cfg), lo, max(lo, num_nodes))


def grid_instance(cfg: RunConfig, templates: oobleck.TemplateSet) -> oobleck.OobleckInstance:
  """The DP x PP grid as an Oobleck instance (node `d * pp + s`), to re-instantiate from."""
  dp, pp, m = cfg.mesh.dp, cfg.mesh.pp, cfg.pipeline.microbatches
  template = oobleck.template_for(templates.profile, _ranges(cfg))
  pipes = tuple(
    oobleck.PipelineInstance(template, tuple(range(d * pp, (d + 1) * pp)), m, d * m)
    for d in range(dp)
  )
  return oobleck.OobleckInstance(pipes, dp - 1, dp * m, templates.profile)


def instantiate_on(
  cfg: RunConfig, nodes: list[int], templates: oobleck.TemplateSet
) -> oobleck.OobleckInstance:
  """The fastest instance on as many of `nodes` as templates can cover (all of them when
  possible; the rest stay idle), with `tolerate + 1` pipelines, or fewer if the nodes do not
  allow that many (then it tolerates fewer failures).

  Raises:
    oobleck.InstantiationError: no template fits in `nodes`.
  """
  total = cfg.mesh.dp * cfg.pipeline.microbatches
  for n in range(len(nodes), 0, -1):
    for f in range(min(cfg.resilience.tolerate, total - 1), -1, -1):
      try:
        return oobleck.instantiate(templates, n, f, total, nodes=nodes[:n])
      except oobleck.InstantiationError:
        continue
  raise oobleck.InstantiationError(
    f"no pipeline template (sizes {templates.sizes}) fits in {len(nodes)} nodes"
  )


class PipelineSetCoordinator(PhaseLog):
  """Live nodes and the `PipelineSet` that runs on them, for `oobleck` and `bamboo`.

  Args:
    cfg: the run configuration.
    nodes: the node ids to use (node of grid worker (d, s) is `d * pp + s`).
    log: where decisions go.
    policy: "oobleck" or "bamboo"; default `cfg.resilience.policy`.
    instance: for `oobleck`, the instance to start from (default: a fresh one on `nodes`).
    failed: `(step, node)` of the nodes already dead (when `auto` switches to Oobleck).
    continues: the coordinator whose run this one takes over (its step-time history goes on).
  """

  def __init__(
    self,
    cfg: RunConfig,
    nodes: Iterable[int],
    log: Callable[[str], None] = print,
    *,
    policy: str | None = None,
    instance: oobleck.OobleckInstance | None = None,
    failed: Iterable[tuple[int, int]] = (),
    continues: PhaseLog | None = None,
  ):
    self.cfg = cfg
    self.log = log
    self.policy = policy or cfg.resilience.policy
    self.live = set(nodes)
    self.failed: list[tuple[int, int]] = list(failed)
    self.base = cfg.pipeline.schedule
    self.costs = stage_costs(cfg)
    if self.policy == "oobleck":
      self.templates = plan_templates(cfg, len(self.live))
      self.instance = instance or instantiate_on(cfg, sorted(self.live), self.templates)
      self.plan = oobleck_set(self.instance, cfg.model.num_layers, self.base)
    elif self.policy == "bamboo":
      self.plan = self._bamboo(frozenset())
    else:
      raise ValueError(f"no pipeline-set policy {self.policy!r}")
    if continues is None:
      self.fault_free_makespan = self.predicted_makespan()
      self.phases: list[Phase] = [Phase(self.policy, len(self.plan.nodes), 1.0)]
    else:
      self.fault_free_makespan = continues.fault_free_makespan
      self.phases = continues.phases
      ratio = self.predicted_makespan() / self.fault_free_makespan
      self._new_phase(self.policy, len(self.plan.nodes), ratio)

  def _bamboo(self, dead: frozenset[int]) -> PipelineSet:
    dp, pp = self.cfg.mesh.dp, self.cfg.mesh.pp
    workers = [divmod(n, pp) for n in sorted(dead)]
    return bamboo_set(
      dp, pp, self.cfg.pipeline.microbatches, _ranges(self.cfg), workers,
      costs=self.costs, base=self.base,
    )

  def _reinstantiate(self, node: int) -> oobleck.OobleckInstance:
    """Oobleck's re-instantiation after `node` died; on a subset of the survivors when the
    templates cannot cover them all (state still comes from every surviving replica)."""
    using_all = set(self.instance.nodes) - {node} == self.live
    if node in self.instance.nodes and using_all:
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
    return instantiate_on(self.cfg, sorted(self.live), self.templates)

  @property
  def plan_name(self) -> str:
    return self.policy

  @property
  def live_count(self) -> int:
    return len(self.plan.nodes)

  def plan_text(self) -> str:
    return self.plan.to_text()

  def predicted_makespan(self) -> float:
    """The cost model's step time of the current plan, in block units."""
    if self.policy == "oobleck":
      return oobleck.oobleck_step_time(self.instance, base=self.base)
    dp, pp, m = self.cfg.mesh.dp, self.cfg.mesh.pp, self.cfg.pipeline.microbatches
    dead = [divmod(n, pp) for _, n in self.failed]
    return bamboo.bamboo_step_time(dp, pp, m, self.costs, dead, base=self.base)

  def fail(self, node: int, step: int, *, mid_step: bool = False) -> PipelineSet:
    """Marks `node` dead and replans.

    Raises:
      NeedsRestore: the policy cannot continue on the survivors (some layer lost every replica,
        or Bamboo lost two neighbouring stages of one pipeline).
    """
    if node not in self.live:
      return self.plan
    before = self.predicted_makespan()
    self.live.discard(node)
    self.failed.append((step, node))
    when = "during" if mid_step else "at the start of"
    self.log(f"FAILURE: node {node} failed {when} step {step}")
    try:
      if self.policy == "oobleck":
        self.instance = self._reinstantiate(node)
        self.plan = oobleck_set(self.instance, self.cfg.model.num_layers, self.base)
        idle = sorted(self.live - set(self.instance.nodes))
        if idle:
          self.log(f"  nodes {idle} stay idle: templates of sizes {self.templates.sizes} "
                   f"cannot cover all {len(self.live)} survivors")
      else:
        self.plan = self._bamboo(frozenset(n for _, n in self.failed))
    except ScheduleError as e:
      raise NeedsRestore(f"{self.policy} cannot continue after node {node} failed at step "
                         f"{step}: {e}") from None
    after = self.predicted_makespan()
    if self.policy == "oobleck":
      self.log("  re-instantiated: " + self.instance.describe().replace("\n", "\n  "))
    else:
      d, s = divmod(node, self.cfg.mesh.pp)
      host = d * self.cfg.mesh.pp + (s - 1) % self.cfg.mesh.pp
      self.log(f"  failover: stage {s} of pipeline {d} now runs on node {host}, its "
               "predecessor, from the replica it kept")
    self.log(f"  predicted step time x{after / before:.2f}")
    self._new_phase(self.policy, len(self.plan.nodes), after / self.fault_free_makespan)
    return self.plan


@dataclasses.dataclass(frozen=True)
class AutoChoice:
  """What `auto` does about a failure state, and the predicted step times it compared."""

  policy: str
  """"recycle", "oobleck" or "restart"."""
  predicted: dict[str, float]
  instance: oobleck.OobleckInstance | None = None


def auto_choice(
  cfg: RunConfig, failed: Iterable[Worker], recycle_makespan: float | None
) -> AutoChoice:
  """The fastest way on for the grid with `failed` workers, by the cost model.

  Args:
    cfg: the run configuration (its grid).
    failed: every failed worker of the grid so far.
    recycle_makespan: the re-routing planner's predicted step time; None if it cannot go on.

  Returns:
    `recycle` if it is at least as fast as re-templating (it moves no state), else `oobleck`
    with the instance; `restart` if neither can go on.
  """
  pp = cfg.mesh.pp
  predicted: dict[str, float] = {}
  if recycle_makespan is not None:
    predicted["recycle"] = recycle_makespan
  nodes = cfg.mesh.dp * pp
  templates = plan_templates(cfg, nodes)
  instance = None
  try:
    instance = oobleck.reinstantiate(
      grid_instance(cfg, templates),
      [d * pp + s for d, s in failed],
      templates,
      tolerate=cfg.resilience.tolerate,
    )
    predicted["oobleck"] = oobleck.oobleck_step_time(instance, base=cfg.pipeline.schedule)
  except ScheduleError:
    pass
  if not predicted:
    return AutoChoice("restart", predicted)
  best = min(predicted, key=lambda k: (predicted[k], k != "recycle"))
  return AutoChoice(best, predicted, instance if best == "oobleck" else None)
