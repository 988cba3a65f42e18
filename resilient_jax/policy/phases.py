"""Step times per stretch of steps run with one plan, and the before/after report of a failure.

On real accelerators the report compares wall-clock step times. On simulated CPU devices
(several devices of one process sharing the host's cores) wall time measures a step's total
compute, not its schedule: there the report headlines the step time *replayed* from measured
op times (`resilient_jax.observe.profiling`: the schedule replayed with one core per worker)
and marks wall time as not meaningful.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from resilient_jax.schedule.core import Schedule
from resilient_jax.schedule.cost import OpCosts, simulate


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
  failure_step: int | None = None
  """The step of the failure (or rejoin) that started this stretch (None for the fault-free
  one)."""
  event: str = "failure"
  """What started this stretch: "failure" or "rejoin"."""
  replayed: tuple[int, float] | None = None
  """`(step, seconds)`: a profiled step of this stretch (not its first, which compiles),
  replayed from its measured op times."""
  measured: tuple[Schedule, OpCosts] | None = None
  """That step's schedule and its per-stage mean op times (a grid plan's only)."""


class PhaseLog:
  """Step times per stretch of steps run with one plan, and the before/after report of a failure.

  Subclasses set `self.phases` to one `Phase` for the fault-free plan and call `_new_phase`
  after each replan.
  """

  phases: list[Phase]
  log: Callable[[str], None]
  fault_free_makespan: float
  simulated_devices: int = 0
  """Simulated CPU devices sharing this host's cores (set by the runtime); 0: wall time is
  the step time (real accelerators, or one CPU device per process)."""

  def _new_phase(self, name: str, live: int, ratio: float, failure_step: int | None = None,
                 event: str = "failure"):
    self.phases.append(Phase(name, live, ratio, report_pending=True, failure_step=failure_step,
                             event=event))

  def _shared_cores(self) -> str:
    return (f"wall-clock times are not meaningful on {self.simulated_devices} simulated CPU "
            "devices sharing this host's cores")

  def record_step_time(
    self, step: int, seconds: float, *, profiled: bool = False, replayed_s: float | None = None,
    measured: tuple[Schedule, OpCosts] | None = None,
  ) -> None:
    """Records a completed step. Only warm steps count for comparisons: not profiled, and not
    the first step of a schedule (it compiles the new stage groups' all-reduces).

    Args:
      step: the step.
      seconds: its wall-clock time.
      profiled: it ran in profile mode (each op waited for), so its wall time is not a step's.
      replayed_s: for a profiled step, its schedule replayed from the measured op times.
      measured: for a profiled step of a grid plan, its schedule and per-stage mean op times.
    """
    phase = self.phases[-1]
    if phase.first_step is None:
      phase.first_step = step
    elif profiled:
      if replayed_s is not None and phase.replayed is None:
        phase.replayed, phase.measured = (step, replayed_s), measured
        if self.simulated_devices and phase.report_pending:
          phase.report_pending = False
          self._report_replayed(phase)
    else:
      phase.warm_times.append(seconds)
      if phase.report_pending:
        phase.report_pending = False
        self._report_wall(phase, seconds)

  def _before(self, phase: Phase, has: Callable[[Phase], bool]) -> Phase | None:
    earlier = self.phases[: self.phases.index(phase)]
    return next((p for p in reversed(earlier) if has(p)), None)

  def _failure(self, phase: Phase) -> str:
    at = phase.failure_step
    return f"the {phase.event}" if at is None else f"the {phase.event} at step {at}"

  def _report_replayed(self, phase: Phase) -> None:
    """The report of a failure on simulated devices: replayed step times first."""
    step, after = phase.replayed
    before = self._before(phase, lambda p: p.replayed is not None)
    if before is None:
      self.log(
        f"step time after {self._failure(phase)}: {after * 1e3:.1f} ms replayed from the "
        f"measured op times of step {step} (no warm step before it was profiled to compare; "
        f"cost model predicts x{phase.predicted_ratio:.2f} of fault-free; "
        f"{self._shared_cores()})"
      )
      return
    b_step, b = before.replayed
    predicted = phase.predicted_ratio / before.predicted_ratio
    if before.measured is not None and phase.measured is not None:
      # One step's op times on shared cores vary more from step to step than a schedule
      # changes a step: both schedules are replayed with the same (earlier) op times, so the
      # ratio is the schedules'; the other step's own replay is given beside it.
      (b_sched, costs), (a_sched, _) = before.measured, phase.measured
      same_b, same_a = simulate(b_sched, costs).makespan, simulate(a_sched, costs).makespan
      self.log(
        f"step time x{same_a / same_b:.2f} after {self._failure(phase)}: both schedules "
        f"replayed with the op times measured at step {b_step} ({same_b * 1e3:.1f} ms, "
        f"{same_a * 1e3:.1f} ms; with step {step}'s own op times x{after / b:.2f}, which "
        f"single steps' timings on shared cores make noisy); cost model predicts "
        f"x{predicted:.2f}; {self._shared_cores()}")
      return
    self.log(
      f"step time x{after / b:.2f} after {self._failure(phase)}, replayed from measured op "
      f"times ({b * 1e3:.1f} ms at step {b_step}, {after * 1e3:.1f} ms at step {step}; cost "
      f"model predicts x{predicted:.2f}; {self._shared_cores()})"
    )

  def _report_wall(self, phase: Phase, seconds: float) -> None:
    """The report of a failure in wall-clock time (marked as such on simulated devices)."""
    caveat = ""
    if self.simulated_devices:
      caveat = f"; no profiled step to replay, and {self._shared_cores()}"
    before = self._before(phase, lambda p: bool(p.warm_times))
    if before is not None:
      b = statistics.median(before.warm_times)
      self.log(
        f"step time {b:.3f}s before {self._failure(phase)}, {seconds:.3f}s after "
        f"(x{seconds / b:.2f}; cost model predicts "
        f"x{phase.predicted_ratio / before.predicted_ratio:.2f}{caveat})"
      )
    else:
      self.log(
        f"step time after {self._failure(phase)} {seconds:.3f}s (no warm step before it to "
        f"compare; cost model predicts x{phase.predicted_ratio:.2f} of fault-free{caveat})"
      )

  def summary(self) -> list[str]:
    """A heading and one line per schedule the run used: live workers, first step, step time
    (replayed first on simulated devices) and the cost model's prediction."""
    if not self.simulated_devices:
      lines = ["step times by schedule:"]
      for p in self.phases:
        lines.append(f"  {p.schedule_name:9s} {p.live:3d} workers  from step {p.first_step}: "
                     f"{_wall(p)}  (predicted step time x{p.predicted_ratio:.2f} of fault-free)")
      return lines
    base = self.phases[0].replayed
    lines = [f"step times by schedule, replayed from measured op times ({self._shared_cores()}):"]
    for p in self.phases:
      if p.replayed is None:
        t = "no profiled step to replay"
      else:
        t = f"replayed {p.replayed[1] * 1e3:.1f} ms (step {p.replayed[0]}"
        t += f", x{p.replayed[1] / base[1]:.2f} of fault-free)" if base else ")"
      lines.append(f"  {p.schedule_name:9s} {p.live:3d} workers  from step {p.first_step}: {t}  "
                   f"(predicted x{p.predicted_ratio:.2f} of fault-free; {_wall(p)}, not "
                   "meaningful)")
    return lines


def _wall(p: Phase) -> str:
  if not p.warm_times:
    return "no warm steps"
  return f"median warm step {statistics.median(p.warm_times):.3f}s"
