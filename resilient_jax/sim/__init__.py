"""Cluster-scale simulation of resilient DP x PP training (no JAX here).

The simulator runs the library's own schedules, planners and cost model over a discrete-event
model of a cluster: failures and rejoins from a trace change the failed set, each policy's
planner gives the step time of that failure state, and recoveries cost pauses and rollbacks.
At thousands of devices the planners run on a reduced grid with the same per-survivor load
(`reduce.py`), cached by failure pattern.

Entry points: `run_simulation` (what `python -m launch.simulate` runs), `sweep`, `run_trace`
(each policy's throughput and goodput, `goodput.py`, through a trace from `poisson_trace`,
`mix_trace` over a published mix of `mixes.py`, or a CSV file), and
`predict_relative_throughput` (a measured per-stage profile and a failed set in, the predicted
relative throughput out).
"""

from resilient_jax.policy import (
  Grid,
  Policy,
  PolicyUnavailableError,
  Recovery,
  RecoveryParams,
  build_policies,
  policy_names,
  usable_policies,
)
from resilient_jax.schedule.reduce import FailurePattern, failure_pattern, max_load, reduce_pattern
from resilient_jax.sim.config import SimConfig, SimConfigError, from_config_dict
from resilient_jax.sim.cost_model import (
  CostModel,
  load_profile,
  p2p_seconds,
  ring_allreduce_seconds,
  save_profile,
)
from resilient_jax.sim.engine import (
  PolicyTrace,
  Row,
  TraceResult,
  bound_for,
  failure_states,
  predict_relative_throughput,
  run_trace,
  sweep,
  sweep_failed_set,
)
from resilient_jax.sim.goodput import LOSSES, Breakdown, Recoveries, young_daly_interval
from resilient_jax.sim.layout import PLACEMENTS, Layout
from resilient_jax.sim.mixes import MIXES
from resilient_jax.sim.run import build_costs, build_trace, format_table, run_simulation
from resilient_jax.sim.specs import DeviceSpec, ModelSpec, NetworkSpec
from resilient_jax.sim.traces import (
  Cause,
  Event,
  FailureTracker,
  Stragglers,
  Trace,
  TraceError,
  mix_trace,
  poisson_trace,
  read_csv_trace,
  write_csv_trace,
)

__all__ = [
  "LOSSES",
  "MIXES",
  "PLACEMENTS",
  "policy_names",
  "Breakdown",
  "Cause",
  "CostModel",
  "DeviceSpec",
  "Event",
  "FailurePattern",
  "FailureTracker",
  "Grid",
  "Layout",
  "ModelSpec",
  "NetworkSpec",
  "Policy",
  "PolicyTrace",
  "PolicyUnavailableError",
  "Recoveries",
  "Recovery",
  "RecoveryParams",
  "Row",
  "SimConfig",
  "SimConfigError",
  "Stragglers",
  "Trace",
  "TraceError",
  "TraceResult",
  "bound_for",
  "build_costs",
  "build_policies",
  "build_trace",
  "failure_pattern",
  "failure_states",
  "format_table",
  "from_config_dict",
  "load_profile",
  "max_load",
  "mix_trace",
  "p2p_seconds",
  "poisson_trace",
  "predict_relative_throughput",
  "read_csv_trace",
  "reduce_pattern",
  "ring_allreduce_seconds",
  "run_simulation",
  "run_trace",
  "save_profile",
  "sweep",
  "sweep_failed_set",
  "usable_policies",
  "write_csv_trace",
  "young_daly_interval",
]
