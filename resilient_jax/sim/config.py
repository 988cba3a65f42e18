"""Typed simulation configuration, converted once from a `configs/sim/*.py` ConfigDict.

Every check that can be made before simulating is made here; a bad value raises
`SimConfigError` whose one-line message names the key, and the launcher prints it and exits
with code 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Mapping
from typing import Any

from resilient_jax.policy.base import RecoveryParams
from resilient_jax.policy.registry import policy_names
from resilient_jax.schedule.generators import GENERATORS
from resilient_jax.sim.engine import SWEEP_PLACEMENTS
from resilient_jax.sim.goodput import young_daly_interval
from resilient_jax.sim.layout import PLACEMENTS, Layout
from resilient_jax.sim.mixes import MIXES
from resilient_jax.sim.specs import DeviceSpec, ModelSpec, NetworkSpec
from resilient_jax.sim.traces import Stragglers, TraceError

__all__ = [
  "SimConfig",
  "SimConfigError",
  "SweepConfig",
  "TraceConfig",
  "from_config_dict",
  "load_config_file",
]

_HOUR = 3600.0


class SimConfigError(ValueError):
  """A simulation config value is invalid; the message names the key."""


@dataclasses.dataclass(frozen=True)
class TraceConfig:
  """Where the failure trace comes from.

  Attributes:
    duration_s: simulated wall time.
    device_mtbf_s: per-device mean time between failures (`inf`: never).
    node_mtbf_s: per-node mean time between whole-node failures (`inf`: never).
    repair_s: time until failed hardware rejoins (`inf`: never).
    seed: random seed of the generated trace.
    csv: a trace file to read instead (empty: generate).
    mix: a published failure mix of `mixes.MIXES` ("": the Poisson trace of devices and nodes);
      with a mix, `device_mtbf_s` is the job's devices times its mean time between
      interruptions, and `repair_s` the hardware causes' time until a spare takes over.
    transient_repair_s: a mix's transient causes' time until the process is back.
    nodes_per_switch: nodes a switch cause of a mix takes down.
    stragglers: slow-device episodes of a mix (None: none).
  """

  duration_s: float
  device_mtbf_s: float
  node_mtbf_s: float
  repair_s: float
  seed: int
  csv: str
  mix: str = ""
  transient_repair_s: float = 600.0
  nodes_per_switch: int = 1
  stragglers: Stragglers | None = None

  def job_mtbf_s(self, devices: int, nodes: int) -> float:
    """The job's mean time between failures, as a user would estimate it from the rates."""
    rate = devices / self.device_mtbf_s + (0.0 if self.mix else nodes / self.node_mtbf_s)
    return 1 / rate if rate else math.inf


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """Failure counts of the relative-throughput sweep.

  Attributes:
    failures: concurrent failed workers per point.
    placement: "stage" (all in one stage) or "random".
    stage: the stage for "stage" (0 .. pp - 1).
    seed: the seed for "random".
  """

  failures: tuple[int, ...]
  placement: str
  stage: int
  seed: int


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """Everything one simulation needs.

  Attributes:
    model: the model.
    device: the accelerator.
    network: the links.
    layout: grid, batch and placement.
    recompute: activation recomputation in the backward.
    profile: path of a measured per-stage profile that replaces the spec cost model ("": none).
    recovery: recovery times; its checkpoint interval is the configured one, or the Young/Daly
      optimum for the trace's failure rate and `checkpoint_write_s` when configured as 0.
    checkpoint_write_s: the time one checkpoint save takes to reach storage.
    checkpoint_blocking_s: the part of a save that blocks training: the device-to-host copy of
      each process's own share when saves are asynchronous (the distributed layout), the whole
      write when they are not (the default: `checkpoint_write_s`).
    young_daly: whether the interval was configured as 0: each policy then checkpoints at
      Young/Daly's interval for the restores it needs (`engine.restore_intervals`).
    regroup_steps: fault-free steps added to `recovery.regroup_s` once the step time is known
      (the runtime's `resilience.regroup_steps`: new groups and compiles after a replan).
    trace: the failure trace.
    sweep: the failure-count sweep.
    policies: policies to run; None: every available one.
    bin_s: width of the throughput-over-time bins.
    exact_ops: grids up to this many compute ops are planned whole, not reduced.
  """

  model: ModelSpec
  device: DeviceSpec
  network: NetworkSpec
  layout: Layout
  recompute: bool
  profile: str
  recovery: RecoveryParams
  trace: TraceConfig
  sweep: SweepConfig
  policies: tuple[str, ...] | None
  bin_s: float
  exact_ops: int
  checkpoint_write_s: float = 0.0
  regroup_steps: float = 0.0
  checkpoint_blocking_s: float = 0.0
  young_daly: bool = False


