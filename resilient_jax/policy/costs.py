"""The analytic cost of the model, in one place: what every planner of the runtime prices plans by.

Units are one transformer block's forward FLOPs. B and W each cost about one forward (the
backward of a matmul is two matmuls of the same size, one for the input and one for the weight
gradient); the LM head is added to the last stage. Inputs are deterministic (no timings), so
every process of a job that agrees on the failed set derives the same plan without exchanging
it.
"""

from __future__ import annotations

from resilient_jax.config import RunConfig
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
