"""Host-side coordinator: which workers are alive, and the schedule that runs on them.

It holds no JAX state. When a worker fails it asks the planner for a schedule over the
survivors (the failed worker's micro-batches go to the same stage in other pipelines, spread
over all live peers) and hands it to the runtime through `schedule`. It never changes the
global batch: every micro-batch of every step is in the new schedule's routes exactly once.

Planning inputs are deterministic (grid shape, failed set, and per-stage costs estimated from
the model's FLOPs rather than from noisy timings), so every process that agrees on the failed
set derives the same schedule without exchanging it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from resilient_jax.config import RunConfig
from resilient_jax.schedule import adaptive
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.validate import validate

EXIT_NO_DEVICES = 3
"""Exit code when failures leave no device to continue on."""
EXIT_STAGE_LOST = 3
"""Exit code when a whole stage is lost and `resilience.restore_on_stage_loss` is false."""

# `auto` starts as `recycle` (see `policies.auto_choice` for when it switches).
PLANNER_POLICY = {
  "recycle": "adaptive", "naive": "naive", "restart": "adaptive", "auto": "adaptive"
}


@dataclasses.dataclass
class Phase:
  """A stretch of steps run with one schedule."""

  schedule_name: str
  live: int
  predicted_ratio: float
  """Predicted step time relative to the fault-free schedule."""
  report_pending: bool = False
  first_step: int | None = None
  warm_times: list[float] = dataclasses.field(default_factory=list)


class NeedsRestore(RuntimeError):
  """The run cannot go on with this grid: the trainer restores the latest checkpoint onto the
  surviving devices."""


class StageLost(NeedsRestore):
  """Every worker of a stage is dead: the re-routing path cannot continue."""

  def __init__(self, stage: int, step: int):
    super().__init__(
      f"every worker of stage {stage} has failed (step {step}); its weights have no live "
      "replica, so training cannot continue by re-routing"
    )
    self.stage = stage
    self.step = step


class NoDevicesLeft(RuntimeError):
  """No surviving device can hold even a one-stage pipeline."""


def block_and_head_flops(cfg: RunConfig) -> tuple[int, int]:
  """Forward multiply-adds of one transformer block and of the LM head, per sequence."""
  m = cfg.model
  t, d, f = m.seq_len, m.d_model, m.mlp_ratio * m.d_model
  return t * (d * 3 * d + d * d + 2 * d * f) + 2 * t * t * d, t * d * m.vocab_size


def stage_costs(cfg: RunConfig) -> OpCosts:
  """Per-stage op costs in units of one transformer block's forward FLOPs.

  B and W each cost about one forward (the backward of a matmul is two matmuls of the same
  size, one for the input and one for the weight gradient); the last stage adds the head.
  """
  block, head = block_and_head_flops(cfg)
  f_costs = []
  for s, layers in enumerate(cfg.partition):
    flops = len(layers) * block + (head if s == cfg.mesh.pp - 1 else 0)
    f_costs.append(max(flops, 1) / block)
  per_stage = tuple(f_costs)
  return OpCosts(f=per_stage, b=per_stage, w=per_stage, ar=0.0, opt=0.0, comm=0.0)


def largest_layout(
  num_devices: int, num_layers: int, global_batch: int, microbatches: int, min_pp: int = 1
) -> tuple[int, int]:
  """The dp x pp grid (pp >= `min_pp`) using the most of `num_devices` (then the most data
  parallelism, which has the smaller pipeline bubble) that the model and batch allow.

  Raises:
    NoDevicesLeft: no layout fits.
  """
  best = None
  for pp in range(min_pp, min(num_layers, num_devices) + 1):
    for dp in range(1, num_devices // pp + 1):
      if global_batch % (dp * microbatches) == 0:
        key = (dp * pp, dp)
        if best is None or key > best[0]:
          best = (key, (dp, pp))
  if best is None:
    raise NoDevicesLeft(f"no device is left to continue on ({num_devices} survivors)")
  return best[1]


class PhaseLog:
  """Step times per stretch of steps run with one plan, and the before/after report of a failure.

  Subclasses set `self.phases` to one `Phase` for the fault-free plan and call `_new_phase`
  after each replan.
  """

  phases: list[Phase]
  log: Callable[[str], None]
  fault_free_makespan: float

  def _new_phase(self, name: str, live: int, ratio: float) -> None:
    self.phases.append(Phase(name, live, ratio, report_pending=True))

  def record_step_time(self, step: int, seconds: float, *, profiled: bool = False) -> None:
    """Records a completed step. Only warm steps count for comparisons: not profiled, and not
    the first step of a schedule (it compiles the new stage groups' all-reduces)."""
    phase = self.phases[-1]
    if phase.first_step is None:
      phase.first_step = step
    elif not profiled:
      phase.warm_times.append(seconds)
      if phase.report_pending:
        phase.report_pending = False
        before = next((p for p in reversed(self.phases[:-1]) if p.warm_times), None)
        if before is not None:
          b = statistics.median(before.warm_times)
          self.log(
            f"step time {b:.3f}s before the failure, {seconds:.3f}s after "
            f"(x{seconds / b:.2f}; cost model predicts x{phase.predicted_ratio:.2f})"
          )
        else:
          self.log(
            f"step time after the failure {seconds:.3f}s (no warm step before it to "
            f"compare; cost model predicts x{phase.predicted_ratio:.2f})"
          )

  def summary(self) -> list[str]:
    """One line per schedule the run used: live workers, steps, median warm step time."""
    lines = []
    for p in self.phases:
      t = (
        f"median warm step {statistics.median(p.warm_times):.3f}s"
        if p.warm_times
        else "no warm steps"
      )
      lines.append(
        f"  {p.schedule_name:9s} {p.live:3d} workers  from step {p.first_step}: {t}  "
        f"(predicted step time x{p.predicted_ratio:.2f} of fault-free)"
      )
    return lines


class Coordinator(PhaseLog):
  """Tracks live workers and replans on failure.

  Args:
    cfg: run configuration (grid shape, base schedule, micro-batches, faults, policy).
    log: where decisions are reported.
  """

  def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print):
    self.cfg = cfg
    self.log = log
    self.dp, self.pp, self.m = cfg.mesh.dp, cfg.mesh.pp, cfg.pipeline.microbatches
    self.live: set[Worker] = {(d, s) for d in range(self.dp) for s in range(self.pp)}
    self.failed: list[tuple[int, Worker]] = []
    self.costs = stage_costs(cfg)
    self.schedule: Schedule = self._plan()
    self.fault_free_makespan = self.predicted_makespan()
    self.phases: list[Phase] = [Phase(self.schedule.name, len(self.live), 1.0)]

  @property
  def plan_name(self) -> str:
    return self.schedule.name

  @property
  def live_count(self) -> int:
    return len(self.schedule.workers)

  def plan_text(self) -> str:
    return self.schedule.to_text()

  @property
  def failed_workers(self) -> frozenset[Worker]:
    return frozenset(w for _, w in self.failed)

  def _plan(self) -> Schedule:
    policy = PLANNER_POLICY[self.cfg.resilience.policy]
    schedule = adaptive.plan(
      policy,
      self.dp,
      self.pp,
      self.m,
      self.failed_workers,
      self.costs,
      memory_cap=self.cfg.resilience.memory_cap or None,
      base=self.cfg.pipeline.schedule,
    )
    validate(schedule)
    return schedule

  def predicted_makespan(self, schedule: Schedule | None = None) -> float:
    """The cost model's step time for `schedule` (default: the current one), in block units."""
    return simulate(schedule or self.schedule, self.costs).makespan

  def faults_at(self, step: int) -> list[Worker]:
    """Workers the config's fault schedule fails at the start of `step`."""
    return [
      (f.dp, f.stage)
      for f in self.cfg.faults.schedule
      if f.step == step and (f.dp, f.stage) in self.live
    ]

  def fail(self, worker: Worker, step: int, *, mid_step: bool = False) -> Schedule:
    """Marks `worker` dead and replans.

    Raises:
      StageLost: no live worker is left in the failed worker's stage.
    """
    if worker not in self.live:
      return self.schedule
    before = self.predicted_makespan()
    self.live.discard(worker)
    self.failed.append((step, worker))
    when = "during" if mid_step else "at the start of"
    d, s = worker
    self.log(f"FAILURE: worker (dp={d}, stage={s}) failed {when} step {step}")
    if not any(w[1] == s for w in self.live):
      raise StageLost(s, step)
    if self.cfg.resilience.policy == "restart":
      raise NeedsRestore(f"worker (dp={d}, stage={s}) failed at step {step} and "
                         "resilience.policy=restart")
    self.schedule = self._plan()
    takers: dict[int, list[int]] = {}
    for mb in range(d * self.m, (d + 1) * self.m):
      takers.setdefault(self.schedule.route[mb][s], []).append(mb)
    moved = ", ".join(
      f"(dp={p}, stage={s}) takes micro-batches {mbs}" for p, mbs in sorted(takers.items())
    )
    after = self.predicted_makespan()
    self.log(f"  re-routed: {moved}")
    self.log(
      f"  replanned with the {self.schedule.name} planner on {len(self.live)} live "
      f"workers; predicted step time x{after / before:.2f}"
    )
    ratio = after / self.fault_free_makespan
    self._new_phase(self.schedule.name, len(self.live), ratio)
    return self.schedule
