"""The training loop: build everything from a `RunConfig`, run steps, write the workdir.

Order of a run:
  1. model, data plan, per-stage programs, executor on the dp x pp devices;
  2. the coordinator picks each step's schedule (the base one until workers fail);
  3. each step: the sample ids of the step (a pure function of seed and step), split into
     micro-batches, executed; one metrics line and one log line;
  4. the last step runs in profile mode and its timeline is written.

Workdir outputs: `metrics.jsonl` (one object per completed step), `timeline.json`
(Chrome/Perfetto trace of the last step), `timeline.png` (its Gantt chart), `schedule.txt`
(the schedules used), `config.json` (the resolved configuration).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from models.gpt import GPT
from resilient_jax import data as data_lib
from resilient_jax.config import RunConfig
from resilient_jax.coordinator import Coordinator
from resilient_jax.runtime.executor import Executor, StepResult, WorkerLost
from resilient_jax.schedule.core import Op, Worker
from resilient_jax.stages import build_stage_programs

Logger = Callable[[str], None]


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay; weight decay on matrices only."""
  t = cfg.train
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=t.learning_rate,
    warmup_steps=t.warmup_steps,
    decay_steps=max(t.steps, t.warmup_steps + 1),
    end_value=t.learning_rate * t.min_lr_ratio,
  )
  return optax.adamw(
    schedule,
    b1=t.b1,
    b2=t.b2,
    weight_decay=t.weight_decay,
    mask=lambda params: {k: v.ndim >= 2 for k, v in params.items()},
  )


def make_model(cfg: RunConfig) -> GPT:
  return GPT(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))


def make_data(cfg: RunConfig) -> tuple[data_lib.DataSource, data_lib.BatchPlan]:
  t = cfg.train
  source = data_lib.make_source(
    t.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, seed=t.seed
  )
  return source, data_lib.BatchPlan(source.num_samples, t.global_batch, t.seed)


