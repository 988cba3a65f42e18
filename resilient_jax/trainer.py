"""The training loop: build everything from a `RunConfig`, run steps, write the workdir.

Order of a run:
  1. model, data plan, per-stage programs, executor on the dp x pp devices;
  2. the coordinator picks each step's schedule (the base one until workers fail);
  3. each step: the sample ids of the step (a pure function of seed and step), split into
     micro-batches, executed; one metrics line and one log line;
  4. the last step runs in profile mode and its timeline is written.

Resume order: the newest checkpoint in `WORKDIR/checkpoints` that verifies (any layout), else
the initial parameters from the seed. When failures leave a stage with no worker, the run is
rebuilt on the largest layout the surviving devices support and restored the same way.

Workdir outputs: `metrics.jsonl` (one object per completed step), `timeline.json`
(Chrome/Perfetto trace of the last step), `timeline.png` (its Gantt chart), `schedule.txt`
(the schedules used), `config.json` (the resolved configuration).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from models.gpt import GPT
from resilient_jax import data as data_lib
from resilient_jax.checkpoint import CheckpointWriter, load_latest
from resilient_jax.checkpoint.store import Loaded
from resilient_jax.config import ConfigError, FaultsConfig, MeshConfig, RunConfig
from resilient_jax.coordinator import Coordinator, NeedsRestore, StageLost, largest_layout
from resilient_jax.policies import PIPELINE_SET_POLICIES, PipelineSetCoordinator, auto_choice
from resilient_jax.runtime.executor import Executor, StepResult, WorkerLost
from resilient_jax.runtime.pipelines import PipelineSetExecutor
from resilient_jax.schedule.core import AR, Op, Worker
from resilient_jax.stages import StagePrograms, build_stage_programs

Logger = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class FaultEvent:
  """Worker `worker` fails in 1-based `step`: at its start, or right after `after_op` was
  dispatched on that worker (the interrupted step is then re-run on the survivors).

  Workers are named in the initial grid; the failure is of the worker's device. If that device
  does not run `after_op` in that step (a replanned layout gave it other work), it fails right
  after its all-reduce instead: still in the middle of the step."""

  step: int
  worker: Worker
  after_op: Op | None = None


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
  """Sample ids per micro-batch `[dp*m, microbatch]`, and inputs and targets of 1-based `step`
  as `[dp*m, microbatch, seq_len]` arrays."""
  ids = plan.ids_for_step(step - 1)
  mbs = data_lib.split_microbatches(ids, cfg.mesh.dp, cfg.pipeline.microbatches)
  inputs, targets = source.get(mbs.reshape(-1))
  shape = (*mbs.shape, cfg.model.seq_len)
  return mbs, inputs.reshape(shape), targets.reshape(shape)


def processed_ids(mb_ids: np.ndarray, result: StepResult) -> np.ndarray:
  """The sample ids the step actually trained on, from the micro-batches it ran.

  Raises:
    RuntimeError: a micro-batch was skipped or run twice: the step's global batch changed.
  """
  done = sorted(result.processed)
  if done != list(range(len(mb_ids))):
    raise RuntimeError(
      f"step processed micro-batches {done}, expected each of 0..{len(mb_ids) - 1} once"
    )
  return mb_ids[np.asarray(result.processed)].reshape(-1)


def grid_devices(
  cfg: RunConfig, devices: list[jax.Device] | None = None
) -> dict[Worker, jax.Device]:
  """Worker (d, s) gets device d * pp + s: a pipeline's stages sit on neighbouring devices."""
  devices = list(jax.devices() if devices is None else devices)
  need = cfg.mesh.num_workers
  if len(devices) < need:
    raise ConfigError(
      f"mesh.dp * mesh.pp = {need} workers need {need} devices, found {len(devices)}"
    )
  return {
    (d, s): devices[d * cfg.mesh.pp + s] for d in range(cfg.mesh.dp) for s in range(cfg.mesh.pp)
  }


def check_resumable(cfg: RunConfig, loaded: Loaded) -> None:
  """Raises ConfigError if resuming `loaded` under `cfg` would change the model or the data."""
  data = loaded.meta["data"]
  for key, now in (
    ("seed", cfg.train.seed),
    ("global_batch", cfg.train.global_batch),
    ("kind", cfg.train.data),
  ):
    if data[key] != now:
      raise ConfigError(
        f"train.{'data' if key == 'kind' else key}={now!r} differs from the checkpoint's "
        f"{data[key]!r} in {loaded.path}; resuming would change the sample order"
      )
  if loaded.meta["model"] != json.loads(json.dumps(dataclasses.asdict(cfg.model))):
    raise ConfigError(f"model.* differs from the model saved in {loaded.path}")


