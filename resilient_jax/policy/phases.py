"""Step times per stretch of steps run with one plan, and the before/after report of a failure."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable


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
