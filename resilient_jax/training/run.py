"""What the parts of a training run share, built once before the first step (`start_run`).

A `Run` is plain, typed state: the configuration, the group of processes the run spans
(`group.Solo` or `group.Job`), the model's stage programs, the transport, the policy's
coordinator and the interpreter that holds this process's share of the training state. The
loop, the checkpoints, the failure handling and the rejoins each receive it; none of them is
mixed into another, and each says which fields it reads and which it replaces (only
`interpreter`, when a restore or a join changes the layout, and `attempts`).

Costs: building a run compiles nothing itself (`Programs` builds a split's programs when a plan
first needs them); a job connects each process to the processes of its own and neighbouring
stages (O(processes of 3 stages) connections, not O(processes)).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import PartitionSpec

from resilient_jax.checkpoint import CheckpointError, CheckpointWriter
from resilient_jax.config import ConfigError, RunConfig
from resilient_jax.data import BatchPlan, sample_shapes
from resilient_jax.files import check_run_files
from resilient_jax.model.sharding import TP_RULES, logical_axes
from resilient_jax.model.staging import variable_names
from resilient_jax.observe.events import EventLog
from resilient_jax.observe.goodput import GoodputLog
from resilient_jax.observe.tensorboard import Board
from resilient_jax.policy import RunCoordinator
from resilient_jax.programs.compiled import BuildCounter
from resilient_jax.programs.shared import build_stage_programs
from resilient_jax.programs.stages import StagePrograms
from resilient_jax.recipe import (
  make_data,
  make_model,
  make_optimizer,
  num_microbatches,
  optimizer_key,
)
from resilient_jax.runtime.interpreter import Interpreter
from resilient_jax.runtime.transport import Transport
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import Plan
from resilient_jax.training.group import Group, Job, Solo

Logger = Callable[[str], None]


class Programs:
  """The stage programs of every split of the layers the run's plans use, at the current
  micro-batch size, each built once (`Interpreter` asks for a split's when a plan needs it)."""

  def __init__(self, cfg: RunConfig, model: Any, source: Any, loss_fn: Any = None):
    self.cfg, self.model, self.loss_fn = cfg, model, loss_fn
    self.microbatch_size = cfg.step_batch // cfg.pipeline.microbatches
    self._sample = sample_shapes(source)
    self._built: dict[tuple, list[StagePrograms]] = {}

  def batch_spec(self, size: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """One micro-batch's entries at the current micro-batch size (or `size` samples)."""
    size = self.microbatch_size if size is None else size
    return {k: jax.ShapeDtypeStruct((size, *shape), dtype)
            for k, (shape, dtype) in self._sample.items()}

  def __call__(self, split: tuple[tuple[int, int], ...], size: int | None = None
               ) -> list[StagePrograms]:
    """The programs of `split` at the micro-batch size, or at `size` samples (a piece of a
    micro-batch: `Interpreter.op_program`)."""
    key = (split, self.microbatch_size if size is None else size)
    if key not in self._built:
      cfg = self.cfg
      self._built[key] = build_stage_programs(
        self.model, [range(lo, hi) for lo, hi in split], self.batch_spec(key[1]),
        make_optimizer(cfg),
        cfg.step_batch, tp=cfg.mesh.tp, optimizer_key=optimizer_key(cfg),
        remat=cfg.model.remat, layers=getattr(cfg.model, "layers", ""), loss_fn=self.loss_fn)
    return self._built[key]

  @property
  def configured(self) -> list[StagePrograms]:
    """The configured grid's stage programs."""
    return self(tuple((r.start, r.stop) for r in self.cfg.partition))


@dataclasses.dataclass
class Run:
  """The state every part of one run (or one process's share of a job) reads."""

  cfg: RunConfig
  workdir: Path
  log: Logger
  group: Group
  model: Any
  source: Any
  """The data source (`recipe.make_data`)."""
  batches: BatchPlan
  """Which samples each step trains on (a pure function of seed and step)."""
  transport: Transport
  coordinator: RunCoordinator
  programs: Programs
  interpreter: Interpreter
  """This process's slots and their committed state; replaced when the layout changes."""
  writer: CheckpointWriter | None
  """Process 0's checkpoint writer (None elsewhere)."""
  goodput: GoodputLog = dataclasses.field(default_factory=GoodputLog)
  board: Board = dataclasses.field(default_factory=lambda: Board(None))
  recovery: list[dict] = dataclasses.field(default_factory=list)
  """Per failure and rejoin: detection and time to the next committed step (recovery.json)."""
  membership: list = dataclasses.field(default_factory=list)
  """Every failure and admission so far, in order (the same in every live process)."""
  attempts: int = 0
  """Step attempts over the whole run: names transfers and agreements, never reused."""
  builds: BuildCounter = dataclasses.field(default_factory=BuildCounter)
  """What the run built (programs, XLA compiles) while it trained (`Trainer.run` counts)."""
  events: EventLog = dataclasses.field(default_factory=lambda: EventLog(lambda _: None))
  """What happened to the run, as typed records (`observe.events`; `events.jsonl`)."""

  @property
  def chief(self) -> bool:
    return self.group.chief

  @property
  def device_kind(self) -> str:
    """This process's devices' kind (`jax.Device.device_kind`: the MFU's peak)."""
    return jax.local_devices()[0].device_kind

  @property
  def ckpt_dir(self) -> Path:
    return self.workdir / "checkpoints"

  def use_plan(self, plan: Plan) -> None:
    """A new interpreter for `plan` (its state placed or restored by the caller)."""
    self.interpreter = new_interpreter(self.cfg, self.programs, self.transport, plan,
                                       replicas=not self.group.relaunched)

  def plan_key(self, step: int) -> str | None:
    """Where process 0 publishes its decision about the event now being applied."""
    return self.group.plan_key(step, self.attempts, len(self.membership))

  @staticmethod
  def plan_nodes(plan: Plan) -> list[int]:
    if isinstance(plan, PipelineSet):
      return plan.nodes
    return sorted(plan.nodes[w] for w in plan.schedule.ops)


def new_interpreter(cfg: RunConfig, programs: Programs, transport: Transport, plan: Plan,
                    replicas: bool = True) -> Interpreter:
  programs.microbatch_size = cfg.step_batch // num_microbatches(plan)
  return Interpreter(programs, transport, plan, clip_global_norm=cfg.optimizer.clip_global_norm,
                     nonfinite=cfg.faults.nonfinite, slowdowns=cfg.faults.slow,
                     replicas=replicas)


def activation_memory(cfg: RunConfig, programs: Programs, log: Logger) -> RunConfig:
  """The config the planner plans with: `cfg`, with `resilience.activation_budget_mb` (when
  set) turned into the in-flight cap of a replanned schedule (`resilience.memory_cap`, the
  lower of the two when both are set). With remat or a budget set, logs the activation bytes
  a micro-batch keeps alive per stage (`StagePrograms.activation_bytes`, of the configured
  stages, which it traces: the interpreter runs them next).

  A worker holds `in-flight x bytes per micro-batch` of activations, so the cap is the budget
  over the largest stage's bytes (every worker of a replan may take any stage's extra work):
  with remat, the same budget lets a replan keep more micro-batches in flight, filling more
  bubbles. At least 1: a budget below one micro-batch cannot be met by any schedule, and says so.
  """
  budget = cfg.resilience.activation_budget_mb
  if cfg.model.remat == "none" and not budget:
    return cfg  # nothing asked of memory: a plain run's log stays its step lines
  per_stage = [p.activation_bytes for p in programs.configured]
  log("activations per micro-batch, by stage: " + ", ".join(
    f"{b / 2**20:.2f}" for b in per_stage) + f" MiB (model.remat={cfg.model.remat})")
  if not budget:
    return cfg
  largest = max(per_stage, default=0)
  cap = max(1, int(budget * 2**20 // max(largest, 1)))
  if cfg.resilience.memory_cap:
    cap = min(cap, cfg.resilience.memory_cap)
  note = ""
  if largest > budget * 2**20:
    note = f"; one micro-batch's {largest / 2**20:.2f} MiB already exceeds it"
    note += " (model.remat=full keeps less)" if cfg.model.remat == "none" else ""
  log(f"resilience.activation_budget_mb={budget:g}: a replanned schedule keeps at most {cap} "
      f"micro-batch{'es' if cap > 1 else ''} in flight per worker{note}")
  return dataclasses.replace(cfg, resilience=dataclasses.replace(cfg.resilience, memory_cap=cap))


def replicated_over_tp(tp: int, axes: Mapping[str, tuple | None],
                       shapes: Mapping[str, tuple[int, ...]],
                       specs: Mapping[str, PartitionSpec]) -> str | None:
  """The start's one line on what `mesh.tp` leaves whole on each of a worker's devices, or
  None when every parameter that names a splitting axis is split.

  A parameter whose split dimension `tp` does not divide is replicated (`partition_specs`):
  the run is correct, but those parameters cost every device their whole size and their
  compute is repeated on each, which nothing else would tell the user.

  Args:
    tp: devices per worker.
    axes: each parameter's logical axes (`sharding.logical_axes`; None: not annotated).
    shapes: the stages' parameters' shapes.
    specs: their splits over a worker's sub-mesh (`StagePrograms.param_specs`).
  """
  undivided: dict[tuple[str, int], list[str]] = {}  # (logical axis, size) -> parameters
  for name, shape in shapes.items():
    logical = axes.get(name) or ()
    if any(specs[name]) or len(logical) != len(shape):
      continue
    for axis, size in zip(logical, shape, strict=True):
      if axis in TP_RULES and size % tp:
        undivided.setdefault((axis, size), []).append(name)
  split = any(any(spec) for spec in specs.values())
  if not undivided:
    if split:
      return None
    return (f"mesh.tp={tp}: no parameter of the model names a logical axis that splits "
            "(resilient_jax/model/sharding.py), so every worker's stage runs replicated over "
            f"its {tp} devices: correct, but it gains nothing from its extra devices (neither "
            "faster nor smaller per device)")
  dims = ", ".join(
    f"{axis} of size {size} ({len(names)} parameter{'s' if len(names) > 1 else ''}, e.g. "
    f"{sorted(names)[0]})" for (axis, size), names in sorted(undivided.items()))
  if split:
    return (f"mesh.tp={tp} does not divide {dims}: those parameters stay replicated, whole on "
            f"each of a worker's {tp} devices, which gain nothing from them (only the others "
            "are split)")
  return (f"mesh.tp={tp} does not divide {dims}, and nothing else splits: every worker's stage "
          f"runs replicated over its {tp} devices: correct, but it gains nothing from its extra "
          "devices (neither faster nor smaller per device)")


def _check_pieces_in_a_job(cfg: RunConfig) -> None:
  from resilient_jax.runtime.multiprocess import PIECE_ROWS

  if cfg.microbatch_size > PIECE_ROWS:
    raise ConfigError(f"resilience.pieces in a job needs micro-batches of at most {PIECE_ROWS} "
                      f"samples (the ids of transfers between processes), not "
                      f"{cfg.microbatch_size}")


def start_run(cfg: RunConfig, workdir: str | os.PathLike, *, devices: Sequence[jax.Device] | None,
              log: Logger, cluster: Any, model: Any, loss_fn: Any = None, data: Any = None
              ) -> Run:
  """Builds everything a run needs before its first step (see `Trainer`'s arguments)."""
  if cfg.resilience.pieces and cluster is not None:
    _check_pieces_in_a_job(cfg)
  group = Solo() if cluster is None else Job(cluster)
  log = log if group.chief else (lambda _: None)
  workdir = Path(workdir)
  if group.chief:
    workdir.mkdir(parents=True, exist_ok=True)
    check_run_files(workdir)  # a directory where metrics.jsonl belongs: exit 2, nothing written
  model = make_model(cfg) if model is None else model
  if cfg.checkpoint.init_from:
    from resilient_jax.checkpoint.init_from import init_params, read_params

    source = cfg.checkpoint.init_from
    try:
      params, taken = read_params(source, log)
      n = init_params(model, params, source)
    except CheckpointError as e:
      raise ConfigError(str(e)) from None
    log(f"initialised {n} parameters from {source}: {taken}")
  data_source, batches = make_data(cfg, data)
  writer = None
  if group.chief:
    writer = CheckpointWriter(workdir / "checkpoints", keep=cfg.checkpoint.keep)
    for name in writer.remove_unfinished():
      log(f"removed {workdir / 'checkpoints' / name}: a save that never committed (its writer "
          "stopped mid-way)")
  transport = group.transport(cfg, devices)
  nodes = list(range(cfg.mesh.num_workers))
  programs = Programs(cfg, model, data_source, loss_fn)
  builds = BuildCounter()
  with builds.counting():
    planning = activation_memory(cfg, programs, log)
  events = EventLog(log, workdir / "events.jsonl" if group.chief else None)
  coordinator = RunCoordinator(planning, nodes, log=log, events=events)
  group.attach(coordinator)
  with builds.counting():
    interpreter = new_interpreter(cfg, programs, transport, coordinator.plan,
                                  replicas=not group.relaunched)
    group.warm_up(cfg, transport, interpreter)
  if cfg.mesh.tp > 1:
    stages = programs.configured
    line = replicated_over_tp(
      cfg.mesh.tp, logical_axes(model, variable_names(model)),
      {n: tuple(v.shape) for prog in stages for n, v in prog.abstract_params().items()},
      {n: spec for prog in stages for n, spec in prog.param_specs.items()})
    if line:
      log(line)
  return Run(cfg, workdir, log, group, model, data_source, batches, transport, coordinator,
             programs, interpreter, writer, builds=builds, events=events)
