"""Oobleck's templates for this model, and `auto`'s choice between re-routing and re-templating.

Templates come from `costs.layer_profile`, in the same block-forward units as the grid's
`costs.stage_costs`, so the grid planners and the templates are priced by one model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from resilient_jax.config import RunConfig
from resilient_jax.policy.costs import layer_profile
from resilient_jax.schedule import oobleck
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.errors import ScheduleError


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
