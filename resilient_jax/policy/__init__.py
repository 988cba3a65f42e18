"""How a run survives failures: recycle, naive, oobleck, bamboo, restart and auto, once.

The runtime's coordinator (`RunCoordinator`) asks the policy in force what runs after each
failure and returns a `Decision`: a new plan on the survivors, or a restore of the latest
checkpoint onto one. Plans are data (`schedule/plan.py`); nothing here touches a device.
"""

from resilient_jax.policy.coordinator import (
  PIPELINE_SET_POLICIES,
  POLICIES,
  Decision,
  NoDevicesLeft,
  RunCoordinator,
  StageLost,
  largest_layout,
  restore_layout,
)
from resilient_jax.policy.costs import block_and_head_flops, layer_profile, stage_costs
from resilient_jax.policy.templates import AutoChoice, auto_choice

__all__ = [
  "PIPELINE_SET_POLICIES",
  "POLICIES",
  "AutoChoice",
  "Decision",
  "NoDevicesLeft",
  "RunCoordinator",
  "StageLost",
  "auto_choice",
  "block_and_head_flops",
  "largest_layout",
  "layer_profile",
  "restore_layout",
  "stage_costs",
]
