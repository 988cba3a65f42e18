"""The one training loop, for a single process and for every process of a multi-process job.

Order of a run:
  1. model, data plan, the policy's coordinator and its first plan, the interpreter holding this
     process's slots (every slot in one process; its own node's in a `jax.distributed` job);
  2. resume: the newest checkpoint in `WORKDIR/checkpoints` that verifies (any layout; in a
     multi-process job process 0 picks it and every process loads that one), else the initial
     parameters from the seed; a process relaunched into a running job instead waits to be
     admitted and takes its state from live peers (`relaunch.py`);
  3. each step is *attempted*: the sample ids of the step (a pure function of seed and step),
     split into micro-batches and run by the interpreter. An attempt that loses nodes (a fault
     injected in-process, or processes that died) commits nothing: the policy decides what
     runs next — a new plan on the survivors (state placed from surviving replicas) or a
     restore of the latest checkpoint onto a plan of the survivors — and the step is attempted
     again with the same samples. A step with a scheduled rejoin starts with it: the policy
     takes the worker back and its state is placed from live replicas (`rejoin.py`); in a
     job, every step starts by admitting the relaunched processes the live ones agree on;
  4. a committed step writes one metrics line (process 0), one log line, and a checkpoint every
     `checkpoint.every_steps`; the last step, the last fault-free step before the first injected
     failure and the first step after each run in profile mode for their timelines and the
     failure report's replayed step times (in-process; `profiling.RunTimelines`).

Workdir outputs (process 0): `metrics.jsonl`, `recovery.json` (per failure: detection and time
to the next committed step), `goodput.json` (per failure and rejoin, and the run's effective
training time: `goodput.py`), `timeline*.json/png`, `schedule.txt`, `profile.json`,
`config.json`, `checkpoints/`, `tb/` (TensorBoard events: `resilient_jax.observe.tensorboard`);
every process: `profile/stepN/` (`jax.profiler` traces of `profile.trace_steps`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from resilient_jax import data as data_lib
from resilient_jax.checkpoint import CheckpointError, CheckpointWriter
from resilient_jax.checkpoint.store import committed_steps
from resilient_jax.config import ConfigError, RunConfig, from_config_dict
from resilient_jax.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED
from resilient_jax.files import read_jsonl, write_json_atomic, write_text_atomic
from resilient_jax.model.sharding import worker_mesh
from resilient_jax.observe.goodput import GoodputLog
from resilient_jax.observe.logs import info
from resilient_jax.observe.profiling import StepTraces
from resilient_jax.observe.progress import reporting
from resilient_jax.observe.tensorboard import Board
from resilient_jax.policy import RunCoordinator
from resilient_jax.programs.compiled import Counts, built
from resilient_jax.programs.stages import StagePrograms, build_stage_programs
from resilient_jax.recipe import (
  make_data,
  make_model,
  make_optimizer,
  num_microbatches,
  optimizer_key,
  processed_ids,
  sample_seeds,
  step_batch,
)
from resilient_jax.runtime.interpreter import Interpreter
from resilient_jax.runtime.records import Built, StepResult, WorkerLost
from resilient_jax.runtime.transport import Transport
from resilient_jax.schedule.plan import GridPlan, Plan
from resilient_jax.training.checkpoints import RunCheckpoints
from resilient_jax.training.failures import Recovers
from resilient_jax.training.faults import FaultEvent, check_fault_events, pause_hook_from_env
from resilient_jax.training.rejoin import apply_rejoin
from resilient_jax.training.relaunch import Relaunches

Logger = Callable[[str], None]

@dataclasses.dataclass
class TrainResult:
  metrics: list[dict]
  interpreter: Interpreter
  coordinator: RunCoordinator
  last_step: StepResult | None


class Trainer(RunCheckpoints, Recovers, Relaunches):
  """Owns the coordinator and interpreter of one run (or one process's share of it).

  In a multi-process job a process relaunched into the running job (`Cluster.relaunched`)
  starts by being admitted (`Relaunches.join`) instead of from a checkpoint, and every process
  admits relaunched ones between steps (`Relaunches.admit`).

  Args:
    cfg: the validated run configuration.
    workdir: where outputs go (created). A workdir holding checkpoints is resumed from.
    devices: devices to use in a single-process run (default: all local devices).
    log: where progress lines go (default: absl logging at INFO; in a multi-process job only
      process 0's reach it).
    faults: failures to inject besides the config's `faults.schedule` (in-process).
    cluster: the joined `jax.distributed` job (`runtime.cluster.Cluster`) for a multi-process
      run; None runs every slot in this process.
    model: a user's model (see `run_config`, which describes it as `cfg.model`); None builds
      the config's model family.
  """

  def __init__(
    self,
    cfg: RunConfig,
    workdir: str | os.PathLike,
    *,
    devices: list[jax.Device] | None = None,
    log: Logger = info,
    faults: Sequence[FaultEvent] = (),
    cluster=None,
    model: Any = None,
  ):
    check_fault_events(faults, cfg)
    self.cfg = cfg
    self.workdir = Path(workdir)
    self.cluster = cluster
    self.chief = cluster is None or cluster.process_id == 0
    self.log = log if self.chief else (lambda _: None)
    if self.chief:
      self.workdir.mkdir(parents=True, exist_ok=True)
    self.model = make_model(cfg) if model is None else model
    if cfg.checkpoint.init_from:
      from resilient_jax.checkpoint.init_from import init_params, read_params

      source = cfg.checkpoint.init_from
      try:
        n = init_params(self.model, read_params(source), source)
      except CheckpointError as e:
        raise ConfigError(str(e)) from None
      self.log(f"initialised {n} parameters from {source}")
    self.source, self.plan = make_data(cfg)
    self.ckpt_dir = self.workdir / "checkpoints"
    self.writer = None
    if self.chief:
      self.writer = CheckpointWriter(self.ckpt_dir, keep=cfg.checkpoint.keep)
      for name in self.writer.remove_unfinished():
        self.log(f"removed {self.ckpt_dir / name}: a save that never committed (its writer "
                 "stopped mid-way)")
    need = cfg.mesh.num_workers
    pp, tp = cfg.mesh.pp, cfg.mesh.tp
    if cluster is None:
      devs = list(jax.devices() if devices is None else devices)
      if len(devs) < need * tp:
        what = f"mesh.dp * mesh.pp = {need} workers need {need} devices" if tp == 1 else \
          f"mesh.dp * mesh.pp * mesh.tp = {need * tp} devices needed ({need} workers of {tp})"
        raise ConfigError(
          f"{what}, found {len(devs)} (on CPU, call "
          f"resilient_jax.configure_jax({need * tp}) before any JAX operation, e.g. before "
          "building the model)"
        )
      # Worker n: device n, or the n-th run of tp devices (its sub-mesh).
      transport = Transport({n: devs[n] if tp == 1 else worker_mesh(devs[n * tp:(n + 1) * tp])
                             for n in range(need)})
      nodes = list(range(need))
    else:
      from resilient_jax.runtime.multiprocess import ProcessLayout, ProcessTransport

      try:
        layout = ProcessLayout.of(cfg.mesh.dp, pp, cfg.mesh.placement, cluster.num_processes,
                                  len(jax.local_devices()), devices_per_worker=tp)
      except ValueError as e:
        raise ConfigError(str(e)) from None
      transport = ProcessTransport(cluster, layout, pause_hook_from_env())
      nodes = list(range(need))
    self.transport = transport
    self.nodes = nodes
    self.membership = []
    self.coordinator = RunCoordinator(cfg, nodes, log=self.log)
    if cluster is not None:  # process 0 plans each failure and rejoin, the others read its plan
      from resilient_jax.runtime.plan_exchange import KVPlanExchange

      self.coordinator.exchange = KVPlanExchange(cluster)
    else:
      from resilient_jax.observe.profiling import simulated_cpu_devices

      # Failures are then reported in replayed step times (`policy/phases.py`).
      self.coordinator.simulated_devices = simulated_cpu_devices()
    self._programs: dict[tuple, list[StagePrograms]] = {}
    self.interpreter = self._interpreter(self.coordinator.plan)
    if tp > 1 and not any(any(s) for prog in self.programs for s in prog.param_specs.values()):
      self.log(f"mesh.tp={tp}: no parameter of the model names a logical axis that splits "
               "(resilient_jax/model/sharding.py), so every worker's stage runs replicated over "
               f"its {tp} devices: correct, but neither faster nor smaller per device")
    if cluster is not None:
      # Any worker of a neighbouring stage may become this one's producer or consumer; the
      # first transfer over a new connection and the split backward's compile would
      # otherwise land inside a recovery.
      mine = {n % pp for n in transport.devices}
      if not cluster.relaunched:  # a joiner's neighbours are inside a step: `admit` connects
        cluster.connect(layout.processes_of(
          [n for n in nodes if any(abs(n % pp - s) == 1 for s in mine)]))
      self.interpreter.warm_up(everything=cluster.relaunched)
    events = [FaultEvent(f.step, (f.dp, f.stage), rejoin=f.rejoin)
              for f in cfg.faults.schedule] + list(faults)
    self.faults = [(f, f.worker[0] * pp + f.worker[1]) for f in events]
    self.goodput = GoodputLog()
    self.recovery: list[dict] = []
    self.attempts = 0
    self.stop_signal = ""
    self.board = Board(None)  # process 0's TensorBoard events, opened by `run`
    self.traces = StepTraces(cfg.profile.trace_steps, self.workdir / "profile", log=self.log,
                             process=None if cluster is None else cluster.process_id)

  # ---------------------------------------------------------------- programs and state

  def _programs_for(self, split: tuple[tuple[int, int], ...]) -> list[StagePrograms]:
    """Stage programs of a split of the layers at the current micro-batch size, built once."""
    key = (split, self.microbatch_size)
    if key not in self._programs:
      cfg = self.cfg
      self._programs[key] = build_stage_programs(
        self.model,
        [range(lo, hi) for lo, hi in split],
        self.microbatch_size,
        cfg.model.seq_len,
        make_optimizer(cfg),
        cfg.step_batch,
        tp=cfg.mesh.tp,
        optimizer_key=optimizer_key(cfg),
      )
    return self._programs[key]

  def _interpreter(self, plan: Plan) -> Interpreter:
    self.microbatch_size = self.cfg.step_batch // num_microbatches(plan)
    return Interpreter(self._programs_for, self.transport, plan,
                       clip_global_norm=self.cfg.optimizer.clip_global_norm,
                       nonfinite=self.cfg.faults.nonfinite,
                       replicas=self.cluster is None or not self.cluster.relaunched)

  @property
  def programs(self) -> list[StagePrograms]:
    """The configured grid's stage programs."""
    return self._programs_for(tuple((r.start, r.stop) for r in self.cfg.partition))

  def run_step(self, step: int, *, profile: bool = False) -> tuple[StepResult, np.ndarray]:
    """Attempts 1-based `step` until an attempt commits, whatever fails during it.

    Returns:
      The committed attempt and the step's sample ids per micro-batch.

    Raises:
      _Restored: the policy restored a checkpoint; the caller goes on after its step.
    """
    back = {n for f, n in self.faults if f.step == step and f.rejoin}
    if back - self.coordinator.live:
      apply_rejoin(self, back - self.coordinator.live, step)
    # Faults at the start of a step fail together (a whole host's workers at once).
    starting = {n for f, n in self.faults if f.step == step and f.after_op is None
                and not f.rejoin and n in self.coordinator.live}
    if starting:
      restored = self._fail(starting, step, mid_step=False)
      if restored is not None:
        raise _Restored(restored)
    pending: list[dict] = self.admit(step)  # relaunched processes come back between steps
    if self.cluster is not None and self.transport.pause is not None:
      self.transport.pause(step, "boundary")  # where `launch.local --relaunch` holds process 0
    hook = self._fault_hook(step)
    attempt = 0
    while True:
      n = num_microbatches(self.coordinator.plan)
      mb_ids, inputs, targets = step_batch(self.cfg, self.source, self.plan, step, n)
      try:
        # Attempts are numbered over the whole run, so a step redone after a restore never
        # reuses the transfer ids and agreement keys of its first run.
        self.attempts += 1
        before = built()
        with reporting(self.log, lambda t, b=before: _still_running(step, t, built() - b)):
          result = self.interpreter.run_step(
            inputs, targets, step=step, attempt=self.attempts,
            profile=profile and not self.cluster, after_op=hook, seeds=sample_seeds(step, mb_ids),
          )
        # Building programs is work of its own, reported apart: a first step's compile would
        # otherwise read as a slow step (its samples/s a tiny fraction of the next step's).
        result.built = built() - before
        result.step_time_s = max(result.step_time_s - result.built.seconds, 1e-6)
      except WorkerLost as lost:
        result = StepResult(0.0, {}, 0.0, [], [], committed=False, lost=frozenset({lost.node}),
                            detected_at=time.time())
      if result.committed:
        break
      kills = self._kill_times()
      for p in sorted(n for n in result.lost if n in self.coordinator.live):
        event = {"node": p, "step": step, "attempt": attempt, "detected_at": result.detected_at,
                 "xla_compiles": Counts.xla}
        proc = None if self.cluster is None else self.transport.process_of(p)
        if proc is not None:
          event["process"] = proc
        if proc in kills:
          event["killed_at"] = kills[proc]
          event["kill_to_detect_s"] = round(result.detected_at - kills[proc], 3)
        pending.append(event)
      known = [e.get("kill_to_detect_s") for e in pending[-len(result.lost):]]
      detect = None if self.cluster is not None and None in known else max(
        [k for k in known if k is not None], default=0.0)
      restored = self._fail(set(result.lost), step, mid_step=True, detect_s=detect,
                            detected_at=result.detected_at)
      if restored is not None:
        raise _Restored(restored)
      attempt += 1
    done_at = time.time()
    self.goodput.committed(step, done_at)
    for event in pending:
      event["recovered_at"] = done_at
      if "killed_at" in event:
        event["kill_to_next_step_s"] = round(done_at - event["killed_at"], 3)
      event["detect_to_next_step_s"] = round(done_at - event["detected_at"], 3)
      # Programs compiled (or read from JAX's cache) between detection and the step's commit:
      # a recovery should find every program it needs already built.
      event["xla_compiles"] = Counts.xla - event["xla_compiles"]
      self.recovery.append(event)
      if event.get("kind") == "rejoin":
        self._rejoined(event, step, done_at)
        continue
      self.board.text(step, "recovery", f"step {step} committed {event['detect_to_next_step_s']}s "
                      f"after the loss of node {event['node']} was detected")
      if "kill_to_next_step_s" in event:
        self.log(f"  recovered from the loss of node {event['node']} (process "
                 f"{event['process']}): detected "
                 f"{event['kill_to_detect_s']:.2f}s after the kill, step {step} completed "
                 f"{event['kill_to_next_step_s']:.2f}s after it")
    if pending and self.chief:
      self._write_recovery()
    result.attempts = attempt + 1
    return result, mb_ids

  # ---------------------------------------------------------------- the loop

  def _write_timeline(self, step: int, result: StepResult, kind: str | None, compiles: int,
                      replayed) -> None:
    """Draws a profiled step: `timeline_step<step>.*` for a `kind`, else `timeline.*`."""
    from resilient_jax.observe.profiling import write_step_timeline

    plan = self.coordinator.plan
    at = {}
    for fstep, node in self.coordinator.failed:
      if node not in self.coordinator.live:  # a rejoined node runs again
        at.setdefault(node, fstep)
    failed = {w: at[n] for w, n in plan.nodes.items() if n in at}
    tl = self.timelines
    stem = f"timeline_step{step}" if kind else "timeline"
    title = tl.title(step, kind, failed, [f for f, _ in self.coordinator.failed], compiles)
    write_step_timeline(plan.schedule, result.records, self.workdir, title=title, stem=stem,
                        failed=failed, replayed=replayed,
                        metadata={"step": step, "drawn_as": kind or "last step",
                                  "xla_compiles_in_step": compiles})
    tl.written += [f"{stem}.png", f"{stem}.json"]

  def run(self) -> TrainResult:
    """Trains to `train.steps` (or `train.stop_after`), resuming from the workdir.

    SIGTERM or SIGINT (a scheduler's preemption; Ctrl-C) stops the run after the step in
    flight, in every process of the job, with a checkpoint of that step: `Preempted`. Whatever
    ends the run, a checkpoint save in flight is committed (or its error reported) first.
    """
    handlers = self._catch_stop_signals()
    # Objects built before the steps leave the cyclic collector's full passes, which stalled
    # dispatch ~150 ms every ~10 steps (docs/benchmarks.md); they still go at refcount zero.
    gc.freeze()
    try:
      return self._run()
    finally:
      gc.unfreeze()
      for signum, previous in handlers.items():
        signal.signal(signum, previous)
      self._finish_saving()
      self.board.close()

  def _catch_stop_signals(self) -> dict[int, Any]:
    """Installs handlers that ask the job to stop after the step in flight; a second signal
    ends this process at once. Returns the handlers replaced (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
      return {}

    def on_signal(signum: int, frame: Any) -> None:
      del frame
      if self.transport.stop_requested:  # asked twice: stop now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
      self.transport.stop_requested = True
      self.stop_signal = signal.Signals(signum).name

    return {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

  def _run(self) -> TrainResult:
    cfg = self.cfg
    if self.chief:
      write_json_atomic(self.workdir / "config.json", dataclasses.asdict(cfg))
    metrics_path = self.workdir / "metrics.jsonl"
    if self.cluster is not None and self.cluster.relaunched:
      start = self.join()  # into the running job, with state from live peers
    else:
      start = self._load("start") + 1
    metrics = []
    if self.chief:
      earlier = read_jsonl(metrics_path, log=self.log)
      if start == 1 and earlier:
        why = ("every checkpoint failed verification" if committed_steps(self.ckpt_dir) else
               "checkpointing is off (checkpoint.every_steps=0)" if not cfg.checkpoint.every_steps
               else "none was written")
        self.log(f"no checkpoint to resume from in {self.ckpt_dir} ({why}): starting from step "
                 f"1; the {len(earlier)} step(s) metrics.jsonl holds from an earlier run are "
                 "lost and will be redone")
      metrics = [r for r in earlier if r["step"] < start]
      _write_metrics(metrics_path, metrics)
      self.board = Board(self.workdir / "tb", start, log=self.log)
    end = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    from resilient_jax.observe.profiling import RunTimelines, replay_records

    self.timelines = RunTimelines((f.step for f, _ in self.faults if not f.rejoin), end,
                                  cfg.train.steps)
    schedules_seen: list[str] = []
    result = None
    step = start
    nonfinite = 0  # steps skipped in a row
    while step <= end:
      last = step == end
      compiles = Counts.xla
      try:
        with self.traces.step(step, lambda: (self.interpreter.params, self.interpreter.opt_state,
                                             self.interpreter.replicas)):
          result, mb_ids = self.run_step(
            step, profile=self.timelines.profile(step, bool(self.coordinator.failed)))
      except _Restored as r:
        step = r.step + 1
        metrics = [m for m in metrics if m["step"] < step]
        if self.chief:
          _write_metrics(metrics_path, metrics)
        continue
      compiles = Counts.xla - compiles
      ids = processed_ids(mb_ids, result)
      coord = self.coordinator
      replayed = None
      if result.records and isinstance(coord.plan, GridPlan):
        # The step as it would run with one core per worker; what the failure reports and
        # the timelines show (`profiling.py`).
        replayed = replay_records(coord.plan.schedule, result.records)
        kind = self.timelines.kind(step, bool(coord.failed))
        for drawing in ([kind] if kind else []) + ([None] if last else []):
          self._write_timeline(step, result, drawing, compiles, replayed)
      if not schedules_seen or schedules_seen[-1] != coord.plan_text():
        schedules_seen.append(coord.plan_text())
      row = {
        "step": step,
        "loss": result.loss,
        "samples": int(len(ids)),
        "sample_digest": data_lib.sample_digest(ids),
        "live_workers": coord.live_count,
        "step_time_s": round(result.step_time_s, 6),
        "samples_per_s": round(len(ids) / result.step_time_s, 3),
        "compile_s": round(result.built.seconds, 3),
        "schedule": coord.plan_name,
        "grad_norm": result.grad_norm,
      }
      row.update({k: True for k in ("skipped", "clipped") if getattr(result, k)})
      if self.cluster is not None:
        row.update(attempts=result.attempts, time=round(time.time(), 3))
      metrics.append(row)
      if self.chief:
        with metrics_path.open("a") as f:
          f.write(json.dumps(row) + "\n")
        self.board.step(row)
        keep = cfg.distributed.kv_keep_steps
        if self.cluster is not None and step > keep:
          # Every participant is past the earlier steps (they all reported on this one), and a
          # process the plan left idle only follows decisions, so it is at most a step or two
          # behind: old agreements are read by nobody again. Without this the store grows by
          # about a dozen keys a step.
          self.cluster.kv_delete(f"step/{step - keep}")
          self.cluster.kv_delete(f"checkpoint/{step - keep}")  # a hand-over's "saved" mark
          self.cluster.kv_delete(f"save/{step - keep}")  # whether it was saved
      self.log(
        f"step {step:4d}/{cfg.train.steps}  loss {result.loss:.4f}  "
        f"samples/s {row['samples_per_s']:9.1f}  step_time {result.step_time_s:.3f}s  "
        f"workers {row['live_workers']}  schedule {coord.plan_name}"
        + ("  SKIPPED: non-finite gradients, no stage stepped" if result.skipped else "")
        + (f"  (+{result.built.seconds:.1f}s building {result.built.describe()})"
           if result.built.programs() else "")
      )
      # After the step's line: a failure's report names this step.
      coord.record_step_time(step, result.step_time_s, profiled=bool(result.records),
                             replayed_s=replayed.makespan if replayed else None)
      nonfinite = nonfinite + 1 if result.skipped else 0
      if nonfinite >= cfg.train.max_nonfinite_steps:
        raise NonFiniteSteps(f"{nonfinite} steps in a row had non-finite gradients (up to step "
                             f"{step}); stopping (train.max_nonfinite_steps)")
      if result.stop and not last:
        self.log(f"stopping after step {step}: {self._stop_reason()}; checkpointing it")
        self._save(step)
        if self.writer is not None:
          self.writer.wait()
        if self.cluster is not None:
          self.leave_together(f"stopped/{step}")
        raise Preempted(f"stopped after step {step} on request ({self._stop_reason()}), with a "
                        "checkpoint of it; run the same command to resume")
      self.checkpoint_if_due(step, last)
      step += 1
    if self.chief:
      self.writer.wait()
      if end < cfg.train.steps:
        self.log(
          f"stopped after step {end} (train.stop_after); run again on the same workdir to resume"
        )
      if self.coordinator.failed:
        for line in self.coordinator.summary():
          self.log(line)
      write_text_atomic(self.workdir / "schedule.txt", "\n\n".join(schedules_seen) + "\n")
      if self.goodput.events:
        run = self.goodput.write(self.workdir / "goodput.json", metrics)["run"]
        self.log(f"goodput: effective training time {run['effective_fraction']:.1%} of the "
                 f"wall time ({run['failures']} failure(s), {run['rejoins']} rejoin(s), "
                 f"{run['steps_rerun']} step(s) re-run): {self.workdir / 'goodput.json'}")
      if result is not None and "timeline.png" not in self.timelines.written:
        why = ("steps of a multi-process job are not profiled" if self.cluster else
               f"timelines replay grid schedules, and {self.coordinator.plan_name} runs pipeline "
               "sets")
        self.log(f"no timeline of the last step: {why}")
      if self.cluster is not None:
        kept = sorted({int(k.strip("/").split("/")[1])
                       for d in ("step", "checkpoint", "save") for k in self.cluster.kv_keys(d)})
        self.log(f"coordination service: keys of step(s) {', '.join(map(str, kept))} kept "
                 f"(distributed.kv_keep_steps={cfg.distributed.kv_keep_steps})")
    if self.cluster is not None:
      self.leave_together("finished")
    return TrainResult(metrics, self.interpreter, self.coordinator, result)

  def _stop_reason(self) -> str:
    if self.transport.stop_requested:
      return f"this process received {self.stop_signal}"
    return "another process of the job received a stop signal"

  def leave_together(self, key: str) -> None:
    """Called by every surviving process before it leaves, a barrier in three steps: every
    other live process writes `{key}/{pid}`; process 0, which hosts the key-value store, waits
    for them all (or their death) and writes `{key}/all`; each writes `{key}/left/{pid}` once it
    read that, and process 0 waits for those before it goes. So no process loses the store
    while still reading a decision (it would exit 5 instead of reaching the same end), and none
    leaves while a peer may still be pulling what it offered in the last step (Bamboo's replica
    of its stage), which its exit would cut off."""
    from resilient_jax.runtime.admission import ENDED_KEY

    cl = self.cluster
    me = cl.process_id
    if not self.chief:
      cl.kv_set(f"{key}/{me}", True)
      cl.await_key(f"{key}/all", 0, f"every process to reach {key}")
      cl.kv_set(f"{key}/left/{me}", True)
      return
    cl.kv_set(ENDED_KEY, key)  # a relaunched process still waiting to be admitted leaves too
    others = sorted(set(self.transport.layout.processes_of(sorted(self.coordinator.live))) - {me})
    for p in others:
      cl.await_key(f"{key}/{p}", p, f"process {p} to reach {key}")
    cl.kv_set(f"{key}/all", True)
    for p in others:
      cl.await_key(f"{key}/left/{p}", p, f"process {p} to leave at {key}")

class NonFiniteSteps(RuntimeError):
  """`train.max_nonfinite_steps` steps in a row had non-finite gradients."""

  exit_code = EXIT_NONFINITE


class Preempted(RuntimeError):
  """The run stopped on SIGTERM/SIGINT after a committed step, which it checkpointed."""

  exit_code = EXIT_PREEMPTED


class _Restored(Exception):  # noqa: N818 - control flow, never escapes `Trainer.run`
  def __init__(self, step: int):
    super().__init__(f"restored step {step}")
    self.step = step


def _still_running(step: int, elapsed_s: float, so_far: Built) -> str:
  doing = f"building {so_far.describe()} so far" if so_far.programs() else "waiting on devices"
  return f"step {step}: {elapsed_s:.0f}s so far, {doing}"


def _write_metrics(path: Path, rows: list[dict]) -> None:
  write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def run_config(config: RunConfig | Mapping[str, Any], model: Any = None) -> RunConfig:
  """`config` (a `RunConfig`, ConfigDict or dict) as a `RunConfig`; with a user's `model`,
  checked against the protocol of `resilient_jax.model` and described in place of the config's
  `model` section (whose `seq_len`, the data's sequence length, is kept).

  Raises:
    ConfigError: a bad config or a model that cannot be staged (one readable message).
  """
  if model is None:
    return config if isinstance(config, RunConfig) else from_config_dict(config)
  from resilient_jax.model.check import check_stageable, describe

  if isinstance(config, RunConfig):
    seq_len, pp = config.model.seq_len, config.mesh.pp
  else:
    seq_len = dict(config.get("model", {}) or {}).get("seq_len", 32)
    pp = dict(config.get("mesh", {}) or {}).get("pp", 1)
  check_stageable(model, num_stages=pp, seq_len=seq_len)
  described = describe(model, seq_len)
  if isinstance(config, RunConfig):
    return dataclasses.replace(config, model=described)
  return from_config_dict(config, model=described)


def train(
  config: RunConfig | Mapping[str, Any], workdir: str | os.PathLike, *, model: Any = None,
  **kwargs,
) -> TrainResult:
  """Trains to the end; see `Trainer` for the keyword arguments.

  Args:
    config: the run's config: a `RunConfig`, or the launcher's keys as a ConfigDict or dict.
    workdir: where outputs go; a workdir holding checkpoints is resumed from.
    model: your own `nnx.Module` (`embed`, `blocks`, `head`; see `resilient_jax.model`) in
      place of the config's model family; its current parameters are the initial ones.

  With `distributed.enabled` this process joins the `jax.distributed` job (before JAX starts
  its backends) unless a `cluster` is given, and trains its share of it.
  """
  cfg = run_config(config, model)
  if cfg.distributed.enabled and kwargs.get("cluster") is None:
    from resilient_jax.runtime.cluster import Cluster

    kwargs["cluster"] = Cluster(cfg.distributed)
  return Trainer(cfg, workdir, model=model, **kwargs).run()
