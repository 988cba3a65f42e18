"""Pipeline schedules as plain data: build, validate, cost and replay them (no JAX here).

The re-routing planners are `adaptive.plan` (not re-exported: `schedule.plan` is the module of
plans the runtime runs)."""

from resilient_jax.schedule.adaptive import POLICIES, plan_adaptive, plan_naive
from resilient_jax.schedule.core import (
  ALL_KINDS,
  AR,
  BW,
  COMPUTE_KINDS,
  OPT,
  B,
  F,
  Op,
  Schedule,
  W,
  Worker,
  dependencies,
  fault_free_route,
  make_schedule,
)
from resilient_jax.schedule.cost import (
  DurationFn,
  OpCosts,
  PerStage,
  Span,
  Timeline,
  lower_bound,
  replay,
  simulate,
)
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import GENERATORS, generate, gpipe, one_f_one_b, zb_h1
from resilient_jax.schedule.routing import (
  FailureState,
  StageLostError,
  default_memory_cap,
  relative_throughput_bound,
  reroute,
  route_lower_bound,
)
from resilient_jax.schedule.validate import (
  ValidationReport,
  peak_activations,
  peak_inflight,
  validate,
)

__all__ = [
  "ALL_KINDS",
  "AR",
  "B",
  "BW",
  "COMPUTE_KINDS",
  "DurationFn",
  "F",
  "FailureState",
  "GENERATORS",
  "OPT",
  "Op",
  "OpCosts",
  "POLICIES",
  "PerStage",
  "Schedule",
  "ScheduleError",
  "Span",
  "StageLostError",
  "Timeline",
  "ValidationReport",
  "W",
  "Worker",
  "default_memory_cap",
  "dependencies",
  "fault_free_route",
  "generate",
  "gpipe",
  "lower_bound",
  "make_schedule",
  "one_f_one_b",
  "peak_activations",
  "peak_inflight",
  "plan_adaptive",
  "plan_naive",
  "relative_throughput_bound",
  "replay",
  "reroute",
  "route_lower_bound",
  "simulate",
  "validate",
  "zb_h1",
]
