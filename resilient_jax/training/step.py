"""One resilient step: attempt -> lost -> decide -> place -> retry, until the step commits or
the policy goes back to a checkpoint.

`ResilientStep(state)` takes the run's `TrainState` (the last committed step, the optimizer's
update count, the plan in force and this process's slots' committed parameters and optimizer
state) and returns the next one with the step's `StepRecord`; it never raises to steer the loop:
  1. rejoins due at the step's start are admitted (`rejoin.py`), failures due at its start are
     handed to the policy (`Failures.fail`), relaunched processes are admitted between steps
     (`relaunch.py`);
  2. the step's samples (a pure function of seed and step, `recipe.step_data`) run on the
     interpreter (`runtime`); an attempt that loses nodes (a fault injected in-process, or
     processes that died) commits nothing;
  3. the policy decides (`Failures.fail` -> `policy.RunCoordinator.fail` -> the schedule's
     planners): a new plan on the survivors, placed from live replicas
     (`Interpreter.place`), and the same samples are attempted again; or a restore of the
     latest checkpoint: the record says which step it went back to (`restored`).

Costs per step: one `Interpreter.run_step` per attempt; a failure adds one plan (process 0 in a
job, read by the others) and the copies of the lost stages' state, not of dp.
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from resilient_jax import recipe
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.observe.profiling import RunTimelines, StepTraces, replay_records
from resilient_jax.observe.progress import reporting
from resilient_jax.observe.records import Built, StepResult, WorkerLost
from resilient_jax.schedule.cost import Timeline
from resilient_jax.schedule.plan import GridPlan, Plan, Slot
from resilient_jax.training.checkpoints import Checkpoints
from resilient_jax.training.failures import Failures
from resilient_jax.training.hooks import metrics_row
from resilient_jax.training.rejoin import apply_rejoin
from resilient_jax.training.run import Run


@dataclasses.dataclass(frozen=True)
class TrainState:
  """The run between two steps, as a value.

  The data position is the step itself: a step's samples are a pure function of the seed and
  the step (`recipe.step_data`), so no iterator state exists to save. Arrays are immutable: the
  mappings hold the arrays committed at `step`, never changed in place.

  Attributes:
    step: the last committed step (0: none yet).
    updates: optimizer updates applied so far (a skipped, non-finite step applies none): the
      learning-rate schedule's position. After a restore the loop recounts it from the metrics
      rows it keeps.
    plan: the plan in force (the policy's, on the live nodes).
    params, opt_state: this process's slots' committed parameters and optimizer state.
  """

  step: int
  updates: int
  plan: Plan
  params: Mapping[Slot, Any]
  opt_state: Mapping[Slot, Any]


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What one resilient step did: it committed (`result`, the samples it trained on `ids`, and
  its metrics `row`), or the policy restored the checkpoint of step `restored`."""

  step: int
  result: StepResult | None = None
  ids: np.ndarray | None = None
  row: dict | None = None
  replayed: Timeline | None = None
  """A profiled step replayed with one core per worker (`profiling.replay_records`)."""
  compiles: int = 0
  """XLA compilations during the step."""
  restored: int | None = None

  @property
  def committed(self) -> bool:
    return self.restored is None


class ResilientStep:
  """A run's steps, each attempted until it commits (see the module docstring).

  Args:
    run: the run.
    failures: its failures (injected and detected) and the policy's decisions.
    checkpoints: its checkpoints (a rejoin may copy from one).
    admissions: relaunched processes waiting to come back (`relaunch.py`).
    timelines, traces: which steps run profiled, and `jax.profiler` traces.
    learning_rate: the optimizer's schedule, for the metrics row.
  """

  def __init__(self, run: Run, failures: Failures, checkpoints: Checkpoints, admissions: Any,
               timelines: RunTimelines, traces: StepTraces, learning_rate: Any):
    self.run, self.failures, self.checkpoints = run, failures, checkpoints
    self.admissions, self.timelines, self.traces = admissions, timelines, traces
    self.learning_rate = learning_rate

  def state(self, step: int, updates: int) -> TrainState:
    """The run's state now, committed `step` having applied `updates` optimizer updates."""
    ip = self.run.interpreter
    return TrainState(step, updates, self.run.coordinator.plan,
                      types.MappingProxyType(dict(ip.params)),
                      types.MappingProxyType(dict(ip.opt_state)))

  def __call__(self, state: TrainState) -> tuple[TrainState, StepRecord]:
    """Runs the step after `state.step` until it commits; the state after it (or after the
    checkpoint a restore went back to) and the step's record."""
    record = self._run(state.step + 1, state.updates)
    if not record.committed:
      return self.state(record.restored, state.updates), record
    return self.state(record.step, state.updates + (not record.result.skipped)), record

  def _run(self, step: int, updates: int) -> StepRecord:
    """Runs `step` (the optimizer having applied `updates` steps before it) until it commits."""
    run = self.run
    xla0 = run.builds.xla
    profile = self.timelines.profile(step, bool(run.coordinator.failed), run.group.profiles)
    with self.traces.step(step, lambda: (run.interpreter.params, run.interpreter.opt_state,
                                         run.interpreter.replicas)):
      record = self.until_commit(step, profile=profile)
    if not record.committed:
      return record
    result = record.result
    ids = recipe.processed_ids(record.ids, result)
    plan = run.coordinator.plan
    replayed = None
    if result.records and isinstance(plan, GridPlan) and run.group.profiles:
      # The step as it would run with one core per worker (`observe/profiling.py`).
      replayed = replay_records(plan.schedule, result.records)
    row = metrics_row(run, step, result, ids, float(self.learning_rate(updates)))
    return dataclasses.replace(record, ids=ids, row=row, replayed=replayed,
                               compiles=run.builds.xla - xla0)

  @outside_ambient_mesh
  def until_commit(self, step: int, *, profile: bool = False) -> StepRecord:
    """Attempts 1-based `step` until an attempt commits, whatever fails during it; the record
    holds the committed attempt and the step's sample ids per micro-batch, or the step a
    restore went back to."""
    run = self.run
    back = self.failures.coming_back(step)
    if back:
      apply_rejoin(run, self.checkpoints, back, step)
    starting = self.failures.starting(step)
    if starting and (restored := self.failures.fail(starting, step, mid_step=False)) is not None:
      return StepRecord(step, restored=restored)
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
        return StepRecord(step, restored=restored)
      attempt += 1  # the same samples, on the policy's new plan
    self.failures.recovered(pending, step, self.admissions)
    result.attempts = attempt + 1
    return StepRecord(step, result=result, ids=mb_ids)

  def _attempt(self, step: int, profile: bool, hook: Any) -> tuple[StepResult, np.ndarray]:
    """One attempt at `step` on the current plan: its outcome (uncommitted when it lost
    nodes, in-process or in other processes alike) and its samples."""
    run = self.run
    n = recipe.num_microbatches(run.coordinator.plan)
    mb_ids, batch = recipe.step_data(run.cfg, run.source, run.batches, step, n)
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


def _still_running(step: int, elapsed_s: float, so_far: Built) -> str:
  doing = f"building {so_far.describe()} so far" if so_far.programs() else "waiting on devices"
  return f"step {step}: {elapsed_s:.0f}s so far, {doing}"
