"""Oobleck (Jang et al., SOSP'23) as a planning policy: pipeline templates and instantiation.

Oobleck trains with several data-parallel pipelines that need not have the same shape. Ahead of
time it plans one *pipeline template* per node count: the best split of the model's layers into
that many stages, one node per stage. It then *instantiates* a combination of templates that uses
every node and has at least `f + 1` pipelines, so that any `f` failures leave every layer with a
live replica, and deals the global batch out in proportion to each pipeline's speed. After
failures it *re-instantiates* from the same templates on the survivors and copies the layers that
land on a node which did not hold them.

Everything here is pure planning on a per-layer profile (no JAX): the runtime parts are
elsewhere. Step times use the library's own cost model: every pipeline is a `Schedule` with
`dp=1` and its own stage count (a heterogeneous set of pipelines does not fit one `Schedule`,
whose stages are uniform), costed by `cost.simulate`, so Oobleck and the ReCycle planners are
compared on the same model.

Template objective. For a pipeline of K stages with per-micro-batch stage times t_1..t_K (F+B+W),
1F1B takes about `(m - 1) * max_s t_s + sum_s t_s` for m micro-batches: the bottleneck stage
paces the steady state and every stage is crossed once while filling and draining. Stage times
are sums of layer times plus a fixed per-stage overhead, so `sum_s t_s` is the same for every
K-stage split and minimising the bottleneck minimises the whole expression for every m. The
planner therefore solves, exactly, min over splits of max_s t_s subject to each node's memory,
by dynamic programming over (first layer, stages left); `brute_force_partition` checks it.

Memory of a stage: the fixed per-node bytes, plus its layers' resident state (parameters,
gradients, optimizer state), plus one set of stashed activations per micro-batch it holds in
flight, which under 1F1B is `min(K - s, m)` for stage s: the number of stages left from it to the
end, a quantity the dynamic programme knows, so the constraint is exact.
"""

from __future__ import annotations

from resilient_jax.schedule.oobleck.costing import (
  oobleck_step_time,
  pipeline_schedules,
  stage_costs,
)
from resilient_jax.schedule.oobleck.instances import (
  OobleckInstance,
  PipelineInstance,
  fault_tolerance_gaps,
  instantiate,
)
from resilient_jax.schedule.oobleck.profile import (
  InstantiationError,
  LayerProfile,
  LayerRange,
  LayersLostError,
)
from resilient_jax.schedule.oobleck.recovery import (
  RecoveryCost,
  oobleck_recovery_cost,
  reinstantiate,
)
from resilient_jax.schedule.oobleck.templates import (
  PipelineTemplate,
  TemplateSet,
  brute_force_partition,
  distribute_microbatches,
  plan_templates,
  template_for,
)

__all__ = [
  "InstantiationError",
  "LayerProfile",
  "LayerRange",
  "LayersLostError",
  "OobleckInstance",
  "PipelineInstance",
  "PipelineTemplate",
  "RecoveryCost",
  "TemplateSet",
  "brute_force_partition",
  "distribute_microbatches",
  "fault_tolerance_gaps",
  "instantiate",
  "oobleck_recovery_cost",
  "oobleck_step_time",
  "pipeline_schedules",
  "plan_templates",
  "reinstantiate",
  "stage_costs",
  "template_for",
]
