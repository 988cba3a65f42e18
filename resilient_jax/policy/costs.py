"""The analytic cost of the model, in one place: what every planner of the runtime prices plans by.

Units are one transformer block's forward FLOPs. B and W each cost about one forward (the
backward of a matmul is two matmuls of the same size, one for the input and one for the weight
gradient); the LM head is added to the last stage. Inputs are deterministic (no timings), so
every process of a job that agrees on the failed set derives the same plan without exchanging
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from resilient_jax.config import RunConfig
from resilient_jax.policy.base import RecoveryParams
from resilient_jax.schedule import oobleck
from resilient_jax.schedule.cost import OpCosts

LayerRange = tuple[int, int]


def block_and_head_flops(cfg: RunConfig) -> tuple[float, float]:
  """Forward multiply-adds of one block and of the head, per sequence (`model.costs()`)."""
  c = cfg.model.costs()
  return c.block_flops, c.head_flops


def stage_costs(cfg: RunConfig, partition: tuple[LayerRange, ...] | None = None) -> OpCosts:
  """Per-stage op costs of `partition` (default: the configured one), in block units."""
  block, head = block_and_head_flops(cfg)
  parts = partition or tuple((r.start, r.stop) for r in cfg.partition)
  f_costs = []
  for s, (lo, hi) in enumerate(parts):
    flops = (hi - lo) * block + (head if s == len(parts) - 1 else 0)
    f_costs.append(max(flops, 1) / block)
  per_stage = tuple(f_costs)
  return OpCosts(f=per_stage, b=per_stage, w=per_stage, ar=0.0, opt=0.0, comm=0.0)


def layer_profile(cfg: RunConfig) -> oobleck.LayerProfile:
  """Per-layer costs of this model for Oobleck's templates, in the units of `stage_costs`
  (the head is added to the last layer, the embeddings to the first cost nothing); bytes from
  the parameter counts, fp32 with AdamW's two moments and a gradient (16 bytes a parameter)."""
  m = cfg.model
  c = m.costs()
  block, head = c.block_flops, c.head_flops
  n = m.num_layers
  fwd = [1.0] * n
  fwd[-1] += head / block
  params = [float(c.block_params)] * n
  params[0] += c.embed_params
  params[-1] += c.head_params
  act = float(cfg.microbatch_size * m.seq_len * c.hidden * 4 * 8)
  return oobleck.LayerProfile(
    forward=fwd,
    backward_input=fwd,
    backward_weight=fwd,
    param_bytes=[4 * p for p in params],
    state_bytes=[16 * p for p in params],
    activation_bytes=[act] * n,
  )


def even_partition(num_layers: int, pp: int) -> tuple[LayerRange, ...]:
  """`num_layers` split into `pp` contiguous stages, the first ones one layer longer."""
  base, extra = divmod(num_layers, pp)
  out, lo = [], 0
  for s in range(pp):
    hi = lo + base + (1 if s < extra else 0)
    out.append((lo, hi))
    lo = hi
  return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class AnalyticCosts:
  """The runtime's `PlanCosts` for one layout, in block-forward units: per-stage op costs (the
  all-reduce and transfers are not priced, so they do not change with failures) and the
  per-layer profile Oobleck plans templates from, with no memory limit."""

  op: OpCosts
  profile: oobleck.LayerProfile
  comm: float = 0.0
  node_memory = None
  allreduce_bandwidth = None

  def op_costs(self, live: Sequence[int]) -> OpCosts:
    del live
    return self.op

  def layer_profile(self) -> oobleck.LayerProfile:
    return self.profile


def analytic_costs(cfg: RunConfig, partition: tuple[LayerRange, ...]) -> AnalyticCosts:
  """The analytic costs of `cfg`'s model cut by `partition` (a piece of a micro-batch priced
  with `resilience.piece_fixed_share`)."""
  op = dataclasses.replace(stage_costs(cfg, partition), fixed=cfg.resilience.piece_fixed_share)
  return AnalyticCosts(op, layer_profile(cfg))


def recovery_params(cfg: RunConfig, fault_free_step: float) -> RecoveryParams:
  """The run's recovery costs in the cost model's units, from the `resilience` keys counted in
  fault-free steps (`fault_free_step` units each). Detection is not charged: it is the same
  whatever the policy does next (a dead process is proven dead in about 0.1 s)."""
  res = cfg.resilience
  interval = cfg.checkpoint.every_steps or cfg.train.steps
  return RecoveryParams(
    detect_s=0.0,
    regroup_s=res.regroup_steps * fault_free_step,
    restart_s=res.restart_steps * fault_free_step,
    checkpoint_interval_s=interval * fault_free_step,
  )