def checkpoint_meta(cfg: RunConfig, step: int, live_workers: int) -> dict:
  """What a checkpoint records besides the state: layout, data position, model."""
  return {
    "layout": {
      "dp": cfg.mesh.dp,
      "pp": cfg.mesh.pp,
      "partition": [len(r) for r in cfg.partition],
      "live_workers": live_workers,
    },
    "data": {
      "kind": cfg.train.data,
      "seed": cfg.train.seed,
      "global_batch": cfg.train.global_batch,
      "next_step": step + 1,
    },
    "model": dataclasses.asdict(cfg.model),
    "train_steps": cfg.train.steps,
  }


@dataclasses.dataclass
class TrainResult:
  metrics: list[dict]
  executor: Executor | PipelineSetExecutor
  coordinator: Coordinator | PipelineSetCoordinator
  last_step: StepResult | None


class Trainer:
  """Owns the executor and coordinator of one run; `run()` trains to the end.

  Args:
    cfg: the validated run configuration.
    workdir: where outputs go (created). A workdir holding checkpoints is resumed from.
    devices: devices to use (default: all local devices).
    log: where progress lines go.
    faults: failures to inject besides the config's `faults.schedule` (tests use this for
      failures in the middle of a step). Workers are named in the initial grid; a failure
      is of the worker's device, so it still applies after the layout changed.
  """

  def __init__(
    self,
    cfg: RunConfig,
    workdir: str | os.PathLike,
    *,
    devices: list[jax.Device] | None = None,
    log: Logger = print,
    faults: Sequence[FaultEvent] = (),
  ):
    self.cfg = cfg
    self.workdir = Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.log = log
    self.model = make_model(cfg)
    self.source, self.plan = make_data(cfg)
    self.ckpt_dir = self.workdir / "checkpoints"
    self.writer = CheckpointWriter(self.ckpt_dir, keep=cfg.checkpoint.keep)
    grid = grid_devices(cfg, devices)
    self._build(cfg, [grid[w] for w in sorted(grid)])
    events = [FaultEvent(f.step, (f.dp, f.stage)) for f in cfg.faults.schedule] + list(faults)
    # Failures are of devices: they keep their meaning if the grid is rebuilt.
    self.faults = [(f, grid[f.worker]) for f in events]
    self.failed_devices: set[jax.Device] = set()

  def _build(self, cfg: RunConfig, devices: list[jax.Device]) -> None:
    """Programs, executor and coordinator for `cfg`'s layout and policy on `devices`.

    Grid policies put worker (d, s) on `devices[d * pp + s]`; `oobleck` and `bamboo` number
    the devices as nodes (Bamboo's grid the same way, Oobleck's pipelines over all of them).
    """
    self.layout_cfg = cfg
    self._programs: dict[tuple[tuple[int, int], ...], list[StagePrograms]] = {}
    self.programs = self._programs_for(tuple((r.start, r.stop) for r in cfg.partition))
    if cfg.resilience.policy in PIPELINE_SET_POLICIES:
      nodes = dict(enumerate(devices))
      self.coordinator = PipelineSetCoordinator(cfg, nodes, log=self.log)
      self.executor = PipelineSetExecutor(self._programs_for, nodes, self.coordinator.plan)
      return
    pp = cfg.mesh.pp
    grid = {(d, s): devices[d * pp + s] for d in range(cfg.mesh.dp) for s in range(pp)}
    self.executor = Executor(self.programs, grid)
    self.coordinator = Coordinator(cfg, log=self.log)

  def _programs_for(self, stages: tuple[tuple[int, int], ...]) -> list[StagePrograms]:
    """Stage programs of a split of the layers, built once per split for this layout."""
    if stages not in self._programs:
      cfg = self.layout_cfg
      self._programs[stages] = build_stage_programs(
        self.model,
        [range(lo, hi) for lo, hi in stages],
        cfg.microbatch_size,
        cfg.model.seq_len,
        make_optimizer(cfg),
        global_tokens=cfg.train.global_batch * cfg.model.seq_len,
      )
    return self._programs[stages]

  @property
  def _pipeline_set(self) -> bool:
    return isinstance(self.executor, PipelineSetExecutor)

  # ---------------------------------------------------------------- failures

  def _worker_on(self, device: jax.Device) -> Worker | int | None:
    """The executor's name for `device` now: its grid worker, or its node for a pipeline set."""
    return next((w for w, d in self.executor.devices.items() if d == device), None)

  def _fault_hook(self, step: int) -> Callable[[Worker, Op], None] | None:
    pending = [(f, dev) for f, dev in self.faults if f.step == step and f.after_op is not None]
    if not pending:
      return None

    def hook(worker: Worker | int, op: Op) -> None:
      for f, dev in pending:
        if self._worker_on(dev) == worker and (f.after_op == op or op.kind == AR):
          pending.remove((f, dev))
          raise WorkerLost(worker)

    return hook

  def _fail(self, worker: Worker | int, step: int, *, mid_step: bool) -> None:
    device = self.executor.devices[worker]
    if not self.failed_devices and device.platform == "cpu" and not self._pipeline_set:
      self.log("  note: simulated CPU devices share this host's cores, so wall-clock step times "
               "do not show the schedule; timeline_step*.png replays measured op times with "
               "one core per worker")
    self.failed_devices.add(device)
    if self._pipeline_set:
      plan = self.coordinator.fail(worker, step, mid_step=mid_step)
      dead = {n for n, d in self.executor.devices.items() if d in self.failed_devices}
      copied = self.executor.place(plan, self.executor.sources(dead))
      self.log(f"  copied {copied / 2**20:.2f} MiB of parameters and optimizer state from "
               "surviving replicas")
      return
    self.coordinator.fail(worker, step, mid_step=mid_step)
    self.executor.drop_worker(worker)
    if self.layout_cfg.resilience.policy == "auto":
      self._auto_after_failure()

  def _auto_after_failure(self) -> None:
    """`auto`: keeps re-routing unless re-templating is predicted faster, then switches."""
    coord = self.coordinator
    choice = auto_choice(self.layout_cfg, coord.failed_workers, coord.predicted_makespan())
    options = ", ".join(f"{k} {v:.1f}" for k, v in sorted(choice.predicted.items()))
    self.log(f"  auto: predicted step times (block units) {options}: {choice.policy}")
    if choice.policy != "oobleck":
      return
    pp = self.layout_cfg.mesh.pp
    nodes = {d * pp + s: dev for (d, s), dev in self.executor.devices.items()}
    live = [d * pp + s for d, s in sorted(coord.live)]
    self.coordinator = PipelineSetCoordinator(
      self.layout_cfg,
      live,
      log=self.log,
      policy="oobleck",
      instance=choice.instance,
      failed=[(t, d * pp + s) for t, (d, s) in coord.failed],
      continues=coord,
    )
    from resilient_jax.checkpoint import universal

    sources = [
      (self.executor.devices[w], self.executor.params[w],
       universal.flatten_state(self.executor.opt_state[w]))
      for w in sorted(self.executor.params)
    ]
    self.executor = PipelineSetExecutor(
      self._programs_for, nodes, self.coordinator.plan, state=sources
    )
    self.log("  re-templated: " + choice.instance.describe().replace("\n", "\n  "))

  def run_step(self, step: int, *, profile: bool = False) -> tuple[StepResult, np.ndarray]:
    """Runs 1-based `step` to completion, whatever fails during it.

    Raises:
      NeedsRestore: the failure cannot be handled on this grid (a stage has no worker left,
        or the policy is `restart`); `run` restores from a checkpoint.
    """
    mb_ids, inputs, targets = step_batch(self.layout_cfg, self.source, self.plan, step)
    for f, dev in self.faults:
      w = self._worker_on(dev)
      if f.step == step and f.after_op is None and w in self.coordinator.live:
        self._fail(w, step, mid_step=False)
    hook = self._fault_hook(step)
    while True:
      try:
        if self._pipeline_set:
          result = self.executor.run_step(inputs, targets, after_op=hook)
        else:
          result = self.executor.run_step(
            self.coordinator.schedule, inputs, targets, profile=profile, after_op=hook
          )
        return result, mb_ids
      except WorkerLost as lost:
        # Nothing of the interrupted step was committed: replan and run it again on the
        # survivors, with the same samples.
        self._fail(lost.worker, step, mid_step=True)

  # ---------------------------------------------------------------- checkpoints

  def _save(self, step: int) -> None:
    params, opt_state = self.executor.export_state()
    meta = checkpoint_meta(self.layout_cfg, step, len(self.coordinator.live))
    self.writer.save(step, params, opt_state, meta)

  def _restore(self) -> int:
    """Loads the newest valid checkpoint into the executor; returns its step (0: none)."""
    self.writer.wait()
    loaded = load_latest(self.ckpt_dir, log=self.log)
    if loaded is None:
      return 0
    cfg = self.layout_cfg
    check_resumable(cfg, loaded)
    self.executor.import_state(loaded.params, loaded.opt_state)
    lay = loaded.meta["layout"]
    self.log(
      f"restored step {loaded.step} from {loaded.path} (saved on dp={lay['dp']} "
      f"pp={lay['pp']}) onto dp={cfg.mesh.dp} pp={cfg.mesh.pp}"
    )
    return loaded.step

  def _restore_onto_survivors(self, lost: NeedsRestore, step: int) -> int:
    """Rebuild on the surviving devices and restore the latest checkpoint.

    Oobleck re-instantiates its templates on every survivor (same micro-batches); the grid
    policies take the largest DP x PP grid the survivors allow (Bamboo: with pp >= 2), and
    `auto` goes on as `recycle` on it.
    """
    alive = [d for w, d in sorted(self.executor.devices.items()) if d not in self.failed_devices]
    policy = self.layout_cfg.resilience.policy
    if policy == "oobleck":
      self.log(f"{lost}; restoring the latest checkpoint onto new pipelines on the "
               f"{len(alive)} surviving devices")
      self._build(dataclasses.replace(self.layout_cfg, faults=FaultsConfig()), alive)
    else:
      dp, pp = largest_layout(
        len(alive),
        self.cfg.model.num_layers,
        self.cfg.train.global_batch,
        self.cfg.pipeline.microbatches,
        min_pp=2 if policy == "bamboo" else 1,
      )
      self.log(
        f"{lost}; restoring the latest checkpoint onto dp={dp} pp={pp} "
        f"({dp * pp} of {len(alive)} surviving devices)"
      )
      cfg = dataclasses.replace(
        self.cfg,
        mesh=MeshConfig(dp=dp, pp=pp),
        pipeline=dataclasses.replace(self.cfg.pipeline, partition=()),
        faults=FaultsConfig(),
      )
      self._build(cfg, alive[: dp * pp])
    restored = self._restore()
    self.log(f"redoing {step - restored} step(s): {restored + 1}..{step}")
    return restored

  # ---------------------------------------------------------------- the loop

  def _write_timeline(self, step: int, result: StepResult, stem: str) -> None:
    from resilient_jax.profiling import write_step_timeline

    write_step_timeline(
      self.coordinator.schedule, result.records, self.workdir, title=f"step {step}", stem=stem
    )

  def run(self) -> TrainResult:
    cfg = self.cfg
    (self.workdir / "config.json").write_text(
      json.dumps(dataclasses.asdict(cfg), indent=1, default=str)
    )
    metrics_path = self.workdir / "metrics.jsonl"
    start = self._restore() + 1
    metrics = _read_metrics(metrics_path, up_to=start - 1)
    end = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    every = cfg.checkpoint.every_steps
    failure_steps = {f.step for f, _ in self.faults}
    schedules_seen: list[str] = []
    result = None
    step = start
    while step <= end:
      last = step == end
      # Profile the last step, and the first step after each failure, for their timelines.
      after_failure = step > 1 and (step - 1) in failure_steps
      try:
        result, mb_ids = self.run_step(step, profile=last or after_failure)
      except NeedsRestore as lost:
        if isinstance(lost, StageLost) and not cfg.resilience.restore_on_stage_loss:
          raise
        step = self._restore_onto_survivors(lost, step) + 1
        metrics = [m for m in metrics if m["step"] < step]
        _write_metrics(metrics_path, metrics)
        continue
      ids = processed_ids(mb_ids, result)
      if after_failure and not last and result.records:
        self._write_timeline(step, result, stem=f"timeline_step{step}")
      coord = self.coordinator
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
        "schedule": coord.plan_name,
      }
      metrics.append(row)
      with metrics_path.open("a") as f:
        f.write(json.dumps(row) + "\n")
      self.coordinator.record_step_time(step, result.step_time_s, profiled=bool(result.records))
      self.log(
        f"step {step:4d}/{cfg.train.steps}  loss {result.loss:.4f}  "
        f"samples/s {row['samples_per_s']:9.1f}  step_time {result.step_time_s:.3f}s  "
        f"workers {row['live_workers']}  schedule {coord.plan_name}"
      )
      if (every and step % every == 0) or (last and (every or cfg.train.stop_after)):
        self._save(step)
      step += 1
    self.writer.wait()
    if end < cfg.train.steps:
      self.log(
        f"stopped after step {end} (train.stop_after); run again on the same workdir to resume"
      )
    if self.coordinator.failed:
      self.log("step times by schedule:")
      for line in self.coordinator.summary():
        self.log(line)
    (self.workdir / "schedule.txt").write_text("\n\n".join(schedules_seen) + "\n")
    if result is not None and result.records:
      self._write_timeline(end, result, stem="timeline")
    return TrainResult(metrics, self.executor, self.coordinator, result)


def _read_metrics(path: Path, up_to: int) -> list[dict]:
  """Rows of steps <= `up_to` (a resumed run redoes the later ones); rewrites the file."""
  rows = []
  if path.exists():
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
  rows = [r for r in rows if r["step"] <= up_to]
  _write_metrics(path, rows)
  return rows


def _write_metrics(path: Path, rows: list[dict]) -> None:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train(cfg: RunConfig, workdir: str | os.PathLike, **kwargs) -> TrainResult:
  """Trains `cfg` to the end; see `Trainer` for the keyword arguments."""
  return Trainer(cfg, workdir, **kwargs).run()
