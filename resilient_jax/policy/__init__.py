"""How a run survives failures: recycle, naive, oobleck, bamboo, restart and auto, once, and
any policy a user registers (`register_policy`).

Each policy is one object (`registry.build_policies`) that answers, for a grid and a set of
failed workers, what it runs (`plan`), how fast (`step_time`) and what getting there costs
(`recovery`). The runtime's `RunCoordinator` and the simulator call the same objects; plans are
data (`schedule/`), and nothing here touches a device.
"""

from resilient_jax.policy.auto import AutoPolicy
from resilient_jax.policy.base import (
  Grid,
  InPlacePolicy,
  PlanCosts,
  Policy,
  PolicyUnavailableError,
  Recovery,
  RecoveryParams,
  RuntimePolicy,
  Transition,
  usable_policies,
)
from resilient_jax.policy.coordinator import (
  Decision,
  RunCoordinator,
  StageLost,
)
from resilient_jax.policy.costs import (
  AnalyticCosts,
  analytic_costs,
  block_and_head_flops,
  layer_profile,
  stage_costs,
)
from resilient_jax.policy.registry import (
  PolicyContext,
  build_policies,
  check_config,
  policy_names,
  register_policy,
)
from resilient_jax.policy.rejoin import RejoinChoice, rejoin_choice, steps_until_next_event
from resilient_jax.policy.restart import NoDevicesLeft, largest_layout, restore_layout

__all__ = [
  "AnalyticCosts",
  "AutoPolicy",
  "InPlacePolicy",
  "Decision",
  "Grid",
  "NoDevicesLeft",
  "PlanCosts",
  "PolicyContext",
  "Policy",
  "PolicyUnavailableError",
  "Recovery",
  "RecoveryParams",
  "RejoinChoice",
  "RunCoordinator",
  "RuntimePolicy",
  "StageLost",
  "Transition",
  "analytic_costs",
  "block_and_head_flops",
  "build_policies",
  "check_config",
  "largest_layout",
  "layer_profile",
  "policy_names",
  "register_policy",
  "rejoin_choice",
  "restore_layout",
  "stage_costs",
  "steps_until_next_event",
  "usable_policies",
]
