"""Step times of an instance on the library's cost model (`cost.simulate`)."""

from __future__ import annotations

from collections.abc import Sequence

from resilient_jax.schedule.core import Schedule
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.oobleck.instances import OobleckInstance, PipelineInstance
from resilient_jax.schedule.oobleck.profile import LayerProfile, LayerRange


def stage_costs(
  profile: LayerProfile,
  stages: Sequence[LayerRange],
  *,
  replicas: int = 1,
  allreduce_bandwidth: float | None = None,
  comm: float = 0.0,
) -> OpCosts:
  """Per-stage `OpCosts` of a pipeline cut as `stages`: the bridge to `cost.simulate`.

  The same function prices a homogeneous DP x PP grid for ReCycle (pass its stage split and
  `replicas=dp`), so every policy is costed by the same profile and the same replay.

  Args:
    profile: per-layer costs.
    stages: layer ranges, in pipeline order.
    replicas: data-parallel replicas of every layer (pipelines), for the all-reduce time.
    allreduce_bandwidth: bytes/s of each node's link in a ring all-reduce, which moves
      `2 * (r - 1) / r` of the gradient bytes; None makes the all-reduce free.
    comm: transfer latency between consecutive stages.

  Returns:
    Per-stage costs.
  """
  ov = profile.stage_overhead

  def per_stage(name: str, extra: float = 0.0) -> tuple[float, ...]:
    return tuple(profile.range_sum(name, lo, hi) + extra for lo, hi in stages)

  if allreduce_bandwidth is None or replicas <= 1:
    ar = (0.0,) * len(stages)
  else:
    factor = 2.0 * (replicas - 1) / replicas / allreduce_bandwidth
    ar = tuple(factor * g for g in per_stage("param_bytes"))
  return OpCosts(
    f=per_stage("forward", ov),
    b=per_stage("backward_input", ov),
    w=per_stage("backward_weight"),
    ar=ar,
    opt=per_stage("optimizer"),
    comm=comm,
  )


def pipeline_schedules(
  instance: OobleckInstance,
  *,
  base: str = "1f1b",
  comm: float = 0.0,
  allreduce_bandwidth: float | None = None,
) -> list[tuple[PipelineInstance, Schedule, OpCosts]]:
  """Every pipeline of `instance` as a `dp=1` schedule of its own stage count, with its costs.

  Micro-batch ids in these schedules are local (`0 .. m_i - 1`); the pipeline's global ids start
  at its `first_microbatch`.
  """
  return [
    (p, *_pipeline(instance, p, base, comm, allreduce_bandwidth)) for p in instance.pipelines
  ]


def _pipeline(
  instance: OobleckInstance,
  p: PipelineInstance,
  base: str,
  comm: float,
  allreduce_bandwidth: float | None,
) -> tuple[Schedule, OpCosts]:
  """Pipeline `p` of `instance` as a `dp=1` schedule, with its costs."""
  costs = stage_costs(
    instance.profile,
    p.template.stages,
    replicas=instance.num_pipelines,
    allreduce_bandwidth=allreduce_bandwidth,
    comm=comm,
  )
  return generate(base, 1, p.template.num_stages, p.microbatches), costs


def oobleck_step_time(
  instance: OobleckInstance,
  *,
  base: str = "1f1b",
  comm: float = 0.0,
  allreduce_bandwidth: float | None = None,
) -> float:
  """The step time of `instance` by the cost model: the slowest pipeline's simulated makespan.

  Every pipeline is replayed alone (`pipeline_schedules`), its all-reduce and optimizer step at
  the end of its list; the cross-pipeline all-reduce is folded in as each pipeline's AR time,
  i.e. the step ends when the slowest pipeline has reduced and stepped. Identical pipelines
  (same template and micro-batches) are simulated once.

  Args:
    instance: the pipelines.
    base: the per-pipeline schedule ("gpipe", "1f1b" or "zb-h1").
    comm: transfer latency between stages.
    allreduce_bandwidth: as for `stage_costs`.

  Returns:
    The step time, in the profile's time unit.
  """
  cache: dict[tuple, float] = {}
  worst = 0.0
  for p in instance.pipelines:
    key = (p.template.stages, p.microbatches)
    if key not in cache:
      cache[key] = simulate(*_pipeline(instance, p, base, comm, allreduce_bandwidth)).makespan
    worst = max(worst, cache[key])
  return worst