def step_batch(
  cfg: RunConfig, source: data_lib.DataSource, plan: data_lib.BatchPlan, step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Sample ids, inputs and targets of 1-based `step`, as `[dp*m, microbatch, ...]` arrays."""
  ids = plan.ids_for_step(step - 1)
  mbs = data_lib.split_microbatches(ids, cfg.mesh.dp, cfg.pipeline.microbatches)
  inputs, targets = source.get(mbs.reshape(-1))
  shape = (*mbs.shape, cfg.model.seq_len)
  return ids, inputs.reshape(shape), targets.reshape(shape)


def grid_devices(
  cfg: RunConfig, devices: list[jax.Device] | None = None
) -> dict[Worker, jax.Device]:
  """Worker (d, s) gets device d * pp + s: a pipeline's stages sit on neighbouring devices."""
  devices = list(jax.devices() if devices is None else devices)
  need = cfg.mesh.num_workers
  if len(devices) < need:
    raise RuntimeError(
      f"mesh.dp * mesh.pp = {need} workers need {need} devices, found {len(devices)}"
    )
  return {
    (d, s): devices[d * cfg.mesh.pp + s] for d in range(cfg.mesh.dp) for s in range(cfg.mesh.pp)
  }


@dataclasses.dataclass
class TrainResult:
  metrics: list[dict]
  executor: Executor
  coordinator: Coordinator
  last_step: StepResult | None


class Trainer:
  """Owns the executor and coordinator of one run; `run()` trains to the end.

  Args:
    cfg: the validated run configuration.
    workdir: where outputs go (created).
    devices: devices to use (default: all local devices).
    log: where progress lines go.
    mid_step_faults: `(step, worker, after_op)` triples: the worker dies right after `after_op`
      was dispatched on it in that step (tests use this; config faults happen between steps).
  """

  def __init__(
    self,
    cfg: RunConfig,
    workdir: str | os.PathLike,
    *,
    devices: list[jax.Device] | None = None,
    log: Logger = print,
    mid_step_faults: tuple[tuple[int, Worker, Op], ...] = (),
  ):
    self.cfg = cfg
    self.workdir = Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.log = log
    self.mid_step_faults = list(mid_step_faults)
    self.model = make_model(cfg)
    self.source, self.plan = make_data(cfg)
    self.programs = build_stage_programs(
      self.model,
      cfg.partition,
      cfg.microbatch_size,
      cfg.model.seq_len,
      make_optimizer(cfg),
      global_tokens=cfg.train.global_batch * cfg.model.seq_len,
    )
    self.executor = Executor(self.programs, grid_devices(cfg, devices))
    self.coordinator = Coordinator(cfg, log=log)

  def _fault_hook(self, step: int) -> Callable[[Worker, Op], None] | None:
    pending = [(w, op) for s, w, op in self.mid_step_faults if s == step]
    if not pending:
      return None

    def hook(worker: Worker, op: Op) -> None:
      for w, o in list(pending):
        if w == worker and o == op and w in self.coordinator.live:
          pending.remove((w, o))
          self.mid_step_faults.remove((step, w, o))
          raise WorkerLost(w)

    return hook

  def run_step(self, step: int, *, profile: bool = False) -> tuple[StepResult, np.ndarray]:
    ids, inputs, targets = step_batch(self.cfg, self.source, self.plan, step)
    for fault in self.coordinator.faults_at(step):
      self._fail(fault, step, mid_step=False)
    while True:
      schedule = self.coordinator.schedule
      try:
        result = self.executor.run_step(
          schedule, inputs, targets, profile=profile, after_op=self._fault_hook(step)
        )
        return result, ids
      except WorkerLost as lost:
        # Nothing of the interrupted step was committed: replan and run it again on the
        # survivors, with the same samples.
        self._fail(lost.worker, step, mid_step=True)

  def _fail(self, worker: Worker, step: int, *, mid_step: bool) -> None:
    self.executor.drop_worker(worker)
    self.coordinator.fail(worker, step, mid_step=mid_step)

  def run(self) -> TrainResult:
    cfg = self.cfg
    (self.workdir / "config.json").write_text(
      json.dumps(dataclasses.asdict(cfg), indent=1, default=str)
    )
    metrics_path = self.workdir / "metrics.jsonl"
    metrics: list[dict] = []
    result = None
    schedules_seen: list[str] = []
    with metrics_path.open("w") as metrics_file:
      for step in range(1, cfg.train.steps + 1):
        last = step == cfg.train.steps
        result, ids = self.run_step(step, profile=last)
        schedule = self.coordinator.schedule
        if not schedules_seen or schedules_seen[-1] != schedule.to_text():
          schedules_seen.append(schedule.to_text())
        row = {
          "step": step,
          "loss": result.loss,
          "samples": int(len(ids)),
          "sample_digest": data_lib.sample_digest(ids),
          "live_workers": len(schedule.workers),
          "step_time_s": round(result.step_time_s, 6),
          "samples_per_s": round(len(ids) / result.step_time_s, 3),
          "schedule": schedule.name,
        }
        metrics.append(row)
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
        self.coordinator.record_step_time(step, result.step_time_s)
        self.log(
          f"step {step:4d}/{cfg.train.steps}  loss {result.loss:.4f}  "
          f"samples/s {row['samples_per_s']:9.1f}  step_time {result.step_time_s:.3f}s  "
          f"workers {row['live_workers']}  schedule {schedule.name}"
        )
    (self.workdir / "schedule.txt").write_text("\n\n".join(schedules_seen) + "\n")
    if result is not None and result.records:
      from resilient_jax.profiling import write_step_timeline

      write_step_timeline(
        self.coordinator.schedule, result.records, self.workdir, title=f"step {cfg.train.steps}"
      )
    return TrainResult(metrics, self.executor, self.coordinator, result)


def train(cfg: RunConfig, workdir: str | os.PathLike, **kwargs) -> TrainResult:
  """Trains `cfg` to the end; see `Trainer` for the keyword arguments."""
  return Trainer(cfg, workdir, **kwargs).run()
