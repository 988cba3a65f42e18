"""Host-side coordinator: which workers are alive, and the schedule that runs on them.

It holds no JAX state. When a worker fails it asks the planner for a schedule over the
survivors (the failed worker's micro-batches go to the same stage in other pipelines) and hands
it to the runtime through `schedule`. It never changes the global batch: every micro-batch of
every step is in the new schedule's routes exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

from resilient_jax.config import RunConfig
from resilient_jax.schedule import generators
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.validate import validate

EXIT_STAGE_LOST = 3
"""Exit code when every worker of some stage has failed and re-routing cannot continue."""


class StageLost(RuntimeError):
  """Every worker of a stage is dead: the re-routing path cannot continue."""

  def __init__(self, stage: int):
    super().__init__(f"every worker of stage {stage} has failed; cannot re-route its work")
    self.stage = stage


class Coordinator:
  """Tracks live workers and replans on failure.

  Args:
    cfg: run configuration (grid shape, base schedule, micro-batches, fault schedule).
    log: where decisions are reported.
  """

  def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print):
    self.cfg = cfg
    self.log = log
    self.dp, self.pp, self.m = cfg.mesh.dp, cfg.mesh.pp, cfg.pipeline.microbatches
    self.live: set[Worker] = {(d, s) for d in range(self.dp) for s in range(self.pp)}
    self.failed: list[tuple[int, Worker]] = []
    self.schedule: Schedule = generators.generate(cfg.pipeline.schedule, self.dp, self.pp, self.m)
    validate(self.schedule)
    self.step_times: dict[int, float] = {}

  def faults_at(self, step: int) -> list[Worker]:
    """Workers the config's fault schedule fails at the start of `step`."""
    return [
      (f.dp, f.stage)
      for f in self.cfg.faults.schedule
      if f.step == step and (f.dp, f.stage) in self.live
    ]

  def record_step_time(self, step: int, seconds: float) -> None:
    self.step_times[step] = seconds

  def fail(self, worker: Worker, step: int, *, mid_step: bool = False) -> Schedule:
    """Marks `worker` dead and replans.

    Raises:
      StageLost: no live worker is left in the failed worker's stage.
    """
    if worker not in self.live:
      return self.schedule
    self.live.discard(worker)
    self.failed.append((step, worker))
    when = "during" if mid_step else "at the start of"
    self.log(f"worker (dp={worker[0]}, stage={worker[1]}) failed {when} step {step}")
    stage = worker[1]
    if not any(w[1] == stage for w in self.live):
      raise StageLost(stage)
    raise NotImplementedError("re-routing planner not built yet")
