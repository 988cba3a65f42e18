"""The one training loop, for a single process and for every process of a multi-process job.

Read `Trainer.run` top to bottom:
  1. start: the newest checkpoint in `WORKDIR/checkpoints` that verifies (any layout; in a job
     process 0 picks it and every process loads that one), else the initial parameters from the
     seed; a process relaunched into a running job instead waits to be admitted and takes its
     state from live peers (`relaunch.py`);
  2. each step is one `ResilientStep` (`step.py`: attempt -> lost -> decide -> place -> retry):
     its record says it committed, or that the policy went back to a checkpoint, and the loop
     goes on after that checkpoint's step (no exception steers the loop);
  3. a committed step goes to the hooks (`hooks.py`), in order: timelines and schedules, the
     held-out evaluation when due (which loses nodes and recovers as a step does, and may
     return a `Rollback`, `evaluation.py`), the replicas' digests when due (`integrity.py`),
     slow workers (`stragglers.py`), metrics, TensorBoard, the log line, the policy's step
     times, the user's hooks; then, last, the stop on non-finite steps, the stop asked for
     (preemption) and the checkpoint when due (`checkpoints.py`).

What is built before the first step is `run.py`'s; what differs between one process and a job
is `group.py`'s. Workdir outputs (process 0): `metrics.jsonl`, `recovery.json`, `goodput.json`,
`timeline*.json/png`, `schedule.txt`, `profile.json`, `config.json`, `checkpoints/`, `tb/`;
every process: `profile/stepN/` (`jax.profiler` traces of `profile.trace_steps`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax

from resilient_jax import recipe
from resilient_jax.config import RunConfig
from resilient_jax.exit_codes import EXIT_PREEMPTED
from resilient_jax.files import write_json_atomic
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.observe.events import Event
from resilient_jax.observe.logs import info
from resilient_jax.observe.profiling import RunTimelines, StepTraces
from resilient_jax.observe.records import StepResult
from resilient_jax.observe.tensorboard import Board
from resilient_jax.policy import RunCoordinator
from resilient_jax.programs.stages import StagePrograms
from resilient_jax.runtime.interpreter import Interpreter
from resilient_jax.training.checkpoints import Checkpoints
from resilient_jax.training.evaluation import Evaluation
from resilient_jax.training.failures import Failures
from resilient_jax.training.faults import FaultEvent, check_fault_events
from resilient_jax.training.hooks import (
  MetricsFile,
  NonFiniteStreak,
  StepHook,
  StepInfo,
  standard_hooks,
)
from resilient_jax.training.integrity import replica_check
from resilient_jax.training.relaunch import admissions_for
from resilient_jax.training.run import Logger, start_run
from resilient_jax.training.step import ResilientStep, StepRecord


@dataclasses.dataclass
class TrainResult:
  metrics: list[dict]
  interpreter: Interpreter
  coordinator: RunCoordinator
  last_step: StepResult | None
  events: list[Event] = dataclasses.field(default_factory=list)
  """What happened to the run, in order (`observe.events`: failures, decisions, restores,
  copies, rejoins, speeds, corrupt replicas, checkpoints); `events.jsonl` holds them too."""


class Preempted(RuntimeError):
  """The run stopped on request (SIGTERM/SIGINT) after a committed step, which it
  checkpointed."""

  exit_code = EXIT_PREEMPTED


class Trainer:
  """One run, or one process's share of a job.

  Args:
    cfg: the validated run configuration.
    workdir: where outputs go (created). A workdir holding checkpoints is resumed from.
    devices: devices to use in a single-process run (default: all local devices).
    log: where progress lines go (default: absl logging at INFO; in a job only process 0's).
    faults: failures to inject besides the config's `faults.schedule` (in-process).
    cluster: the joined `jax.distributed` job (`runtime.cluster.Cluster`); None runs every
      slot in this process.
    model, loss_fn, data: a user's model, loss and data (`api.train`'s); None: the config's.
    started: `time.time()` when the process started (the launcher's), so that the goodput's
      wall time counts the start-up (imports, joining, building); None: from the run's build.
  """

  @outside_ambient_mesh
  def __init__(self, cfg: RunConfig, workdir: str | os.PathLike, *,
               devices: list[jax.Device] | None = None, log: Logger = info,
               faults: Sequence[FaultEvent] = (), cluster: Any = None, model: Any = None,
               loss_fn: Any = None, data: Any = None, started: float | None = None):
    check_fault_events(faults, cfg)
    self.run_state = start_run(cfg, workdir, devices=devices, log=log, cluster=cluster,
                               model=model, loss_fn=loss_fn, data=data)
    """The run's parts (`run.Run`); what a step changes is the `TrainState` the loop threads."""
    run = self.run_state
    run.goodput.started = started or run.goodput.started  # the goodput's wall time from there
    self.checkpoints = Checkpoints(run)
    events = [FaultEvent(f.step, (f.dp, f.stage), rejoin=f.rejoin)
              for f in cfg.faults.schedule] + list(faults)
    self.failures = Failures(run, self.checkpoints,
                             [(f, f.worker[0] * cfg.mesh.pp + f.worker[1]) for f in events])
    self.admissions = admissions_for(run, self.checkpoints)
    self.stop_signal = ""
    self.traces = StepTraces(cfg.profile.trace_steps, run.workdir / "profile", log=run.log,
                             process=run.group.process_id)
    end = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    self.timelines = RunTimelines((f.step for f in events if not f.rejoin), end, cfg.train.steps)
    self.metrics_file = MetricsFile(run.workdir / "metrics.jsonl", run.chief)
    self.hooks = standard_hooks(run, self.timelines, self.metrics_file,
                                Evaluation(run, self.failures), replica_check(cfg, self.failures))
    # After every other hook, in this order: a stop on too many non-finite steps, a stop asked
    # for, and the checkpoint when due.
    self.nonfinite = NonFiniteStreak(run)
    for fn in (self.nonfinite, self._stop_if_asked, self.checkpoints):
      self.hooks.add(fn, final=True)
    self.step = ResilientStep(run, self.failures, self.checkpoints, self.admissions,
                              self.timelines, self.traces, recipe.learning_rate(cfg))

  # The run's parts, as tests, benchmarks and notebooks reach them.
  cfg = property(lambda self: self.run_state.cfg)
  """The run's config (one copy: what the checkpoint rule and every other part read)."""
  interpreter = property(lambda self: self.run_state.interpreter)
  coordinator = property(lambda self: self.run_state.coordinator)
  transport = property(lambda self: self.run_state.transport)
  workdir = property(lambda self: self.run_state.workdir)
  source = property(lambda self: self.run_state.source)
  plan = property(lambda self: self.run_state.batches)
  writer = property(lambda self: self.run_state.writer)

  @property
  def programs(self) -> list[StagePrograms]:
    """The configured grid's stage programs."""
    return self.run_state.programs.configured

  def add_hook(self, fn: StepHook, every: int = 1) -> None:
    """Calls `fn(StepInfo)` after every `every`-th committed step (and the last), before the
    checkpoint's hook; what it returns is added to the step's metrics row."""
    self.hooks.add(fn, every)

  @outside_ambient_mesh
  def run(self) -> TrainResult:
    """Trains to `train.steps` (or `train.stop_after`), resuming from the workdir.

    A stop asked for while a step runs (`request_stop`: SIGTERM or SIGINT where the launcher
    catches them, `training/preemption.py`) ends the run after that step, in every process of
    the job, with a checkpoint of it: `Preempted`. Whatever ends the run, a checkpoint save in
    flight is committed (or its error reported) first.
    """
    with self.run_state.builds.counting():
      return self._run()

  def _run(self) -> TrainResult:
    run, cfg = self.run_state, self.cfg
    try:
      start = self.admissions.join() if run.group.relaunched else self.checkpoints.load(
        "start") + 1
      if run.chief:  # after the load: a resume it refuses (another seed, model...) changes no file
        write_json_atomic(run.workdir / "config.json", dataclasses.asdict(cfg))
      metrics = self.metrics_file.resume(start, run.log, self.checkpoints.why_none)
      if run.chief:
        run.board = Board(run.workdir / "tb", start, log=run.log)
      end, result = self.timelines.end, None
      self.nonfinite.resume(start, metrics)  # counts on from before a resume
      # The optimizer steps applied so far (the schedule's count), from the committed rows.
      state = self.step.state(start - 1, _updates(metrics))
      while state.step < end:
        state, record = self.step(state)
        back = record.restored
        if record.committed:
          result = record.result
          rollback = self.hooks.after_step(
            state.step, state.step == end, result, record.row, replayed=record.replayed,
            compiles=record.compiles, params=run.interpreter.all_params)
          back = rollback.step if rollback is not None else None
        if back is not None:  # the policy restored a checkpoint: on after its step
          metrics = self.metrics_file.rewind([m for m in metrics if m["step"] <= back])
          state = self.step.state(back, _updates(metrics))
          continue
        metrics.append(record.row)
      self.checkpoints.wait()
      if end < cfg.train.steps:
        run.log(f"stopped after step {end} (train.stop_after); run again on the same workdir "
                "to resume")
      self.hooks.at_end(run, metrics)
      run.group.leave_together("finished", run.coordinator.live)
      return TrainResult(metrics, run.interpreter, run.coordinator, result, run.events.events)
    finally:
      self.checkpoints.finish()
      run.board.close()

  def run_step(self, step: int, *, profile: bool = False) -> StepRecord:
    """Attempts `step` until it commits, outside the loop (benchmarks): no hooks run."""
    return self.step.until_commit(step, profile=profile)

  def request_stop(self, why: str) -> None:
    """Asks the job to stop after the step in flight (every process agrees on it)."""
    self.run_state.transport.stop_requested = True
    self.stop_signal = why

  def _stop_if_asked(self, info: StepInfo) -> None:
    """The hook before the checkpoint's: a stop asked for during the step ends the run after it,
    with a checkpoint of it (`Preempted`)."""
    if info.result.stop and not info.last:
      self._stop_after(info.step)

  def _stop_after(self, step: int) -> None:
    run = self.run_state
    why = (f"this process received {self.stop_signal}" if run.transport.stop_requested else
           "another process of the job received a stop signal")
    run.log(f"stopping after step {step}: {why}; checkpointing it")
    self.checkpoints.save(step)
    self.checkpoints.wait()
    run.group.leave_together(f"stopped/{step}", run.coordinator.live)
    raise Preempted(f"stopped after step {step} on request ({why}), with a checkpoint of it; "
                    "run the same command to resume")


def _updates(metrics: list[dict]) -> int:
  """Optimizer steps the committed rows applied (a skipped step applies none)."""
  return sum(not m.get("skipped") for m in metrics)
