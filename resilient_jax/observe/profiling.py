"""Timelines of executed steps: measured op durations replayed through the cost model; and
`jax.profiler` traces of chosen steps (`StepTraces`).

On simulated CPU devices all workers share a couple of cores, so wall-clock concurrency says
little about the schedule. Profile mode therefore times each op on its own (the runtime waits
for it) and the timeline is the schedule replayed with those measured durations: the step as it
would run with one real core per worker. The replay's makespan is also what the executor
benchmark compares against the cost model's prediction.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from resilient_jax.observe import timeline
from resilient_jax.observe.records import OpRecord
from resilient_jax.schedule.core import AR, BW, FR, OPT, B, F, Op, Schedule, W, Worker
from resilient_jax.schedule.cost import OpCosts, Timeline, replay


def simulated_cpu_devices() -> int:
  """Simulated CPU devices sharing this host's cores in this process, or 0 (real accelerators,
  or one CPU device per process): where they share cores, wall-clock step times show the total
  compute of a step rather than its schedule, and only a replay tells the step time."""
  devices = jax.local_devices()
  return len(devices) if devices[0].platform == "cpu" and len(devices) > 1 else 0


def measured_durations(records: Iterable[OpRecord]) -> dict[tuple[Worker, Op], float]:
  return {(r.worker, r.op): r.end - r.start for r in records}


def costs_from_records(records: Sequence[OpRecord], pp: int) -> OpCosts:
  """Per-stage mean op times of a profiled step, as cost-model input (seconds).

  A stage with no measured op of some kind (e.g. no W in a fused-backward schedule) gets the
  mean over the stages that have it, or 0.
  """
  sums: dict[tuple[str, int], list[float]] = {}
  for r in records:
    sums.setdefault((r.op.kind, r.worker[1]), []).append(r.end - r.start)

  def per_stage(kind: str) -> tuple[float, ...]:
    means = {s: sum(v) / len(v) for (k, s), v in sums.items() if k == kind}
    fill = sum(means.values()) / len(means) if means else 0.0
    return tuple(means.get(s, fill) for s in range(pp))

  bw = per_stage(BW)
  b, w = per_stage(B), per_stage(W)
  if not any(b) and any(bw):  # only fused backwards ran: split them evenly for the model
    b = w = tuple(x / 2 for x in bw)
  fr = per_stage(FR) if any(k == FR for k, _ in sums) else None  # Bamboo's redundant forwards
  return OpCosts(f=per_stage(F), b=b, w=w, ar=per_stage(AR), opt=per_stage(OPT), comm=0.0, fr=fr)


def write_profile(costs: OpCosts, pp: int, path: str | Path) -> None:
  """Writes measured op times in the simulator's profile format (`resilient_jax.sim.cost_model`)."""

  def seq(v) -> list[float]:
    return [float(x) for x in v] if isinstance(v, tuple) else [float(v)] * pp

  data = {"f": seq(costs.f), "b": seq(costs.b), "w": seq(costs.w), "ar": seq(costs.ar),
          "opt": seq(costs.opt), "comm": float(costs.comm)}
  Path(path).write_text(json.dumps(data, indent=1) + "\n")


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
  failed: Mapping[Worker, int] | None = None,
  metadata: Mapping[str, Any] | None = None,
  replayed: Timeline | None = None,
) -> Timeline:
  """Writes `<stem>.json` (Chrome/Perfetto trace) and `<stem>.png` (Gantt) for one step, and
  for the main timeline `profile.json` (measured per-stage op times, the simulator's input).

  Args:
    schedule: the schedule the step ran.
    records: its profiled ops.
    out_dir: where the files go.
    title: the first line of the title (which step, and why it was drawn).
    stem: the files' name without extension.
    failed: `{worker: step}` of the grid's failed workers, drawn as failed rows.
    metadata: extra entries for the trace's `otherData`.
    replayed: `replay_records(schedule, records)` when the caller has it already.
  """
  out_dir = Path(out_dir)
  tl = replayed if replayed is not None else replay_records(schedule, records)
  measured = max((r.end for r in records), default=0.0)
  label = (
    f"{schedule.name} schedule replayed from measured op times "
    f"(makespan {tl.makespan * 1e3:.1f} ms)"
  )
  timeline.write_chrome_trace(
    tl.spans,
    out_dir / f"{stem}.json",
    title=f"{title}; {label}" if title else label,
    metadata={
      "schedule": schedule.name,
      "replayed_makespan_s": tl.makespan,
      "serial_profile_time_s": measured,
      "schedule_text": schedule.to_text(),
      **(metadata or {}),
    },
    failed=failed,
  )
  timeline.plot_gantt(
    tl.spans,
    out_dir / f"{stem}.png",
    title=f"{title}\n{label}" if title else label,
    highlight_mbs=rerouted_work(schedule) or None,
    failed=failed,
  )
  if stem == "timeline":
    write_profile(costs_from_records(records, schedule.pp), schedule.pp, out_dir / "profile.json")
  return tl


