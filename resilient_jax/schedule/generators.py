"""Fault-free schedule generators: GPipe, 1F1B and ZB-H1.

Every pipeline `d` runs the same pattern on its own micro-batches `d*m .. d*m + m - 1`, and every
worker's list ends with its stage's gradient all-reduce and optimizer step. Every generator takes
`dp` (data-parallel pipelines), `pp` (pipeline stages) and `m` (micro-batches per pipeline) and
returns the fault-free `Schedule`.
"""

from __future__ import annotations

from collections.abc import Callable

from resilient_jax.checks import require_ints
from resilient_jax.schedule.core import (
  AR,
  BW,
  OPT,
  B,
  F,
  Op,
  Schedule,
  W,
  Worker,
  fault_free_route,
  make_schedule,
)

# A per-stage pattern: (pp, stage, m) -> ops on local micro-batch ids 0..m-1.
_Pattern = Callable[[int, int, int], list[Op]]


def check_shape(dp: int, pp: int, m: int) -> None:
  """Raises ValueError unless `dp`, `pp` and `m` are positive integers."""
  require_ints("", {"dp": dp, "pp": pp, "m": m})


def _build(name: str, dp: int, pp: int, m: int, pattern: _Pattern) -> Schedule:
  check_shape(dp, pp, m)
  per_worker: dict[Worker, list[Op]] = {}
  for s in range(pp):
    local = pattern(pp, s, m)
    for d in range(dp):
      # The same pattern, shifted onto pipeline d's share of the global batch.
      ops = [Op(op.kind, op.mb + d * m) for op in local]
      per_worker[(d, s)] = ops + [Op(AR), Op(OPT)]
  return make_schedule(name, dp, pp, m, per_worker, route=fault_free_route(dp, pp, m))


def _gpipe_pattern(pp: int, s: int, m: int) -> list[Op]:
  del pp, s  # every stage runs the same list
  return [Op(F, i) for i in range(m)] + [Op(BW, i) for i in range(m)]


def _warmup(pp: int, s: int, m: int) -> int:
  # Stage s must have forwarded pp - s - 1 micro-batches before the first backward can come back
  # from the last stage; fewer when the step has fewer micro-batches.
  return min(pp - s - 1, m)


def _one_f_one_b_pattern(pp: int, s: int, m: int) -> list[Op]:
  warm = _warmup(pp, s, m)
  ops = [Op(F, i) for i in range(warm)]
  for k in range(m - warm):
    ops += [Op(F, k + warm), Op(BW, k)]
  ops += [Op(BW, k) for k in range(m - warm, m)]
  return ops


def _zb_h1_pattern(pp: int, s: int, m: int) -> list[Op]:
  # 1F1B's order of F and B (so the same activations are pending), with each W deferred by s
  # backwards: W_k runs right after B_{k+s}. Deeper stages wait longer for their first B, so
  # deferring their Ws moves that work out of the backward critical path into the cooldown,
  # where the remaining s Ws fill the bubble while later stages finish their last Bs.
  warm = _warmup(pp, s, m)
  ops = [Op(F, i) for i in range(warm)]
  for k in range(m):
    if k + warm < m:
      ops.append(Op(F, k + warm))
    ops.append(Op(B, k))
    if k - s >= 0:
      ops.append(Op(W, k - s))
  ops += [Op(W, k) for k in range(max(m - s, 0), m)]
  return ops


def gpipe(dp: int, pp: int, m: int) -> Schedule:
  """GPipe: all forwards, then all (fused) backwards, on every stage."""
  return _build("gpipe", dp, pp, m, _gpipe_pattern)


def one_f_one_b(dp: int, pp: int, m: int) -> Schedule:
  """1F1B: `min(pp - s - 1, m)` warmup forwards on stage s, then one F / one fused BW."""
  return _build("1f1b", dp, pp, m, _one_f_one_b_pattern)


def zb_h1(dp: int, pp: int, m: int) -> Schedule:
  """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with split B/W.

  Stage s runs 1F1B's order of F and B (`min(pp - s - 1, m)` warmup forwards) and puts W_k
  right after B_{k+s}, with its last s Ws after its last B. Only B is on the backward critical
  path, so with uniform per-stage times, no transfer latency and m >= pp the makespan is
  `m*(T_F+T_B+T_W) + (pp-1)*max(T_F+T_B-T_W, T_F, T_B)`: the paper's `(pp-1)*(T_F+T_B-T_W)`
  bubble whenever `T_W <= min(T_F, T_B)`, against 1F1B's `(pp-1)*(T_F+T_B+T_W)`.

  Memory: every stage holds the same micro-batches between F and B as under 1F1B (the paper's
  M_B budget), but stage s also keeps up to s micro-batches whose W is deferred, so counted
  from F to W every stage peaks at `min(pp, m)`: 1F1B's stage-0 peak."""
  return _build("zb-h1", dp, pp, m, _zb_h1_pattern)


GENERATORS: dict[str, Callable[[int, int, int], Schedule]] = {
  "gpipe": gpipe,
  "1f1b": one_f_one_b,
  "zb-h1": zb_h1,
}


def generate(name: str, dp: int, pp: int, m: int) -> Schedule:
  """The fault-free schedule called `name` ("gpipe", "1f1b" or "zb-h1").

  Args:
    name: the generator.
    dp: data-parallel pipelines.
    pp: pipeline stages.
    m: micro-batches per pipeline.

  Returns:
    The schedule.

  Raises:
    ValueError: for an unknown name.
  """
  try:
    gen = GENERATORS[name]
  except KeyError:
    raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(GENERATORS)}") from None
  return gen(dp, pp, m)
