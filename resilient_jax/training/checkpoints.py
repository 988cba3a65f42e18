"""The training loop's checkpoints: when a save is due, what it writes, and the restore.

`Trainer` mixes this in (it uses the trainer's writer, cluster, coordinator, interpreter and
log). Process 0 owns the writer (`checkpoint.CheckpointWriter`, orbax's manager underneath); in
a multi-process job the other processes hand their stages' state to it (`share_state`) and
follow its decisions through the key-value store: which checkpoint every process restores
(`restore/TAG`), and whether a due save is taken now or deferred while the previous one is
still being written (`save/STEP`, `checkpoint.if_busy=defer`).
"""

from __future__ import annotations

from resilient_jax.checkpoint import CheckpointError, load_latest
from resilient_jax.checkpoint.run_meta import check_resumable, checkpoint_meta
from resilient_jax.checkpoint.store import Loaded, load, step_dir
from resilient_jax.observe.progress import reporting
from resilient_jax.schedule.plan import Plan, describe

SAVE_WAIT_S = 600.0
"""How long an ending run waits for its checkpoint save in flight."""
SLOW_SAVE_S = 1.0
"""A periodic save that waited this long for the previous one says how to avoid it (once)."""


class RunCheckpoints:
  """The checkpoint part of `Trainer` (mixed into it)."""

  _deferred_save: int | None = None
  """The step whose periodic checkpoint waits for the writer (`checkpoint_if_due`)."""
  _told_slow_save: bool = False

  def _load(self, tag: str) -> int:
    """Loads the newest valid checkpoint into the interpreter; returns its step (0: none).

    In a multi-process job process 0 picks the checkpoint (after its save in flight is
    committed) and every process loads that one, so all resume from the same step.
    """
    loaded: Loaded | None = None
    if self.writer is not None:
      self.writer.wait()
    with reporting(self.log, lambda t: f"restoring a checkpoint from {self.ckpt_dir}: "
                   f"{t:.0f}s so far"):
      if self.cluster is None:
        loaded = load_latest(self.ckpt_dir, log=self.log)
      elif self.chief:
        loaded = load_latest(self.ckpt_dir, log=self.log)
        self.cluster.kv_set(f"restore/{tag}", loaded.step if loaded else 0)
      else:
        step = self.cluster.kv_get(f"restore/{tag}")
        loaded = load(step_dir(self.ckpt_dir, step)) if step else None
    if loaded is None:
      return 0
    check_resumable(self.cfg, loaded)
    self.interpreter.import_state(loaded.params, loaded.opt_state)
    lay = loaded.meta["layout"]
    self.log(f"restored step {loaded.step} from {loaded.path} (saved on dp={lay['dp']} "
             f"pp={lay['pp']} tp={lay.get('tp', 1)}) onto {describe(self.coordinator.plan)}"
             + (f" tp={self.cfg.mesh.tp}" if self.cfg.mesh.tp > 1 else "") + (
               f", {self.cluster.num_processes} processes" if self.cluster else ""))
    return loaded.step

  def _save(self, step: int, plan: Plan | None = None) -> None:
    """Writes a checkpoint of `step` (process 0; the others hand their state over); `plan`:
    the layout the state is on, when not the coordinator's (it has already moved on)."""
    plan = plan or self.coordinator.plan
    if self.cluster is None:
      state = self.interpreter.export_state()
    else:
      if self.transport.pause is not None:
        self.transport.pause(step, "save")  # where `launch.local --kill=STEP:P:save` kills
      sp = self.interpreter.step_program
      keys = sorted({(p.split, p.stage) for p in sp.slots.values()})
      holders = {
        i: min(p.node for p in sp.slots.values() if (p.split, p.stage) == k)
        for i, k in enumerate(keys)
      }
      state = self.transport.share_state(step, holders, self.interpreter.export_state)
      if self.chief:
        self.cluster.kv_delete(f"state/{step}")  # the holders' specs, read
        if state is None:
          self.log(f"checkpoint of step {step} skipped: a stage's holder died while handing "
                   "its state over (the previous checkpoint stays the latest)")
        # The holders may go on (and exit after the last step) once their state is here.
        self.cluster.kv_set(f"checkpoint/{step}", True)
      elif self.transport.holds_any(list(holders.values())):
        # Stay until process 0 has pulled this state (its loss ends this process, exit 5).
        self.cluster.kv_get(f"checkpoint/{step}")
    if self.chief and state is not None:
      self.writer.save(step, *state, checkpoint_meta(self.cfg, plan, step))

  def checkpoint_if_due(self, step: int, last: bool = False) -> bool:
    """Saves `step` when a checkpoint is due; returns whether it did.

    Due: every `checkpoint.every_steps`, and the last step of the run. A periodic save that
    comes due while the previous one is still being written waits for it
    (`checkpoint.if_busy=wait`, logged once when that stalls training), or is deferred to the
    first step at which the writer is free (`defer`, logged): the latest committed checkpoint
    is then at most one write older, and it is never overwritten before its successor
    commits. The last step's save always happens. In a multi-process job process 0 owns the
    writer, so it decides and the others follow (`save/STEP` in the key-value store).
    """
    cfg = self.cfg
    every = cfg.checkpoint.every_steps
    if last and (every or cfg.train.stop_after):
      self._save(step)
      return True
    if not (every and (step % every == 0 or self._deferred_save is not None)):
      return False
    if cfg.checkpoint.if_busy == "defer" and self._writer_busy(step):
      if self._deferred_save is None:
        self._deferred_save = step
        if self.chief:
          self.log(f"checkpoint of step {step} deferred: the previous save is still being "
                   "written; it is taken at the first step after that save commits")
      return False
    if self._deferred_save is not None and self.chief:
      self.log(f"checkpoint of step {step} (due at step {self._deferred_save}, deferred while "
               "the previous save was written)")
    self._deferred_save = None
    self._save(step)
    waited = self.writer.waited_s[-1] if self.chief and self.writer.waited_s else 0.0
    if waited > SLOW_SAVE_S and not self._told_slow_save:
      self._told_slow_save = True
      self.log(f"checkpoint of step {step} waited {waited:.1f}s for the previous save to be "
               f"written: writes outlast checkpoint.every_steps={every}; raise it, or set "
               "checkpoint.if_busy=defer so that training does not wait")
    return True

  def _writer_busy(self, step: int) -> bool:
    """Whether process 0's writer is still writing (every process gets its answer)."""
    busy = self.chief and self.writer.busy()
    if self.cluster is None:
      return busy
    key = f"save/{step}"
    if self.chief:
      self.cluster.kv_set(key, busy)
      return busy
    # None: process 0 died (its loss ends the job; the next step finds it).
    return bool(self.cluster.await_key(key, 0, f"process 0's decision to checkpoint step {step}"))

  def _finish_saving(self) -> None:
    """Waits (bounded) for the checkpoint save in flight, so no exit path drops it half-way;
    on an error path its failure is logged rather than raised over the error."""
    if self.writer is None:
      return
    try:
      if not self.writer.wait(timeout_s=SAVE_WAIT_S):
        self.log(f"a checkpoint save was still running after {SAVE_WAIT_S:.0f}s; abandoned "
                 "(its unfinished folder is removed at the next start)")
    except CheckpointError as e:
      self.log(f"error: {e}")

