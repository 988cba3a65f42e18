"""The training loop's checkpoints: when a save is due, what it writes, and the restore.

Process 0 owns the writer (`checkpoint.CheckpointWriter`, orbax's manager underneath); in a
multi-process job the other processes hand their stages' state to it (`Job.gather_state`) and
follow its decisions (`Group.agree`): which checkpoint every process restores (`restore/TAG`),
and whether a due save is taken now or deferred while the previous one is still being written
(`save/STEP`, `checkpoint.if_busy=defer`), and whether this job still holds the workdir's
lease (`checkpoint/lease.py`: process 0 reads it before every commit, `lease/STEP/ATTEMPT`), so
that a job superseded by a newer one on the same workdir stops, every process of it, with exit 7.

Costs: a save moves every stage's state once to process 0 (the model's parameters and
optimizer state, whatever dp is: one holder per stage sends), and writes it asynchronously; the
restore reads it once per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resilient_jax.checkpoint import CheckpointError, load_latest
from resilient_jax.checkpoint.lease import Lease, Superseded
from resilient_jax.checkpoint.run_meta import check_resumable, checkpoint_meta
from resilient_jax.checkpoint.store import Loaded, committed_steps, load, step_dir
from resilient_jax.observe.events import CheckpointLoaded, CheckpointSaved
from resilient_jax.observe.progress import reporting
from resilient_jax.schedule.plan import Plan, describe
from resilient_jax.training.local_copies import LocalCopies
from resilient_jax.training.run import Run

if TYPE_CHECKING:
  from resilient_jax.training.hooks import StepInfo

SAVE_WAIT_S = 600.0
"""How long an ending run waits for its checkpoint save in flight."""
SLOW_SAVE_S = 1.0
"""A periodic save that waited this long for the previous one says how to avoid it (once)."""


class Checkpoints:
  """Saves and restores of one run (`run`: its writer, group, interpreter and coordinator)."""

  def __init__(self, run: Run):
    self.run = run
    self.lease: Lease | None = None
    """Process 0's hold on the workdir, taken by the first load (`_hold_workdir`)."""
    self.deferred: int | None = None
    """The step whose periodic checkpoint waits for the writer (`if_due`)."""
    self._told_slow_save = False
    self.local = LocalCopies(run)
    """What a process writes when process 0 is lost, and the resume from it."""

  def committed(self) -> list[int]:
    return committed_steps(self.run.ckpt_dir)

  def why_none(self) -> str:
    """Why there was no checkpoint to start from."""
    if self.committed():
      return "every checkpoint failed verification"
    if not self.run.cfg.checkpoint.every_steps:
      return "checkpointing is off (checkpoint.every_steps=0)"
    return "none was written"

  def load(self, tag: str) -> int:
    """Loads the newest valid checkpoint into the interpreter; returns its step (0: none).

    In a multi-process job process 0 picks the checkpoint (after its save in flight is
    committed) and every process loads that one, so all resume from the same step. The load at
    the start (`tag` "start") first tries the local copies that a job which lost process 0
    left, for a step newer than every checkpoint (`local_copies.py`); then takes the workdir's
    lease for the job (process 0): after the checks that may refuse the resume, so a refused
    resume changes no file.
    """
    run = self.run
    self.wait()
    picked: dict[str, Loaded | None] = {}

    def pick() -> int:
      picked["loaded"] = load_latest(run.ckpt_dir, log=run.log)
      return picked["loaded"].step if picked["loaded"] else 0

    with reporting(run.log, lambda t: f"restoring a checkpoint from {run.ckpt_dir}: "
                   f"{t:.0f}s so far"):
      # At the start: the survivors' local copies of a lost process 0's job, when they hold a
      # newer step of every stage than the shared checkpoints do.
      loaded = self.local.resume() if tag == "start" else None
      if loaded is None:
        step = run.group.agree(f"restore/{tag}", pick)
        loaded = picked["loaded"] if picked else (load(step_dir(run.ckpt_dir, step)) if step
                                                  else None)
    if loaded is not None:
      check_resumable(run.cfg, loaded)
    if tag == "start" and run.chief:
      self._hold_workdir()
    if tag == "start":  # from now on, a loss of process 0 leaves local copies
      self.local.begin(self.lease.token if self.lease else None)
    if loaded is None:
      self.local.forget()
      return 0
    run.interpreter.import_state(loaded.params, loaded.opt_state)
    self.local.note(loaded.step)
    lay = loaded.meta["layout"]
    run.events.emit(CheckpointLoaded(
      loaded.step, str(loaded.path), f"dp={lay['dp']} pp={lay['pp']} tp={lay.get('tp', 1)}",
      describe(run.coordinator.plan) + (f" tp={run.cfg.mesh.tp}" if run.cfg.mesh.tp > 1 else "")
      + (f", {run.group.processes} processes" if run.group.processes else "")))
    return loaded.step

  def _hold_workdir(self) -> None:
    """Takes the workdir's lease; the writer checks it again just before each commit."""
    run = self.run
    lease = self.lease = Lease.take(run.workdir, run.log)
    run.writer.fence = lambda step: lease.check(f"the checkpoint of step {step}")

  def _fence(self, step: int) -> None:
    """Raises `Superseded` in every process of the job if process 0 finds that a newer job
    took the workdir's lease (one small file read, on process 0 alone)."""
    run = self.run

    def verdict() -> str:
      try:
        if self.lease is not None:
          self.lease.check(f"the checkpoint of step {step}")
      except Superseded as e:
        return str(e)
      return ""

    why = run.group.agree(f"lease/{step}/{run.attempts}", verdict, "process 0's lease check")
    if why:  # None: process 0 died, which the hand-over below finds
      raise Superseded(why)

  def save(self, step: int, plan: Plan | None = None) -> None:
    """Writes a checkpoint of `step` (process 0; the others hand their state over); `plan`:
    the layout the state is on, when not the coordinator's (it has already moved on).

    Raises:
      Superseded: a newer job took the workdir (every process of this job raises it).
    """
    run = self.run
    self._fence(step)
    plan = plan or run.coordinator.plan
    state = run.group.gather_state(step, run.interpreter)
    if run.chief and state is None:
      run.log(f"checkpoint of step {step} skipped: a stage's holder died while handing its "
              "state over (the previous checkpoint stays the latest)")
    if run.chief and state is not None:
      run.writer.save(step, *state, checkpoint_meta(run.cfg, plan, step))
      run.events.emit(CheckpointSaved(step, str(run.ckpt_dir / str(step))), line=False)
      run.log(f"checkpoint of step {step}: writing {run.ckpt_dir / str(step)} (in the background; "
              "the previous one stays the latest until it is committed)")

  def __call__(self, info: StepInfo) -> None:
    """The run's last hook (`hooks.StepInfo`): the checkpoint of the step when due."""
    self.if_due(info.step, info.last)

  def if_due(self, step: int, last: bool = False) -> bool:
    """Saves `step` when a checkpoint is due; returns whether it did. (Every committed step
    comes here: its state is noted for a local copy, `local_copies.py`.)

    Due: every `checkpoint.every_steps`, and the last step of the run. A periodic save that
    comes due while the previous one is still being written waits for it
    (`checkpoint.if_busy=wait`, logged once when that stalls training), or is deferred to the
    first step at which the writer is free (`defer`, logged): the latest committed checkpoint
    is then at most one write older, and it is never overwritten before its successor
    commits. The last step's save always happens. In a multi-process job process 0 owns the
    writer, so it decides and the others follow (`save/STEP` in the key-value store).
    """
    run, cfg = self.run, self.run.cfg
    self.local.note(step)  # the state a loss of process 0 leaves a local copy of
    every = cfg.checkpoint.every_steps
    if last and (every or cfg.train.stop_after):
      self.save(step)
      return True
    if not (every and (step % every == 0 or self.deferred is not None)):
      return False
    if cfg.checkpoint.if_busy == "defer" and self._writer_busy(step):
      if self.deferred is None:
        self.deferred = step
        run.log(f"checkpoint of step {step} deferred: the previous save is still being "
                "written; it is taken at the first step after that save commits")
      return False
    if self.deferred is not None:
      run.log(f"checkpoint of step {step} (due at step {self.deferred}, deferred while the "
              "previous save was written)")
    self.deferred = None
    self.save(step)
    waited = run.writer.waited_s[-1] if run.chief and run.writer.waited_s else 0.0
    if waited > SLOW_SAVE_S and not self._told_slow_save:
      self._told_slow_save = True
      run.log(f"checkpoint of step {step} waited {waited:.1f}s for the previous save to be "
              f"written: writes outlast checkpoint.every_steps={every}; raise it, or set "
              "checkpoint.if_busy=defer so that training does not wait")
    return True

  def _writer_busy(self, step: int) -> bool:
    """Whether process 0's writer is still writing (every process gets its answer; None from
    a job whose process 0 died: its loss ends the job, the next step finds it)."""
    run = self.run
    return bool(run.group.agree(f"save/{step}", lambda: run.writer.busy(),
                                f"process 0's decision to checkpoint step {step}"))

  def wait(self) -> None:
    """Until the save in flight is committed (process 0)."""
    if self.run.writer is not None:
      self.run.writer.wait()

  def finish(self) -> None:
    """Waits (bounded) for the checkpoint save in flight, so no exit path drops it half-way;
    on an error path its failure is logged rather than raised over the error."""
    writer = self.run.writer
    if writer is None:
      return
    try:
      if not writer.wait(timeout_s=SAVE_WAIT_S):
        self.run.log(f"a checkpoint save was still running after {SAVE_WAIT_S:.0f}s; "
                     "abandoned (its unfinished folder is removed at the next start)")
    except CheckpointError as e:
      self.run.log(f"error: {e}")
