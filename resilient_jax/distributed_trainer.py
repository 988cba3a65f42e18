"""The training loop of one process in a multi-process job (`distributed.enabled=true`).

Process i runs worker (i // pp, i % pp) of the dp x pp grid. Every process builds the same
model, data plan and coordinator, so each derives the same schedule from the same agreed set of
failed workers; nothing about the schedule is sent over the network. Each step is attempted
until an attempt commits (see `runtime/multiprocess.py`): when processes die, the survivors
agree on which, replan with the coordinator's planner, and re-run the step with the same
samples.

Process 0 writes the workdir: `metrics.jsonl`, `recovery.json` (per failure: kill, detection
and recovery times), `schedule.txt` and checkpoints (it pulls each stage's state from one
replica). Every process resumes from the newest checkpoint in the workdir, which must
therefore be on storage all processes share.

Test hook: `RESILIENT_JAX_PAUSE=STEP:WHERE` makes this process write the time to the file
named by `RESILIENT_JAX_PAUSE_FILE` and stop at that point of that step (`start`, an op such as
`F1` or `B0` right after it was dispatched, or `AR` inside the gradient all-reduce), so that
`launch/local.py --kill` can SIGKILL it at exactly that moment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from resilient_jax import data as data_lib
from resilient_jax.checkpoint import CheckpointWriter, load_latest
from resilient_jax.config import ConfigError, RunConfig
from resilient_jax.coordinator import Coordinator, NeedsRestore
from resilient_jax.runtime.cluster import Cluster
from resilient_jax.runtime.multiprocess import PauseHook, ProcessExecutor
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.stages import build_stage_programs
from resilient_jax.trainer import (
  _read_metrics,
  _write_metrics,
  check_resumable,
  checkpoint_meta,
  make_data,
  make_model,
  make_optimizer,
  step_batch,
)

Logger = Callable[[str], None]

PAUSE_ENV = "RESILIENT_JAX_PAUSE"
PAUSE_FILE_ENV = "RESILIENT_JAX_PAUSE_FILE"
KILLS_FILE = "kills.jsonl"
"""Written into the workdir by `launch/local.py`: one line per injected kill, with its time."""


def pause_hook_from_env() -> PauseHook | None:
  """The test hook described in the module docstring, or None when not requested."""
  spec = os.environ.get(PAUSE_ENV, "")
  if not spec:
    return None
  step_s, _, where = spec.partition(":")
  target = (int(step_s), where or "start")
  path = os.environ.get(PAUSE_FILE_ENV, "")

  def hook(step: int, at: str) -> None:
    if (step, at) != target:
      return
    if path:
      Path(path).write_text(json.dumps({"time": time.time(), "step": step, "at": at}))
    time.sleep(600)  # the launcher kills this process now
    raise RuntimeError(f"paused at {spec} but nobody killed this process")

  return hook


class DistributedTrainer:
  """One process's share of a multi-process run.

  Args:
    cfg: the run configuration (`distributed.enabled`).
    workdir: shared output folder; process 0 writes it.
    cluster: the joined job (one device per process).
    log: progress lines (process 0 prints them all; others only failures).
  """

  def __init__(self, cfg: RunConfig, workdir: str | os.PathLike, cluster: Cluster,
               log: Logger = print):
    self.cfg = cfg
    self.cluster = cluster
    self.workdir = Path(workdir)
    self.is_chief = cluster.process_id == 0
    self.log = log
    need = cfg.mesh.num_workers
    if cluster.num_processes != need:
      raise ConfigError(
        f"mesh.dp * mesh.pp = {need} workers need {need} processes (one worker each), "
        f"the job has {cluster.num_processes}"
      )
    pp = cfg.mesh.pp
    self.process_of: dict[Worker, int] = {
      (d, s): d * pp + s for d in range(cfg.mesh.dp) for s in range(pp)
    }
    self.worker_of = {p: w for w, p in self.process_of.items()}
    self.model = make_model(cfg)
    self.source, self.plan = make_data(cfg)
    programs = build_stage_programs(
      self.model,
      cfg.partition,
      cfg.microbatch_size,
      cfg.model.seq_len,
      make_optimizer(cfg),
      global_tokens=cfg.train.global_batch * cfg.model.seq_len,
    )
    self.executor = ProcessExecutor(programs, cluster, self.process_of)
    self.executor.warm_up()
    self.coordinator = Coordinator(cfg, log=log if self.is_chief else (lambda _: None))
    self.ckpt_dir = self.workdir / "checkpoints"
    self.writer = CheckpointWriter(self.ckpt_dir, keep=cfg.checkpoint.keep) if self.is_chief \
      else None
    self.pause = pause_hook_from_env()
    self.recovery: list[dict] = []

  # ---------------------------------------------------------------- checkpoints

  def _restore(self) -> int:
    loaded = load_latest(self.ckpt_dir, log=self.log if self.is_chief else (lambda _: None))
    if loaded is None:
      return 0
    check_resumable(self.cfg, loaded)
    self.executor.import_state(loaded.params, loaded.opt_state)
    if self.is_chief:
      lay = loaded.meta["layout"]
      self.log(f"restored step {loaded.step} from {loaded.path} (saved on dp={lay['dp']} "
               f"pp={lay['pp']}) onto dp={self.cfg.mesh.dp} pp={self.cfg.mesh.pp}, "
               f"{self.cluster.num_processes} processes")
    return loaded.step

  def _save(self, step: int) -> None:
    """Process 0 pulls one replica of every stage and writes; the others hand theirs over."""
    schedule = self.coordinator.schedule
    holders = {s: min(w for w in schedule.workers if w[1] == s) for s in range(schedule.pp)}
    me = self.executor.worker
    if me in holders.values() and not self.is_chief:
      self.executor.offer_state(step)
    if self.is_chief:
      state = self.executor.gather_state(step, holders)
      if state is None:
        self.log(f"checkpoint of step {step} skipped: a stage's holder died while handing its "
                 "state over (the previous checkpoint stays the latest)")
      # The holders may go on (and exit after the last step) once their state is here.
      self.cluster.kv_set(f"checkpoint/{step}", True)
      if state is not None:
        meta = checkpoint_meta(self.cfg, step, len(schedule.workers))
        self.writer.save(step, *state, meta)
    elif me in holders.values():
      # Stay until process 0 has pulled this state (its loss ends this process with exit 5).
      # A wait on process 0 alone, not a barrier over everyone: a process that dies meanwhile
      # is found by the next step attempt's agreement.
      self.cluster.kv_get(f"checkpoint/{step}")

  # ---------------------------------------------------------------- the loop

  def _kill_times(self) -> dict[int, float]:
    path = self.workdir / KILLS_FILE
    if not path.exists():
      return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["process"]: r["time"] for r in rows}

  def _write_recovery(self) -> None:
    (self.workdir / "recovery.json").write_text(json.dumps(self.recovery, indent=1) + "\n")

  def run(self) -> list[dict]:
    cfg = self.cfg
    if self.is_chief:
      self.workdir.mkdir(parents=True, exist_ok=True)
      (self.workdir / "config.json").write_text(
        json.dumps(dataclasses.asdict(cfg), indent=1, default=str)
      )
    metrics_path = self.workdir / "metrics.jsonl"
    start = self._restore() + 1
    metrics = _read_metrics(metrics_path, up_to=start - 1) if self.is_chief else []
    end = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    every = cfg.checkpoint.every_steps
    schedules_seen: list[str] = []
    for step in range(start, end + 1):
      mb_ids, inputs, targets = step_batch(cfg, self.source, self.plan, step)
      attempt = 0
      pending: list[dict] = []
      while True:
        schedule = self.coordinator.schedule
        result = self.executor.run_attempt(schedule, inputs, targets, step, attempt, self.pause)
        if result.committed:
          break
        kills = self._kill_times()
        for p in sorted(result.lost):
          try:
            self.coordinator.fail(self.worker_of[p], step, mid_step=True)
          except NeedsRestore:  # a stage has no worker left: launch/train.py exits 3
            self._leave_together(schedule, result.lost, f"stage-lost/{step}/{attempt}")
            raise
          event = {
            "process": p,
            "worker": list(self.worker_of[p]),
            "step": step,
            "attempt": attempt,
            "detected_at": result.detected_at,
          }
          if p in kills:
            event["killed_at"] = kills[p]
            event["kill_to_detect_s"] = round(result.detected_at - kills[p], 3)
          pending.append(event)
        attempt += 1
      done_at = time.time()
      for event in pending:
        event["recovered_at"] = done_at
        if "killed_at" in event:
          event["kill_to_next_step_s"] = round(done_at - event["killed_at"], 3)
        event["detect_to_next_step_s"] = round(done_at - event["detected_at"], 3)
        self.recovery.append(event)
      if pending and self.is_chief:
        self._write_recovery()
        for e in pending:
          if "kill_to_next_step_s" in e:
            self.log(f"  recovered from the loss of process {e['process']}: detected "
                     f"{e['kill_to_detect_s']:.2f}s after the kill, step {step} completed "
                     f"{e['kill_to_next_step_s']:.2f}s after it")
      done = sorted(result.microbatch_losses)
      if done != list(range(len(mb_ids))):
        raise RuntimeError(
          f"step {step} processed micro-batches {done}, expected each of "
          f"0..{len(mb_ids) - 1} once"
        )
      ids = mb_ids[np.asarray(done)].reshape(-1)
      loss = float(sum(result.microbatch_losses[mb] for mb in done))
      if self.is_chief:
        if not schedules_seen or schedules_seen[-1] != schedule.to_text():
          schedules_seen.append(schedule.to_text())
        row = {
          "step": step,
          "loss": loss,
          "samples": int(len(ids)),
          "sample_digest": data_lib.sample_digest(ids),
          "live_workers": len(schedule.workers),
          "step_time_s": round(result.step_time_s, 6),
          "samples_per_s": round(len(ids) / result.step_time_s, 3),
          "schedule": schedule.name,
          "attempts": attempt + 1,
          "time": round(done_at, 3),
        }
        metrics.append(row)
        with metrics_path.open("a") as f:
          f.write(json.dumps(row) + "\n")
        self.log(
          f"step {step:4d}/{cfg.train.steps}  loss {loss:.4f}  "
          f"samples/s {row['samples_per_s']:9.1f}  step_time {result.step_time_s:.3f}s  "
          f"workers {row['live_workers']}  schedule {schedule.name}"
        )
      last = step == end
      if (every and step % every == 0) or (last and (every or cfg.train.stop_after)):
        self._save(step)
    if self.is_chief:
      self.writer.wait()
      _write_metrics(metrics_path, metrics)
      (self.workdir / "schedule.txt").write_text("\n\n".join(schedules_seen) + "\n")
      if self.recovery:
        self._write_recovery()
      if end < cfg.train.steps:
        self.log(
          f"stopped after step {end} (train.stop_after); run again on the same workdir to resume"
        )
    # Nobody needs anything more from the others once the last step has committed (process 0
    # pulled the last checkpoint's state in `_save`).
    self._leave_together(self.coordinator.schedule, set(), "finished")
    return metrics

  def _leave_together(self, schedule: Schedule, lost: set[int], key: str) -> None:
    """Called by every survivor before it leaves: process 0, which hosts the key-value store,
    waits until every other participant of `schedule` not in `lost` has reached this point
    too (or is proven dead), so that none of them loses the store while still reading a
    decision (it would exit 5 instead of reaching the same end). The others go at once.

    Not a `get_live_nodes` barrier: that would wait out the heartbeat timeout for a process
    that died after the last decision, and a process blocked in it cannot follow decisions in
    the store.
    """
    me = self.cluster.process_id
    if not self.is_chief:
      self.cluster.kv_set(f"{key}/{me}", True)
      return
    for p in sorted({self.process_of[w] for w in schedule.workers} - set(lost) - {me}):
      self.cluster.await_key(f"{key}/{p}", p, f"process {p} to reach {key}")