class RunTimelines:
  """Which steps of a run are profiled and drawn, and what each drawing's title says.

  Drawn: the last step (`timeline.*`) and, around the failures injected in-process (known in
  advance), as `timeline_step<N>.*` with N the step drawn:
  * the last fault-free step before the first failure, kept for comparison (from step 2 on:
    step 1's op times include compiling every program);
  * the first step after each failure (the failure's own step when it is the run's last),
    so a short run draws it too.

  Args:
    failure_steps: the steps of the injected failures.
    end: the run's last step.
    total: `train.steps` (differs from `end` with `train.stop_after`).
  """

  def __init__(self, failure_steps: Iterable[int], end: int, total: int):
    self.failures = sorted(set(failure_steps))
    self.end = end
    self.total = total
    first = self.failures[0] if self.failures else 0
    self.fault_free = first - 1 if first > 2 else 0
    self.after = {f + 1 for f in self.failures if f < end} | ({end} & set(self.failures))
    self.written: list[str] = []
    self.measure_every = 0
    """Profile every this many steps besides (their op times measured for stragglers,
    `training/stragglers.py`); 0: none."""

  def profile(self, step: int, failed: bool, drawn: bool = True) -> bool:
    """Whether `step` runs in profile mode; `failed`: a failure happened before it; `drawn`:
    whether this run draws timelines (not a multi-process job, whose processes each time only
    their own workers: its steps are profiled for `measure_every` alone)."""
    return (drawn and (step == self.end or step == self.fault_free
                       or (step in self.after and failed))
            or bool(self.measure_every) and step % self.measure_every == 0)

  def kind(self, step: int, failed: bool) -> str | None:
    """After the step ran: "fault-free", "after failure" (a `timeline_step<N>` drawing) or
    None; `failed`: a failure happened before it or during it."""
    if step == self.fault_free and not failed:
      return "fault-free"
    if step in self.after and failed:
      return "after failure"
    return None

  def title(self, step: int, kind: str | None, failed: Mapping[Worker, int],
            failures: Sequence[int], compiles: int) -> str:
    """The drawing's first title line.

    Args:
      step: the step drawn.
      kind: what `kind` said, None for the last step.
      failed: `{worker: failure step}` of the plan's failed workers.
      failures: the steps of the failures so far.
      compiles: XLA compilations during the step (their time is in the op times).
    """
    if kind == "fault-free":
      text = (f"step {step}: fault-free, the last step before the failure at step "
              f"{self.failures[0]} (kept for comparison)")
    elif kind == "after failure":
      at = step - 1 if step - 1 in failures else step
      who = sorted(w for w, s in failed.items() if s == at)
      names = ", ".join(f"d{d} s{s}" for d, s in who)
      worker = f" (worker{'s' if len(who) > 1 else ''} {names})" if who else ""
      if at == step:
        text = f"step {step}: run on the survivors of the failure in this step{worker}"
      else:
        text = f"step {step}: the first step after the failure at step {at}{worker}"
    else:
      text = f"step {step} of {self.total}: the last step"
      if failures:
        steps = sorted(set(failures))
        text += f", after the failure{'s' if len(steps) > 1 else ''} at step"
        text += f"{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
    if compiles:
      text += f" ({compiles} XLA compilations ran in this step: its op times include them)"
    return text


class StepTraces:
  """`jax.profiler` traces of the steps `profile.trace_steps` names, each into
  `out_dir/stepN/` (`/processP` added in a multi-process job), for TensorBoard's profile plugin
  (`tensorboard --logdir out_dir`) or Perfetto.

  The stage programs' ops carry named scopes of their kind (`F`, `B`, `W`, `BW`, `OPT`, `AR`:
  `stages.py`, `runtime/transport.py`) and each op's dispatch on the host is annotated with its
  name in the schedule (`F3`, with stage, micro-batch and pipeline: `runtime/interpreter.py`),
  so the device trace lines up with `timeline.json`.

  Args:
    steps: the steps to trace (each once, the first time it runs).
    out_dir: where traces go.
    log: where the line naming each trace goes.
    process: this process's index in a multi-process job, else None.
  """

  def __init__(self, steps: Collection[int], out_dir: str | Path,
               log: Callable[[str], None] = print, process: int | None = None):
    self.steps = set(steps)
    self.out_dir = Path(out_dir)
    self.log = log
    self.process = process

  @contextlib.contextmanager
  def step(self, step: int, outputs: Callable[[], Any]) -> Iterator[None]:
    """Traces the body if `step` is to be traced; `outputs()` (what the step computes) is
    waited for before the trace stops, so the step's device work is all in it."""
    if step not in self.steps:
      yield
      return
    self.steps.discard(step)  # a step redone after a restore is not traced again
    where = self.out_dir / f"step{step}"
    if self.process is not None:
      where = where / f"process{self.process}"
    try:
      jax.profiler.start_trace(str(where))
    except RuntimeError as err:  # a trace started by someone else is running
      self.log(f"  cannot trace step {step}: {err}")
      yield
      return
    self.log(f"  tracing step {step} with jax.profiler into {where}")
    try:
      yield
      jax.block_until_ready(outputs())
    finally:
      jax.profiler.stop_trace()
