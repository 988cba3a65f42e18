"""Typed, validated run configuration.

Config files (`configs/*.py`) return an `ml_collections.ConfigDict`; `from_config_dict` turns it
into frozen dataclasses once, at the boundary, and every check that can be made before JAX
starts is made here. A bad value raises `ConfigError` whose message names the key; the
launcher prints that one line and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from resilient_jax import data
from resilient_jax.checks import ConfigError, is_int, require_ints, require_numbers
from resilient_jax.spec.faults import (  # noqa: F401 (re-exported: the config's names)
  Fault,
  FaultsConfig,
  Slowdown,
  check_rejoins,
  faults_section,
  parse_faults,
  parse_slowdowns,
)
from resilient_jax.spec.model import CustomModelConfig, ModelConfig, family, partition_layers
from resilient_jax.spec.placement import DEFAULT_PLACEMENT, check_placement

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
DATA_KINDS = data.SOURCE_KINDS
TOKEN_DTYPES = tuple(data.TOKEN_DTYPES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  dp: int = 1
  pp: int = 1
  tp: int = 1
  """Devices per worker: a worker (dp, stage) is a sub-mesh of `tp` devices over which its
  stage's blocks are split (tensor parallelism, `resilient_jax/model/sharding.py`)."""
  placement: str = DEFAULT_PLACEMENT
  """How a multi-process job's workers sit on its processes (hosts): "pipeline" (a host holds
  stages of one pipeline) or "stage" (one stage of several pipelines); see
  `resilient_jax/spec/placement.py`."""

  def __post_init__(self):
    for key in ("dp", "pp", "tp"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
        raise ConfigError(f"mesh.{key} must be a positive integer, got {getattr(self, key)!r}")
    try:
      check_placement(self.placement)
    except ValueError as e:
      raise ConfigError(str(e)) from None

  @property
  def num_workers(self) -> int:
    return self.dp * self.pp

  @property
  def num_devices(self) -> int:
    """Devices the grid runs on: `tp` for each of its workers."""
    return self.dp * self.pp * self.tp


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  schedule: str = "1f1b"
  microbatches: int = 4
  partition: tuple[int, ...] = ()
  """Layers per stage; empty means an even split."""

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ConfigError(f"pipeline.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not isinstance(self.microbatches, int) or self.microbatches < 1:
      raise ConfigError(
        f"pipeline.microbatches must be a positive integer, got {self.microbatches!r}"
      )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 10
  global_batch: int = 16
  seed: int = 0
  data: str = "synthetic"
  """`synthetic`, `text` (bytes of the shipped text), `tokens` (a flat binary of token ids), or
  `package.module:name`, your own random-access source (`len(source)`, `source[i]` a dict of
  arrays), or a function of no arguments that returns one."""
  loss_fn: str = ""
  """`package.module:name` of your `loss_fn(model, batch)`; empty: the model's own forward on
  `batch["tokens"]` against `batch["targets"]`."""
  data_path: str = ""
  """`tokens`: the file; empty: the shipped one (the shipped text as uint16 ids)."""
  data_dtype: str = "uint16"
  """`tokens`: the id type of the file, `uint16` or `uint32`."""
  stop_after: int = 0
  """End the run cleanly after this step (checkpointing first); 0: run all `steps`. The
  learning-rate schedule still follows `steps`, so a resumed run continues it exactly."""
  accumulate_steps: int = 1
  """Global batches per optimizer step. In a pipeline accumulating gradients is running more
  micro-batches before the optimizer step: each pipeline runs `accumulate_steps *
  pipeline.microbatches` of the same size, and memory per micro-batch is unchanged."""
  max_nonfinite_steps: int = 10
  """A step whose gradients are not finite (on any stage) is skipped on every stage; after this
  many in a row the run stops (exit code 8) rather than train on."""
  eval_every: int = 0
  """Evaluate on the held-out samples every this many steps and after the last (0: never):
  `eval_loss` and `eval_ppl` in the step's row (`training/evaluation.py`)."""
  eval_batches: int = 1
  """Held-out batches an evaluation runs, each the samples of one step
  (`global_batch * accumulate_steps`); the held-out split is `data.held_out`'s."""

  def __post_init__(self):
    keys = ("steps", "global_batch")
    require_ints("train.", {k: getattr(self, k) for k in keys}, 1, ConfigError)
    if self.data not in DATA_KINDS and not is_code_ref(self.data):
      raise ConfigError(f"train.data={self.data!r} is not one of {', '.join(DATA_KINDS)}, nor "
                        "package.module:name of your own source")
    if self.loss_fn and not is_code_ref(self.loss_fn):
      raise ConfigError(f"train.loss_fn={self.loss_fn!r} is not package.module:name")
    if self.data_dtype not in TOKEN_DTYPES:
      raise ConfigError(
        f"train.data_dtype={self.data_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    if not isinstance(self.data_path, str):
      raise ConfigError(f"train.data_path must be a path, got {self.data_path!r}")
    require_ints("train.", {"stop_after": self.stop_after, "seed": self.seed}, 0, ConfigError)
    if self.seed >= 2**63:  # jax.random.key takes an int64; numpy's generators no negative
      raise ConfigError(f"train.seed={self.seed} is beyond int64 (it must be below 2**63)")
    keys = ("max_nonfinite_steps", "accumulate_steps", "eval_batches")
    require_ints("train.", {k: getattr(self, k) for k in keys}, 1, ConfigError)
    require_ints("train.", {"eval_every": self.eval_every}, 0, ConfigError)


OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor")
LR_SCHEDULES = ("warmup_cosine", "constant", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer every stage steps with (its own parameters, as soon as they are reduced).

  `adamw` and `lion` decay weights decoupled; `adam` and `sgd` add `weight_decay * w` to the
  gradient (L2), after clipping. Decay applies to matrices only (not to biases and norms), and to
  embeddings unless `decay_embeddings` is false.
  """

  name: str = "adamw"
  learning_rate: float = 3e-3
  schedule: str = "warmup_cosine"
  """`warmup_cosine` (linear warmup, cosine decay to `min_lr_ratio` at `train.steps`),
  `constant`, or `linear` (warmup, then linear decay to `min_lr_ratio`)."""
  warmup_steps: int = 2
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  momentum: float = 0.9
  """`sgd`'s momentum (0: none)."""
  weight_decay: float = 0.01
  decay_embeddings: bool = True
  clip_global_norm: float = 0.0
  """Clip the gradient to this global norm over every parameter of every stage, as one device
  would (0: off); each stage still steps as soon as its own gradients are reduced."""

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ConfigError(f"optimizer.name={self.name!r} is not one of {', '.join(OPTIMIZERS)}")
    if self.schedule not in LR_SCHEDULES:
      raise ConfigError(
        f"optimizer.schedule={self.schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    require_numbers("optimizer.", {"learning_rate": self.learning_rate, "eps": self.eps},
                    positive=True, error=ConfigError)
    keys = ("weight_decay", "clip_global_norm", "min_lr_ratio", "b1", "b2", "momentum")
    require_numbers("optimizer.", {k: getattr(self, k) for k in keys}, error=ConfigError)
    require_ints("optimizer.", {"warmup_steps": self.warmup_steps}, 0, ConfigError)
    if self.min_lr_ratio > 1:
      raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
    for key in ("b1", "b2", "momentum"):
      if getattr(self, key) >= 1:
        raise ConfigError(f"optimizer.{key} must be in [0, 1), got {getattr(self, key)!r}")


IF_BUSY = ("wait", "defer")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 0
  """Save every this many steps (and at the end of the run); 0: only when stopping early."""
  keep: int = 3
  """Committed checkpoints to keep; 0 keeps all."""
  if_busy: str = "wait"
  """A save that comes due while the previous one is still being written: `wait` for it (every
  due step is saved, as orbax's manager does; training stalls when writes outlast the
  interval), or `defer` it to the first step at which the writer is free (training never waits
  for the disk; the latest checkpoint may be up to one write older)."""
  init_from: str = ""
  """Start from the parameters of this checkpoint (universal, or a plain orbax NNX state of the
  same model); seed, data, optimizer and steps are this run's. A workdir holding checkpoints
  resumes from them instead."""
  local_dir: str = ""
  """Where a job's processes write their stages' state when process 0 is lost, for the relaunch
  (`checkpoint/local.py`); default `WORKDIR/local`. Node-local disk is fastest; a relaunch uses
  the copies only where each process can read its stages' ones (else the shared checkpoint)."""

  def __post_init__(self):
    require_ints("checkpoint.", {"every_steps": self.every_steps, "keep": self.keep}, 0,
                 ConfigError)
    if self.if_busy not in IF_BUSY:
      raise ConfigError(f"checkpoint.if_busy={self.if_busy!r} is not one of {', '.join(IF_BUSY)}")
    for key in ("init_from", "local_dir"):
      if not isinstance(getattr(self, key), str):
        raise ConfigError(f"checkpoint.{key} must be a path, got {getattr(self, key)!r}")


@dataclasses.dataclass(frozen=True)
class ResilienceConfig:
  policy: str = "recycle"
  """`recycle`: re-route and replan so extra work fills bubbles; `naive`: re-route only;
  `oobleck`: heterogeneous pipelines from templates, re-instantiated on the survivors;
  `bamboo`: every stage keeps its successor's state and runs its forward redundantly, the
  predecessor takes over a failed stage; `restart`: stop, restore the latest checkpoint onto the
  survivors, continue; `auto`: per failure, whichever of re-routing, re-templating and restoring
  the cost model says is fastest (see `resilient_jax/policy/`); or a policy a user registered
  (`policy.registry.register_policy`), checked against the registry when the run starts."""
  memory_cap: int = 0
  """Per-worker cap on in-flight micro-batches for the replanned schedule; 0: planner default."""
  activation_budget_mb: float = 0.0
  """Per-worker memory (MiB) for the activations of in-flight micro-batches; 0: no budget.
  Divided by the largest stage's activation bytes per micro-batch (measured from its forward:
  `model.remat` shrinks them), it caps the replanned schedule's in-flight micro-batches (the
  lower of it and `memory_cap`); `training.run.activation_memory`."""
  tolerate: int = 1
  """`oobleck`: failures the pipelines must survive (at least tolerate + 1 pipelines)."""
  min_pipeline_nodes: int = 0
  """`oobleck`/`auto`: the smallest pipeline template (nodes); 0: `mesh.pp`, taken as the depth
  the model needs to fit in memory."""
  mean_steps_between_failures: float = 500.0
  """`auto`: the steps expected until the next failure, over which a switch must pay back."""
  restart_steps: float = 20.0
  """`auto`: what a restore costs once (start-up, compiles, loading), in fault-free steps."""
  regroup_steps: float = 1.0
  """`auto`: what re-planning in place costs once (new all-reduce groups, compiles), in steps."""
  restore_on_stage_loss: bool = True
  """When every worker of a stage has failed: restore the latest checkpoint onto the surviving
  devices (True), or exit with code 3 naming the stage so a cluster scheduler can act (False)."""
  check_replicas_every: int = 0
  """Every this many steps, compare a digest of every data-parallel replica's parameters with
  its stage's others (they are bitwise equal after each step): a replica that differs from the
  majority is dropped like a failed worker (silent data corruption); 0: never."""
  straggler_every: int = 0
  """Every this many steps, time each op (the step waits for each) to find stragglers: a worker
  whose op times stay above `straggler_threshold` times its stage peers' for `straggler_steps`
  measured steps gets a share of micro-batches in proportion to its speed (recycle, naive);
  0: never (timing every op serialises the devices' work)."""
  straggler_threshold: float = 1.5
  """How many times slower than its stage peers' median a worker's ops must be to count."""
  straggler_steps: int = 3
  """Measured steps in a row a worker must be slow (or back to normal) before the plan changes."""

  def __post_init__(self):
    if not isinstance(self.policy, str) or not self.policy.isidentifier():
      raise ConfigError(f"resilience.policy must be a policy's name, got {self.policy!r}")
    keys = ("memory_cap", "tolerate", "min_pipeline_nodes", "check_replicas_every",
            "straggler_every")
    require_ints("resilience.", {k: getattr(self, k) for k in keys}, 0, ConfigError)
    require_ints("resilience.", {"straggler_steps": self.straggler_steps}, 1, ConfigError)
    t = self.straggler_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 1 < t < math.inf:
      raise ConfigError(f"resilience.straggler_threshold must be a number > 1, got {t!r}")
    keys = ("restart_steps", "regroup_steps", "activation_budget_mb")
    require_numbers("resilience.", {k: getattr(self, k) for k in keys}, error=ConfigError)
    require_numbers("resilience.", {"mean_steps_between_failures":
                                    self.mean_steps_between_failures}, positive=True,
                    error=ConfigError)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process training on `jax.distributed`: one process per host, driving all its devices
  (`mesh.placement` says which workers)."""

  enabled: bool = False
  """Run as one process of a multi-process job. With no other key set, the coordinator,
  process count and id come from JAX's cluster auto-detection (SLURM, TPU VMs, GKE, MPI)."""
  coordinator: str = ""
  """HOST:PORT of the coordination service (hosted by process 0); "": auto-detect."""
  num_processes: int = 0
  """0: auto-detect."""
  process_id: int = -1
  """-1: auto-detect."""
  heartbeat_timeout_s: int = 10
  """A process that sent no heartbeat for this long is declared dead and its work re-routed."""
  wait_timeout_s: int = 120
  """Upper bound on any single blocking wait (device results, transfers, agreements); a
  survivor that waits longer exits with code 6 instead of hanging."""
  kv_keep_steps: int = 8
  """The coordination service keeps the agreements of this many recent steps; older ones are
  deleted (a process the plan leaves idle follows decisions a step or two late)."""

  def __post_init__(self):
    if self.coordinator and not re.match(r"^[^:\s]+:\d+$", self.coordinator):
      raise ConfigError(f"distributed.coordinator={self.coordinator!r} is not HOST:PORT")
    if not isinstance(self.num_processes, int) or self.num_processes < 0:
      raise ConfigError(
        f"distributed.num_processes must be an integer >= 0, got {self.num_processes!r}"
      )
    if not isinstance(self.process_id, int) or self.process_id < -1:
      raise ConfigError(f"distributed.process_id must be an integer >= -1, got {self.process_id!r}")
    if self.num_processes and self.process_id >= self.num_processes:
      raise ConfigError(
        f"distributed.process_id={self.process_id} is not below "
        f"distributed.num_processes={self.num_processes}"
      )
    keys = ("heartbeat_timeout_s", "wait_timeout_s")
    require_ints("distributed.", {k: getattr(self, k) for k in keys}, 1, ConfigError)
    require_ints("distributed.", {"kv_keep_steps": self.kv_keep_steps}, 2, ConfigError)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  trace_steps: tuple[int, ...] = ()
  """Steps to record a `jax.profiler` trace of, each into `WORKDIR/profile/stepN/`."""
  peak_tflops: float = 0.0
  """One device's peak TFLOP/s, for the MFU in the log and metrics; 0: the device kind's dense
  bf16 peak when known (`observe/utilization.py`), else no MFU."""

  def __post_init__(self):
    for step in self.trace_steps:
      if not is_int(step):
        raise ConfigError(f"profile.trace_steps entry {step!r} is not a step number (e.g. 3,4)")
    require_numbers("profile.", {"peak_tflops": self.peak_tflops}, error=ConfigError)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  mesh: MeshConfig
  pipeline: PipelineConfig
  train: TrainConfig
  optimizer: OptimizerConfig = OptimizerConfig()
  faults: FaultsConfig = FaultsConfig()
  resilience: ResilienceConfig = ResilienceConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  distributed: DistributedConfig = DistributedConfig()
  profile: ProfileConfig = ProfileConfig()

  def __post_init__(self):
    m, mesh, pipe, train = self.model, self.mesh, self.pipeline, self.train
    named = getattr(m, "module", "") and not m.fingerprint  # built later: its blocks unknown
    try:
      if not named:
        partition_layers(m.num_layers, mesh.pp, pipe.partition or None)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    per_step = mesh.dp * pipe.microbatches
    if train.global_batch % per_step:
      raise ConfigError(
        f"train.global_batch={train.global_batch} is not divisible by "
        f"mesh.dp * pipeline.microbatches = {mesh.dp} * {pipe.microbatches}"
      )
    if train.data == "text" and m.vocab_size < 256:
      raise ConfigError(f"model.vocab_size={m.vocab_size} is below 256, needed by train.data=text")
    for step, stage in self.faults.nonfinite:
      if not (1 <= step <= train.steps and stage < mesh.pp):
        raise ConfigError(f"faults.nonfinite entry {step}:{stage} is outside steps "
                          f"1..{train.steps} or stages 0..{mesh.pp - 1}")
    for step in self.profile.trace_steps:
      if step > train.steps:
        raise ConfigError(f"profile.trace_steps entry {step} is outside steps 1..{train.steps}")
    for key, faults in (("schedule", self.faults.schedule), ("corrupt", self.faults.corrupt)):
      for f in faults:
        if not (1 <= f.step <= train.steps and f.dp < mesh.dp and f.stage < mesh.pp):
          raise ConfigError(f"faults.{key} entry {f} is outside steps 1..{train.steps} "
                            f"or the {mesh.dp}x{mesh.pp} grid")
    check_rejoins((f.step, (f.dp, f.stage), f.rejoin) for f in self.faults.schedule)
    for f in self.faults.slow:
      if not (1 <= f.step <= train.steps and f.dp < mesh.dp and f.stage < mesh.pp):
        raise ConfigError(f"faults.slow entry {f} is outside steps 1..{train.steps} "
                          f"or the {mesh.dp}x{mesh.pp} grid")

  @property
  def microbatch_size(self) -> int:
    return self.train.global_batch // (self.mesh.dp * self.pipeline.microbatches)

  @property
  def step_batch(self) -> int:
    """Samples per optimizer step: `train.global_batch * train.accumulate_steps`."""
    return self.train.global_batch * self.train.accumulate_steps

  @property
  def step_microbatches(self) -> int:
    """Micro-batches per pipeline per optimizer step (`pipeline.microbatches` per global
    batch accumulated)."""
    return self.pipeline.microbatches * self.train.accumulate_steps

  @property
  def partition(self) -> list[range]:
    return partition_layers(self.model.num_layers, self.mesh.pp, self.pipeline.partition or None)


def _section(cd: Mapping[str, Any], name: str, cls: type, convert=None) -> Any:
  raw = dict(cd.get(name, {}) or {})
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(raw) - fields)
  if unknown:
    raise ConfigError(f"unknown config key {name}.{unknown[0]}")
  if convert:
    raw = convert(raw)
  for f in dataclasses.fields(cls):
    if f.name in raw and isinstance(f.default, bool) and not isinstance(raw[f.name], bool):
      raise ConfigError(f"{name}.{f.name} must be true or false, got {raw[f.name]!r}")
  try:
    return cls(**raw)
  except ConfigError:
    raise
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e) if name in str(e) else f"{name}: {e}") from None


def _pipeline(raw: dict) -> dict:
  part = raw.get("partition", ())
  if isinstance(part, str):
    try:
      part = tuple(int(x) for x in part.split(",") if x.strip())
    except ValueError:
      raise ConfigError(f"pipeline.partition={part!r} is not a comma-separated list") from None
  raw["partition"] = tuple(part or ())
  return raw


def _profile(raw: dict) -> dict:
  spec = raw.get("trace_steps", ())
  if isinstance(spec, str):
    try:
      spec = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
      raise ConfigError(f"profile.trace_steps={spec!r} is not a comma-separated list of steps "
                        "(e.g. 3,4)") from None
  elif not isinstance(spec, (list, tuple)):
    spec = [spec]  # one step; a bad value is named by ProfileConfig
  raw["trace_steps"] = tuple(spec)
  return raw


def names_code(cfg: RunConfig) -> bool:
  """Whether `cfg` names a user's code (`model.module`, `train.loss_fn`, `train.data`), which
  is imported when the run starts (and may register a policy, `policy.register_policy`)."""
  return bool(getattr(cfg.model, "module", "") or cfg.train.loss_fn
              or is_code_ref(cfg.train.data))


def is_code_ref(text: Any) -> bool:
  """Whether `text` names code as `package.module:name` (dotted identifiers either side)."""
  if not isinstance(text, str) or text.count(":") != 1:
    return False
  module, name = text.split(":")
  return all(p.isidentifier() for p in module.split(".")) and all(
    p.isidentifier() for p in name.split("."))


def _model_section(cd: Mapping[str, Any]) -> ModelConfig:
  """The `model` section, in the config class of the family `model.name` picks (default gpt);
  with `model.module` (your own model, `package.module:build`), a stand-in the run replaces by
  the description of the model that function builds (`training.api.run_config`)."""
  section = dict(cd.get("model", {}) or {})
  module = section.pop("module", "")
  if module:
    if not is_code_ref(module):
      raise ConfigError(f"model.module={module!r} is not package.module:name")
    keep = {k: section[k] for k in ("seq_len", "remat", "layers", "vocab_size") if k in section}
    return _section({"model": {**keep, "module": module}}, "model", CustomModelConfig)
  cd = {**cd, "model": section}
  name = section.get("name", "gpt")
  try:
    cls = family(name)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return _section(cd, "model", cls)


def from_config_dict(cd: Mapping[str, Any], model: ModelConfig | None = None) -> RunConfig:
  """Converts and validates a config (a ConfigDict or nested dict).

  Args:
    cd: the config.
    model: replaces the config's `model` section (a user's model, `train(model=...)`).

  Raises:
    ConfigError: the first invalid or unknown key.
  """
  known = {
    "model", "mesh", "pipeline", "train", "optimizer", "faults", "resilience", "checkpoint",
    "distributed", "profile",
  }
  unknown = sorted(set(cd) - known)
  if unknown:
    raise ConfigError(f"unknown config section {unknown[0]!r}")
  return RunConfig(
    model=model or _model_section(cd),
    mesh=_section(cd, "mesh", MeshConfig),
    pipeline=_section(cd, "pipeline", PipelineConfig, _pipeline),
    train=_section(cd, "train", TrainConfig),
    optimizer=_section(cd, "optimizer", OptimizerConfig),
    faults=_section(cd, "faults", FaultsConfig, faults_section),
    resilience=_section(cd, "resilience", ResilienceConfig),
    checkpoint=_section(cd, "checkpoint", CheckpointConfig),
    distributed=_section(cd, "distributed", DistributedConfig),
    profile=_section(cd, "profile", ProfileConfig, _profile),
  )


def check_paths(cfg: RunConfig) -> None:
  """Checks that the files `cfg` reads exist, so that a launcher can say so before JAX starts
  (their contents are checked by their readers when the run starts).

  Raises:
    ConfigError: `train.data_path` (of `train.data=tokens`) is not a file, or
      `checkpoint.init_from` does not exist.
  """
  t = cfg.train
  if t.data == "tokens" and t.data_path and not os.path.isfile(t.data_path):
    raise ConfigError(f"train.data_path={t.data_path!r} is not a file")
  source = cfg.checkpoint.init_from
  if source and not os.path.exists(source):
    raise ConfigError(f"checkpoint.init_from={source!r} does not exist")
