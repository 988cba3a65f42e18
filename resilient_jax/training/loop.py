"""The one training loop, for a single process and for every process of a multi-process job.

Read `Trainer.run` top to bottom:
  1. start: the newest checkpoint in `WORKDIR/checkpoints` that verifies (any layout; in a job
     process 0 picks it and every process loads that one), else the initial parameters from the
     seed; a process relaunched into a running job instead waits to be admitted and takes its
     state from live peers (`relaunch.py`);
  2. each step is *attempted* (`run_step`): rejoins and failures due at its start are applied
     first, then the step's samples (a pure function of seed and step) run on the
     interpreter. An attempt that loses nodes (a fault injected in-process, or processes that
     died) commits nothing: the policy decides what runs next (`failures.py`): a new plan on
     the survivors, or a restore of the latest checkpoint, and the step is attempted again with
     the same samples;
  3. a committed step goes to the hooks (`hooks.py`: the held-out evaluation when due, which
     loses nodes and recovers as a step does, `evaluation.py`; the replicas' digests when due,
     a corrupt one dropped at the next step, `integrity.py`; slow workers, `stragglers.py`;
     metrics, TensorBoard, log line, timelines, the policy's step times), then stops on
     non-finite steps or a preemption, then checkpoints when due (`checkpoints.py`).

What is built before the first step is `run.py`'s; what differs between one process and a job
is `group.py`'s. Workdir outputs (process 0): `metrics.jsonl`, `recovery.json`, `goodput.json`,
`timeline*.json/png`, `schedule.txt`, `profile.json`, `config.json`, `checkpoints/`, `tb/`;
every process: `profile/stepN/` (`jax.profiler` traces of `profile.trace_steps`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from resilient_jax import recipe
from resilient_jax.config import RunConfig
from resilient_jax.exit_codes import EXIT_PREEMPTED
from resilient_jax.files import write_json_atomic
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.observe.logs import info
from resilient_jax.observe.profiling import RunTimelines, StepTraces, replay_records
from resilient_jax.observe.progress import reporting
from resilient_jax.observe.records import Built, StepResult, WorkerLost
from resilient_jax.observe.tensorboard import Board
from resilient_jax.policy import RunCoordinator
from resilient_jax.programs.stages import StagePrograms
from resilient_jax.runtime.interpreter import Interpreter
from resilient_jax.schedule.plan import GridPlan
from resilient_jax.training.checkpoints import Checkpoints
from resilient_jax.training.evaluation import Evaluation
from resilient_jax.training.failures import Failures, Restored
from resilient_jax.training.faults import FaultEvent, check_fault_events
from resilient_jax.training.hooks import (
  MetricsFile,
  NonFiniteStreak,
  StepHook,
  StepInfo,
  metrics_row,
  standard_hooks,
)
from resilient_jax.training.integrity import replica_check
from resilient_jax.training.rejoin import apply_rejoin
from resilient_jax.training.relaunch import admissions_for
from resilient_jax.training.run import Logger, start_run


@dataclasses.dataclass
class TrainResult:
  metrics: list[dict]
  interpreter: Interpreter
  coordinator: RunCoordinator
  last_step: StepResult | None


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
    self.state = start_run(cfg, workdir, devices=devices, log=log, cluster=cluster, model=model,
                           loss_fn=loss_fn, data=data)
    run = self.state
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
    self.learning_rate = recipe.learning_rate(cfg)

  # The run's parts, as tests, benchmarks and notebooks reach them.
  cfg = property(lambda self: self.state.cfg)
  """The run's config (one copy: what the checkpoint rule and every other part read)."""
  interpreter = property(lambda self: self.state.interpreter)
  coordinator = property(lambda self: self.state.coordinator)
  transport = property(lambda self: self.state.transport)
  workdir = property(lambda self: self.state.workdir)
  source = property(lambda self: self.state.source)
  plan = property(lambda self: self.state.batches)
  writer = property(lambda self: self.state.writer)

  @property
  def programs(self) -> list[StagePrograms]:
    """The configured grid's stage programs."""
    return self.state.programs.configured

  def add_hook(self, fn: StepHook, every: int = 1) -> None:
    """Calls `fn(StepInfo)` after every `every`-th committed step (and the last)."""
    self.hooks.add(fn, every)

  @outside_ambient_mesh
  def run(self) -> TrainResult:
    """Trains to `train.steps` (or `train.stop_after`), resuming from the workdir.

    A stop asked for while a step runs (`request_stop`: SIGTERM or SIGINT where the launcher
    catches them, `training/preemption.py`) ends the run after that step, in every process of
    the job, with a checkpoint of it: `Preempted`. Whatever ends the run, a checkpoint save in
    flight is committed (or its error reported) first.
    """
    with self.state.builds.counting():
      return self._run()

  def _run(self) -> TrainResult:
    run, cfg = self.state, self.cfg
    try:
      start = self.admissions.join() if run.group.relaunched else self.checkpoints.load(
        "start") + 1
      if run.chief:  # after the load: a resume it refuses (another seed, model...) changes no file
        write_json_atomic(run.workdir / "config.json", dataclasses.asdict(cfg))
      metrics = self.metrics_file.resume(start, run.log, self.checkpoints.why_none)
      if run.chief:
        run.board = Board(run.workdir / "tb", start, log=run.log)
      end, step, result = self.timelines.end, start, None
      nonfinite = NonFiniteStreak(run, start, metrics)  # counts on from before a resume
      updates = _updates(metrics)  # optimizer steps applied so far: the schedule's count
      while step <= end:
        try:
          result, step_info = self._commit(step, end, updates)
          metrics.append(step_info.row)
          self.hooks.after_step(step_info)  # an evaluation among them may lose nodes too
        except Restored as r:
          step = r.step + 1
          metrics = self.metrics_file.rewind([m for m in metrics if m["step"] < step])
          updates = _updates(metrics)
          continue
        updates += not result.skipped
        nonfinite.after(step, result.skipped)  # NonFiniteSteps after too many in a row
        if result.stop and step < end:
          self._stop_after(step)
        self.checkpoints.if_due(step, step == end)
        step += 1
      self.checkpoints.wait()
      if end < cfg.train.steps:
        run.log(f"stopped after step {end} (train.stop_after); run again on the same workdir "
                "to resume")
      self.hooks.at_end(run, metrics)
      run.group.leave_together("finished", run.coordinator.live)
      return TrainResult(metrics, run.interpreter, run.coordinator, result)
    finally:
      self.checkpoints.finish()
      run.board.close()

  def _commit(self, step: int, end: int, updates: int) -> tuple[StepResult, StepInfo]:
    """Runs `step` until it commits (the optimizer having applied `updates` steps before it);
    its metrics row and what hooks see."""
    run = self.state
    xla0 = run.builds.xla
    profile = self.timelines.profile(step, bool(run.coordinator.failed), run.group.profiles)
    with self.traces.step(step, lambda: (run.interpreter.params, run.interpreter.opt_state,
                                         run.interpreter.replicas)):
      result, mb_ids = self.run_step(step, profile=profile)
    ids = recipe.processed_ids(mb_ids, result)
    plan = run.coordinator.plan
    replayed = None
    if result.records and isinstance(plan, GridPlan) and run.group.profiles:
      # The step as it would run with one core per worker (`observe/profiling.py`).
      replayed = replay_records(plan.schedule, result.records)
    row = metrics_row(run, step, result, ids, float(self.learning_rate(updates)))
    return result, StepInfo(step, step == end, result, row, replayed, run.builds.xla - xla0, run)

  @outside_ambient_mesh
  def run_step(self, step: int, *, profile: bool = False) -> tuple[StepResult, np.ndarray]:
    """Attempts 1-based `step` until an attempt commits, whatever fails during it.

    Returns:
      The committed attempt and the step's sample ids per micro-batch.

    Raises:
      Restored: the policy restored a checkpoint; the caller goes on after its step.
    """
    run = self.state
    back = self.failures.coming_back(step)
    if back:
      apply_rejoin(run, self.checkpoints, back, step)
    starting = self.failures.starting(step)
    if starting and (restored := self.failures.fail(starting, step, mid_step=False)) is not None:
      raise Restored(restored)
    pending = self.admissions.admit(step)  # relaunched processes come back between steps
    run.group.pause(step, "boundary")  # where `launch.local --relaunch` holds process 0
    hook = self.failures.op_hook(step)
    attempt = 0
    while True:
      result, mb_ids = self._attempt(step, profile, hook)
      if result.committed:
        break
      lost, detect_s = self.failures.lost_in(result, step, attempt)
      pending += lost
      restored = self.failures.fail(set(result.lost), step, mid_step=True, detect_s=detect_s,
                                    detected_at=result.detected_at)
      if restored is not None:
        raise Restored(restored)
      attempt += 1  # the same samples, on the policy's new plan
    self.failures.recovered(pending, step, self.admissions)
    result.attempts = attempt + 1
    return result, mb_ids

  def _attempt(self, step: int, profile: bool, hook: Any) -> tuple[StepResult, np.ndarray]:
    """One attempt at `step` on the current plan: its outcome (uncommitted when it lost
    nodes, in-process or in other processes alike) and its samples."""
    run = self.state
    n = recipe.num_microbatches(run.coordinator.plan)
    mb_ids, batch = recipe.step_data(self.cfg, run.source, run.batches, step, n)
    # Attempts are numbered over the whole run, so a step redone after a restore never reuses
    # the transfer ids and agreement keys of its first run.
    run.attempts += 1
    before = run.builds.built()
    try:
      with reporting(run.log, lambda t: _still_running(step, t, run.builds.built() - before)):
        result = run.interpreter.run_step(batch, step=step, attempt=run.attempts, profile=profile,
                                          after_op=hook, seeds=recipe.sample_seeds(step, mb_ids))
    except WorkerLost as lost:
      return StepResult(0.0, {}, 0.0, [], [], committed=False, lost=frozenset({lost.node}),
                        detected_at=time.time()), mb_ids
    # Building programs is work of its own, reported apart: a first step's compile would
    # otherwise read as a slow step (its samples/s a tiny fraction of the next step's).
    result.built = run.builds.built() - before
    result.step_time_s = max(result.step_time_s - result.built.seconds, 1e-6)
    return result, mb_ids

  def request_stop(self, why: str) -> None:
    """Asks the job to stop after the step in flight (every process agrees on it)."""
    self.state.transport.stop_requested = True
    self.stop_signal = why

  def _stop_after(self, step: int) -> None:
    run = self.state
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


def _still_running(step: int, elapsed_s: float, so_far: Built) -> str:
  doing = f"building {so_far.describe()} so far" if so_far.programs() else "waiting on devices"
  return f"step {step}: {elapsed_s:.0f}s so far, {doing}"