def _section(cd: Mapping[str, Any], name: str) -> Mapping[str, Any]:
  if name not in cd:
    raise SimConfigError(f"config has no section {name!r}")
  return cd[name]


def _num(
  cd: Mapping[str, Any],
  section: str,
  key: str,
  *,
  integer: bool = False,
  positive: bool = True,
  allow_zero: bool = False,
) -> Any:
  sec = _section(cd, section)
  if key not in sec:
    raise SimConfigError(f"{section}.{key} is missing")
  v = sec[key]
  ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
  if isinstance(v, bool) or not ok_type or (not integer and not math.isfinite(v)):
    kind = "an integer" if integer else "a finite number"
    raise SimConfigError(f"{section}.{key} must be {kind}, got {v!r}")
  if positive and (v < 0 or (v == 0 and not allow_zero)):
    raise SimConfigError(f"{section}.{key} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
  return v


def _str(cd: Mapping[str, Any], section: str, key: str) -> str:
  v = _section(cd, section).get(key)
  if not isinstance(v, str):
    raise SimConfigError(f"{section}.{key} must be a string, got {v!r}")
  return v


def _int_list(text: str, key: str) -> tuple[int, ...]:
  try:
    values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
  except ValueError:
    raise SimConfigError(f"{key}={text!r} must be comma-separated integers") from None
  if not values or any(v < 0 for v in values):
    raise SimConfigError(f"{key}={text!r} must be non-empty, non-negative integers")
  return values


def _hours(cd: Mapping[str, Any], key: str) -> float:
  """A `trace.*_hours` value in seconds; 0 means never (infinite)."""
  v = _num(cd, "trace", key, allow_zero=True)
  return math.inf if v == 0 else v * _HOUR


def _model(cd: Mapping[str, Any]) -> ModelSpec:
  return ModelSpec(
    name=_str(cd, "model", "name"),
    **{
      k: _num(cd, "model", k, integer=True)
      for k in ("num_layers", "d_model", "num_heads", "seq_len", "vocab_size")
    },
  )


def _device(cd: Mapping[str, Any]) -> DeviceSpec:
  return DeviceSpec(
    name=_str(cd, "device", "name"),
    **{k: _num(cd, "device", k) for k in ("peak_tflops", "hbm_gbps", "memory_gb", "efficiency")},
  )


def _network(cd: Mapping[str, Any]) -> NetworkSpec:
  return NetworkSpec(
    intra_node_gbps=_num(cd, "network", "intra_node_gbps"),
    inter_node_gbps=_num(cd, "network", "inter_node_gbps"),
    intra_latency_us=_num(cd, "network", "intra_latency_us", allow_zero=True),
    inter_latency_us=_num(cd, "network", "inter_latency_us", allow_zero=True),
  )


def _layout(cd: Mapping[str, Any], model: ModelSpec) -> Layout:
  """The grid from `cluster.*` and `parallel.*`: devices split into pp x tp, the rest is dp."""
  devices = _num(cd, "cluster", "devices", integer=True)
  pp = _num(cd, "parallel", "pp", integer=True)
  tp = _num(cd, "parallel", "tp", integer=True)
  if devices % (pp * tp):
    raise SimConfigError(
      f"cluster.devices={devices} is not a multiple of parallel.pp * parallel.tp = {pp * tp}"
    )
  if pp > model.num_layers:
    raise SimConfigError(f"parallel.pp={pp} exceeds model.num_layers={model.num_layers}")
  cap = _num(cd, "parallel", "memory_cap", integer=True, allow_zero=True)
  schedule = _str(cd, "parallel", "schedule")
  if schedule not in GENERATORS:
    raise SimConfigError(
      f"parallel.schedule={schedule!r} is not one of {', '.join(sorted(GENERATORS))}"
    )
  placement = _str(cd, "cluster", "placement")
  if placement not in PLACEMENTS:
    raise SimConfigError(f"cluster.placement={placement!r} is not one of {', '.join(PLACEMENTS)}")
  dpn = _num(cd, "cluster", "devices_per_node", integer=True)
  if tp % dpn and dpn % tp:
    raise SimConfigError(
      f"parallel.tp={tp} and cluster.devices_per_node={dpn}: one must divide the other"
    )
  if devices % dpn:
    raise SimConfigError(f"cluster.devices={devices} is not a multiple of devices_per_node={dpn}")
  return Layout(
    dp=devices // (pp * tp),
    pp=pp,
    tp=tp,
    microbatches=_num(cd, "parallel", "microbatches", integer=True),
    micro_batch_size=_num(cd, "parallel", "micro_batch_size", integer=True),
    devices_per_node=dpn,
    placement=placement,
    schedule=schedule,
    memory_cap=cap or None,
  )


def _recompute(cd: Mapping[str, Any]) -> bool:
  recompute = _section(cd, "parallel").get("recompute", False)
  if not isinstance(recompute, bool):
    raise SimConfigError(f"parallel.recompute must be True or False, got {recompute!r}")
  return recompute


def _optional(cd: Mapping[str, Any], section: str, key: str, default: Any, **kw: Any) -> Any:
  """`section.key` checked as `_num` does, or `default` when the config does not set it."""
  return _num(cd, section, key, **kw) if key in _section(cd, section) else default


def _recovery(cd: Mapping[str, Any]) -> tuple[dict[str, float], float, float]:
  """`recovery.*`: the `RecoveryParams` keys (a checkpoint interval of 0: Young/Daly's, set
  once the trace is known), the checkpoint write time and the regroup's steps."""
  keys = {k: _num(cd, "recovery", k, allow_zero=True)
          for k in ("detect_s", "regroup_s", "restart_s", "checkpoint_interval_s")}
  write = _optional(cd, "recovery", "checkpoint_write_s", 0.0, allow_zero=True)
  steps = _optional(cd, "recovery", "regroup_steps", 0.0, allow_zero=True)
  blocking = _optional(cd, "recovery", "checkpoint_blocking_s", write, allow_zero=True)
  if blocking > write:
    raise SimConfigError(f"recovery.checkpoint_blocking_s={blocking} is more than the whole "
                         f"save, checkpoint_write_s={write}")
  return keys, write, steps, blocking


def _checkpoint_interval(keys: dict[str, float], write_s: float, trace: TraceConfig,
                         layout: Layout, persist_s: float = 0.0) -> RecoveryParams:
  """The recovery times with the checkpoint interval a user would choose: the configured one,
  or (0) the Young/Daly optimum for the job's failure rate and the blocking part of a save
  (what a policy that restores at every failure, restart, would choose; the run then sets each
  policy's own, `engine.restore_intervals`)."""
  if keys["checkpoint_interval_s"] == 0:
    if trace.csv:
      raise SimConfigError("recovery.checkpoint_interval_s=0 (Young/Daly) needs a generated "
                           "trace's failure rate, not trace.csv")
    interval = young_daly_interval(trace.job_mtbf_s(layout.devices, layout.nodes), write_s)
    if not math.isfinite(interval):
      raise SimConfigError("recovery.checkpoint_interval_s=0 (Young/Daly) needs "
                           "recovery.checkpoint_write_s > 0 and a failure rate")
    keys = {**keys, "checkpoint_interval_s": max(interval, persist_s)}
  return RecoveryParams(**keys)


def _trace(cd: Mapping[str, Any]) -> TraceConfig:
  """`trace.*`; the failure-mix keys (`mix`, `transient_repair_hours`, `nodes_per_switch`,
  `straggler_mtbs_hours`, `straggler_speed`, `straggler_hours`) are optional."""
  sec = _section(cd, "trace")
  mix = sec.get("mix", "")
  if mix not in ("", *MIXES):
    raise SimConfigError(f"trace.mix={mix!r} is not one of {', '.join(MIXES)} (or \"\")")
  stragglers = None
  mtbs = _optional(cd, "trace", "straggler_mtbs_hours", 0.0, allow_zero=True)
  if mtbs:
    try:
      stragglers = Stragglers(mtbs * _HOUR, _optional(cd, "trace", "straggler_speed", 0.5),
                              _optional(cd, "trace", "straggler_hours", 1.0) * _HOUR)
    except TraceError as e:
      raise SimConfigError(f"trace.{str(e).removeprefix('stragglers.')}") from None
  return TraceConfig(
    duration_s=_num(cd, "trace", "hours") * _HOUR,
    device_mtbf_s=_hours(cd, "device_mtbf_hours"),
    node_mtbf_s=_hours(cd, "node_mtbf_hours"),
    repair_s=_hours(cd, "repair_hours"),
    seed=_num(cd, "trace", "seed", integer=True, allow_zero=True),
    csv=_str(cd, "trace", "csv"),
    mix=mix,
    transient_repair_s=_optional(cd, "trace", "transient_repair_hours", 1 / 6) * _HOUR,
    nodes_per_switch=_optional(cd, "trace", "nodes_per_switch", 1, integer=True),
    stragglers=stragglers,
  )


def _sweep(cd: Mapping[str, Any], layout: Layout) -> SweepConfig:
  """The `sweep.*` section, checked against the grid: a stage of it, and failure counts that
  leave every stage a live worker (hosts: no more than the cluster has)."""
  placement = _str(cd, "sweep", "placement")
  if placement not in SWEEP_PLACEMENTS:
    raise SimConfigError(
      f"sweep.placement={placement!r} is not one of {', '.join(SWEEP_PLACEMENTS)}"
    )
  pp = layout.pp
  stage = _num(cd, "sweep", "stage", integer=True, positive=False)
  if not -pp <= stage < pp:
    raise SimConfigError(f"sweep.stage={stage} is not a stage of pp={pp}")
  stage %= pp  # -1: the last stage
  failures = _int_list(_str(cd, "sweep", "failures"), "sweep.failures")
  if placement == "hosts":
    if max(failures) > layout.nodes:
      raise SimConfigError(f"sweep.failures={max(failures)} hosts, but the cluster has "
                           f"{layout.nodes}")
  elif max(failures) >= (layout.dp if placement == "stage" else layout.workers + 1):
    raise SimConfigError(
      f"sweep.failures={max(failures)} leaves no live worker in a stage of {layout.dp}"
    )
  return SweepConfig(
    failures, placement, stage, _num(cd, "sweep", "seed", integer=True, allow_zero=True)
  )


def _policies(cd: Mapping[str, Any]) -> tuple[str, ...] | None:
  """`sim.policies`: comma-separated names, or "" / "all" for every available one (None)."""
  names = _str(cd, "sim", "policies").replace(" ", "")
  policies = None if names in ("", "all") else tuple(names.split(","))
  known = policy_names()
  for name in policies or ():
    if name not in known:
      raise SimConfigError(
        f"sim.policies: unknown policy {name!r}; choose from {', '.join(known)} or all"
      )
  return policies


def from_config_dict(cd: Mapping[str, Any]) -> SimConfig:
  """Validates a simulation ConfigDict and converts it to a `SimConfig`.

  Sections are read in a fixed order (model, device, network, the grid, recovery, trace, sweep,
  sim), so the error is always about the first invalid key.

  Raises:
    SimConfigError: naming the first invalid key.
  """
  try:
    model = _model(cd)
    device = _device(cd)
    network = _network(cd)
    layout = _layout(cd, model)
    recompute = _recompute(cd)
    recovery, write_s, regroup_steps, blocking_s = _recovery(cd)
    trace = _trace(cd)
    young_daly = recovery["checkpoint_interval_s"] == 0
    recovery = _checkpoint_interval(recovery, blocking_s, trace, layout, write_s)
    sweep = _sweep(cd, layout)
    policies = _policies(cd)
    return SimConfig(
      model=model,
      device=device,
      network=network,
      layout=layout,
      recompute=recompute,
      profile=_str(cd, "profile", "path"),
      recovery=recovery,
      trace=trace,
      sweep=sweep,
      policies=policies,
      bin_s=_num(cd, "sim", "bin_minutes") * 60.0,
      exact_ops=_num(cd, "sim", "exact_ops", integer=True, allow_zero=True),
      checkpoint_write_s=write_s,
      regroup_steps=regroup_steps,
      checkpoint_blocking_s=blocking_s,
      young_daly=young_daly,
    )
  except SimConfigError:
    raise
  except ValueError as e:
    # The specs' own checks name their field as "<section>.<key>" already.
    raise SimConfigError(str(e).splitlines()[0]) from None


def load_config_file(spec: str) -> Any:
  """The ConfigDict of `path[:variant]`, as `--config=` would load it (for scripts and tests).

  Raises:
    SimConfigError: when the file cannot be loaded or rejects the variant.
  """
  path, _, arg = spec.partition(":")
  try:
    module_spec = importlib.util.spec_from_file_location("sim_config", path)
    if module_spec is None or module_spec.loader is None:
      raise OSError(f"not a Python file: {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)
  except (OSError, ValueError, AttributeError) as e:
    raise SimConfigError(f"{spec}: {e}") from None
