"""Timelines of executed steps: measured op durations replayed through the cost model.

On simulated CPU devices all workers share a couple of cores, so wall-clock concurrency says
little about the schedule. Profile mode therefore times each op on its own (the runtime waits
for it) and the timeline is the schedule replayed with those measured durations: the step as it
would run with one real core per worker. The replay's makespan is also what the executor
benchmark compares against the cost model's prediction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from resilient_jax import timeline
from resilient_jax.runtime.executor import OpRecord
from resilient_jax.schedule.core import Op, Schedule, Worker
from resilient_jax.schedule.cost import Timeline, replay


def measured_durations(records: Iterable[OpRecord]) -> dict[tuple[Worker, Op], float]:
  return {(r.worker, r.op): r.end - r.start for r in records}


def replay_records(schedule: Schedule, records: Sequence[OpRecord]) -> Timeline:
  """The schedule's timeline with each op taking the time it was measured to take."""
  return replay(schedule, measured_durations(records))


def rerouted_work(schedule: Schedule) -> set[tuple[Worker, int]]:
  """`(worker, mb)` of every stage that runs outside its micro-batch's own pipeline."""
  return {((d, s), mb) for mb, r in enumerate(schedule.route) for s, d in enumerate(r)
          if d != schedule.owner(mb)}


def write_step_timeline(
  schedule: Schedule,
  records: Sequence[OpRecord],
  out_dir: str | Path,
  *,
  title: str = "",
  stem: str = "timeline",
) -> Timeline:
  """Writes `<stem>.json` (Chrome/Perfetto trace) and `<stem>.png` (Gantt) for one step."""
  out_dir = Path(out_dir)
  tl = replay_records(schedule, records)
  measured = max((r.end for r in records), default=0.0)
  label = (
    f"{title}: {schedule.name}, replayed from measured op times "
    f"(makespan {tl.makespan * 1e3:.1f} ms)"
  )
  timeline.write_chrome_trace(
    tl.spans,
    out_dir / f"{stem}.json",
    title=label,
    metadata={
      "schedule": schedule.name,
      "replayed_makespan_s": tl.makespan,
      "serial_profile_time_s": measured,
      "schedule_text": schedule.to_text(),
    },
  )
  timeline.plot_gantt(
    tl.spans,
    out_dir / f"{stem}.png",
    title=label,
    highlight_mbs=rerouted_work(schedule) or None,
  )
  return tl
