"""The simulator's cost model: per-stage op times and how collectives scale with survivors.

Op times come from one of two sources, and the planners see the same `OpCosts` either way:

* specs (`CostModel.from_specs`): FLOPs and bytes of each op (`ModelSpec.stage_flops`) against
  a device's peak and bandwidth with an efficiency factor (a roofline), plus the tensor-parallel
  all-reduces inside a worker; activation transfers and the data-parallel gradient all-reduce
  from link bandwidth and latency.
* a profile measured by the runtime (`CostModel.from_profile`), a JSON object in seconds::

      {"f": [per stage], "b": [per stage], "w": [per stage], "ar": x | [per stage],
       "opt": x | [per stage], "comm": x}           (optional: "bw": fused backward)

The one thing that changes with failures is the all-reduce, priced as the runtime runs it
(`schedule.ring`, the same description the runtime's pieces and hops follow): a float32 buffer
of the stage's gradients; where a node holds several of a stage's workers, summed among them
over the node's links (a reduce-scatter, each owner a piece), each piece's ring over the nodes
from its owner's own network link, then gathered back (`ring.two_level`); with one worker per
node, the ring alone, `2(n-1)` hops of `bytes/n`. Which nodes the live workers are on comes
from the layout (`ar_groups`): losses are taken from the last nodes first (a node failure
takes its node's workers together, and one device lost anywhere leaves the same counts; only
devices lost on several nodes at once are priced as if lost on one). `op_costs(live)` gives the
`OpCosts` for a given number of live workers per stage. A profile's all-reduce was measured
on the whole grid and is used as measured (the ring's bandwidth term changes by under 1% for
`n >= 100`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from resilient_jax.checks import is_number
from resilient_jax.policy.base import PolicyUnavailableError
from resilient_jax.schedule import ring
from resilient_jax.schedule.cost import OpCosts
from resilient_jax.schedule.oobleck import LayerProfile
from resilient_jax.sim.layout import Layout
from resilient_jax.sim.specs import DeviceSpec, ModelSpec, NetworkSpec

__all__ = [
  "CostModel",
  "StageMemory",
  "load_profile",
  "p2p_seconds",
  "ring_allreduce_seconds",
  "save_profile",
]

# Bytes per parameter an Adam step moves: read fp32 master, m, v and the bf16 gradient
# (14 bytes), write master, m, v and the bf16 copy (14 bytes).
_ADAM_BYTES_PER_PARAM = 28
_ACTIVATION_BYTES = 2  # bf16 activations between stages and inside tensor-parallel groups
# Stashed activations per token, layer and unit of width (Korthikanti et al. 2022, with flash
# attention), and resident bytes per parameter for mixed-precision Adam.
_STASH_BYTES_PER_UNIT = 34
_STATE_BYTES_PER_PARAM = 16


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
  """The textbook ring all-reduce of `nbytes` over `n` participants, `2(n-1)` steps of
  `nbytes/n` each (a tensor-parallel group's collective).

  Args:
    nbytes: bytes each participant contributes (and receives reduced).
    n: participants; 1 or fewer costs nothing.
    bandwidth: bytes per second of the slowest link in the ring.
    latency: seconds per step.

  Returns:
    Seconds.
  """
  if n <= 1:
    return 0.0
  return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


@functools.lru_cache(maxsize=4096)
def _survivors(groups: tuple[int, ...], live: int) -> tuple[int, ...]:
  """Workers per node of a stage with `live` left of `groups` (the fault-free counts), the
  losses taken from the last nodes first; nodes left empty drop out."""
  out, lost = list(groups), sum(groups) - live
  while lost > 0 and out:
    take = min(lost, out[-1])
    out[-1] -= take
    lost -= take
    if not out[-1]:
      out.pop()
  return tuple(out)


@functools.lru_cache(maxsize=4096)
def _two_level(elements: int, per_node: tuple[int, ...]) -> ring.TwoLevel:
  return ring.two_level(elements, per_node or (1,))


def p2p_seconds(nbytes: float, bandwidth: float, latency: float) -> float:
  """One point-to-point transfer."""
  return nbytes / bandwidth + latency


def _per_stage(name: str, value: Any, pp: int | None) -> tuple[float, ...] | float:
  values = value if isinstance(value, (list, tuple)) else [value]
  for v in values:
    if not is_number(v):
      raise ValueError(f"profile.{name}: {v!r} is not a non-negative number of seconds")
  if isinstance(value, (list, tuple)):
    if pp is not None and len(value) != pp:
      raise ValueError(f"profile.{name} has {len(value)} entries, expected one per stage ({pp})")
    return tuple(float(v) for v in value)
  return float(value)


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """Per stage of the base grid, what a worker holds; for planners that move layers.

  Attributes:
    layers: model layers of each stage.
    params: parameters of each stage.
    stash_bytes: activation bytes each stage keeps per micro-batch in flight (whole worker).
    state_bytes_per_param: resident bytes per parameter (bf16 weight and gradient, fp32 master
      weight and two Adam moments: 16).
    worker_memory: bytes of one worker's memory (all its `tp` devices).
    tp: devices per worker.
  """

  layers: tuple[int, ...]
  params: tuple[float, ...]
  stash_bytes: tuple[float, ...]
  state_bytes_per_param: float
  worker_memory: float
  tp: int


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Per-stage op times of one grid, and the all-reduce as a function of live workers.

  Attributes:
    f: forward seconds per stage.
    b: input-gradient seconds per stage.
    w: weight-gradient seconds per stage.
    opt: optimizer-step seconds per stage.
    comm: seconds of one activation transfer between stages (the slowest link used).
    ar_bytes: per stage, bytes of the float32 gradient buffer each worker's device reduces;
      None when `ar_fixed` is.
    ar_bandwidth: bytes/s of one device's link in the ring between nodes.
    ar_latency: seconds per ring step.
    ar_fixed: per stage, a measured all-reduce time used whatever the live count.
    ar_groups: per stage, how many of its workers each node holds in the fault-free layout, in
      node order; None: one a node (the ring alone).
    ar_local: (bytes/s, latency) of a device's link to the others of its node, for the sums
      among a node's workers; needed with `ar_groups`.
    bw: fused-backward seconds per stage; None: `b + w`.
    source: "specs" or "profile", for reports.
    memory: what planners that re-partition the model (Oobleck) need and only the spec model
      knows; None for a measured profile.
  """

  f: tuple[float, ...]
  b: tuple[float, ...]
  w: tuple[float, ...]
  opt: tuple[float, ...]
  comm: float
  ar_bytes: tuple[float, ...] | None = None
  ar_bandwidth: float = 1.0
  ar_latency: float = 0.0
  ar_fixed: tuple[float, ...] | None = None
  ar_groups: tuple[tuple[int, ...], ...] | None = None
  ar_local: tuple[float, float] | None = None
  bw: tuple[float, ...] | None = None
  source: str = "specs"
  memory: StageMemory | None = None

  def __post_init__(self):
    pp = len(self.f)
    for name in ("b", "w", "opt", "ar_bytes", "ar_fixed", "bw"):
      v = getattr(self, name)
      if v is not None and len(v) != pp:
        raise ValueError(f"CostModel.{name} has {len(v)} entries, f has {pp}")
    if (self.ar_bytes is None) == (self.ar_fixed is None):
      raise ValueError("CostModel needs exactly one of ar_bytes (ring model) and ar_fixed")
    if self.ar_groups is not None and (len(self.ar_groups) != pp or self.ar_local is None):
      raise ValueError("CostModel.ar_groups needs one entry a stage and ar_local")

  @property
  def pp(self) -> int:
    return len(self.f)

  def allreduce_seconds(self, stage: int, live: int) -> float:
    """The gradient all-reduce of `stage` over `live` workers."""
    if self.ar_fixed is not None:
      return self.ar_fixed[stage] if live > 1 else 0.0
    elements = ring.elements_of(self.ar_bytes[stage])
    if self.ar_groups is None:
      return ring.seconds(elements, live, self.ar_bandwidth, self.ar_latency)
    return _two_level(elements, _survivors(self.ar_groups[stage], live)).seconds(
      self.ar_local, (self.ar_bandwidth, self.ar_latency))

  def op_costs(self, live: Sequence[int]) -> OpCosts:
    """The `OpCosts` the planners and `simulate` use, with `live[s]` workers left in stage s."""
    if len(live) != self.pp:
      raise ValueError(f"live has {len(live)} entries, the cost model has {self.pp} stages")
    return OpCosts(
      f=self.f,
      b=self.b,
      w=self.w,
      bw=self.bw,
      ar=tuple(self.allreduce_seconds(s, n) for s, n in enumerate(live)),
      opt=self.opt,
      comm=self.comm,
    )

  @classmethod
  def from_specs(
    cls,
    model: ModelSpec,
    device: DeviceSpec,
    network: NetworkSpec,
    layout: Layout,
    *,
    recompute: bool = False,
  ) -> CostModel:
    """Op times from the model's FLOPs and bytes on `device`, transfers from `network`.

    Each worker's `tp` devices split every op's FLOPs and bytes evenly and add two ring
    all-reduces of the activations per layer in F and in B (Megatron-style tensor parallelism).
    An activation transfer sends `tokens * d_model` bf16 values, split over the `tp` devices;
    it is costed on the slowest link any stage boundary uses. The gradient all-reduce of a stage
    reduces each device's shard of the stage's gradients as the runtime does (a float32 buffer,
    `schedule.ring.two_level`): among the workers a node holds over its links, then each piece
    round a ring of the nodes.

    Args:
      model: the model.
      device: one accelerator.
      network: the links.
      layout: grid, batch and placement.
      recompute: activations recomputed in the backward (B re-runs F).

    Returns:
      The cost model.
    """
    tokens = layout.micro_batch_size * model.seq_len
    stages = model.stage_flops(layout.pp, tokens, recompute=recompute)
    tp = layout.tp
    tp_inter = tp > layout.devices_per_node
    tp_bw, tp_lat = network.link(tp_inter)
    act_bytes = tokens * model.d_model * _ACTIVATION_BYTES
    tp_ar = ring_allreduce_seconds(act_bytes, tp, tp_bw, tp_lat)
    f, b, w, opt, ar_bytes, stash = [], [], [], [], [], []
    layers = model.layers_per_stage(layout.pp)
    for st, n in zip(stages, layers, strict=True):
      stash.append(_STASH_BYTES_PER_UNIT * tokens * model.d_model * n)
      per_dev = st.hbm_bytes / tp
      f.append(device.op_seconds(st.f / tp, per_dev) + st.tp_allreduces_f * tp_ar)
      b.append(device.op_seconds(st.b / tp, per_dev) + st.tp_allreduces_b * tp_ar)
      w.append(device.op_seconds(st.w / tp, per_dev))
      opt.append(st.params / tp * _ADAM_BYTES_PER_PARAM / (device.hbm_gbps * 1e9))
      ar_bytes.append(st.params / tp * ring.FLOAT32_BYTES)
    bw, lat = network.link(layout.stage_boundary_crosses_nodes())
    comm = p2p_seconds(act_bytes / tp, bw, lat) if layout.pp > 1 else 0.0
    ar_bw, ar_lat = network.link(True)
    groups = tuple(layout.stage_nodes(s) for s in range(layout.pp))  # None: one a node
    return cls(
      f=tuple(f),
      b=tuple(b),
      w=tuple(w),
      opt=tuple(opt),
      comm=comm,
      ar_bytes=tuple(ar_bytes),
      ar_bandwidth=ar_bw,
      ar_latency=ar_lat,
      ar_groups=None if all(n == 1 for g in groups for n in g) else groups,
      ar_local=network.link(False),
      source="specs",
      memory=StageMemory(
        layers=layers,
        params=tuple(float(st.params) for st in stages),
        stash_bytes=tuple(stash),
        state_bytes_per_param=_STATE_BYTES_PER_PARAM,
        worker_memory=device.memory_gb * 1e9 * tp,
        tp=tp,
      ),
    )

  @classmethod
  def from_profile(cls, profile: Mapping[str, Any], pp: int | None = None) -> CostModel:
    """A cost model from measured per-stage op times (the module docstring gives the format).

    Args:
      profile: the parsed JSON object.
      pp: stages expected; None: as many as `profile["f"]` has.

    Returns:
      The cost model; scalar "ar" and "opt" apply to every stage.

    Raises:
      ValueError: for a missing key, a wrong length or a negative or non-numeric time.
    """
    if not isinstance(profile, Mapping):
      raise ValueError(f"a profile is a JSON object, got {type(profile).__name__}")
    missing = [k for k in ("f", "b", "w", "ar", "opt", "comm") if k not in profile]
    if missing:
      raise ValueError(f"profile is missing {', '.join(missing)}")
    unknown = sorted(set(profile) - {"f", "b", "w", "bw", "ar", "opt", "comm"})
    if unknown:
      raise ValueError(f"profile has unknown keys {', '.join(unknown)}")
    if not isinstance(profile["f"], (list, tuple)) or not profile["f"]:
      raise ValueError("profile.f must be a non-empty list with one time per stage")
    pp = len(profile["f"]) if pp is None else pp
    values = {}
    for key in ("f", "b", "w", "bw", "ar", "opt"):
      if key == "bw" and key not in profile:
        continue
      v = _per_stage(key, profile[key], pp)
      values[key] = v if isinstance(v, tuple) else (v,) * pp
    comm = _per_stage("comm", profile["comm"], None)
    if isinstance(comm, tuple):
      raise ValueError("profile.comm is one latency in seconds, not a list")
    return cls(
      f=values["f"],
      b=values["b"],
      w=values["w"],
      opt=values["opt"],
      comm=comm,
      ar_fixed=values["ar"],
      bw=values.get("bw"),
      source="profile",
    )

  @property
  def node_memory(self) -> float | None:
    """Bytes of one worker's memory (all its `tp` devices); None for a measured profile."""
    return None if self.memory is None else self.memory.worker_memory

  @property
  def allreduce_bandwidth(self) -> float:
    """Bytes/s of a worker's data-parallel all-reduce (its `tp` devices' links together), for
    Oobleck's own pricing: the node's links where every stage's workers share one node."""
    within = self.ar_groups is not None and all(len(g) == 1 for g in self.ar_groups)
    bandwidth = self.ar_local[0] if within else self.ar_bandwidth
    return bandwidth * (self.memory.tp if self.memory is not None else 1)

  def layer_profile(self) -> LayerProfile:
    """A per-layer profile for Oobleck's templates: each stage split evenly over its layers.

    Times and bytes are a worker's (its `tp` devices together); a stage's transfer latency goes
    to the step time's `comm`, not to the profile.

    Raises:
      PolicyUnavailableError: for a measured profile, which has no per-layer memory.
    """
    mem = self.memory
    if mem is None:
      raise PolicyUnavailableError(
        "oobleck re-partitions layers and needs per-layer memory, which only the spec cost "
        "model has (this one is a measured per-stage profile)"
      )
    per: dict[str, list[float]] = {k: [] for k in ("f", "b", "w", "g", "state", "act", "opt")}
    for s, n in enumerate(mem.layers):
      params = mem.params[s] / n
      for _ in range(n):
        per["f"].append(self.f[s] / n)
        per["b"].append(self.b[s] / n)
        per["w"].append(self.w[s] / n)
        per["g"].append(self.ar_bytes[s] * mem.tp / n)
        per["state"].append(params * mem.state_bytes_per_param)
        per["act"].append(mem.stash_bytes[s] / n)
        per["opt"].append(self.opt[s] / n)
    return LayerProfile(
      forward=per["f"],
      backward_input=per["b"],
      backward_weight=per["w"],
      param_bytes=per["g"],
      state_bytes=per["state"],
      activation_bytes=per["act"],
      optimizer=per["opt"],
    )

  def to_profile(self, live: Sequence[int] | None = None) -> dict[str, Any]:
    """This model in the profile format (the all-reduce at `live`, default every stage at 2)."""
    ar = self.op_costs(live or (2,) * self.pp).ar
    out: dict[str, Any] = {
      "f": list(self.f),
      "b": list(self.b),
      "w": list(self.w),
      "ar": list(ar),
      "opt": list(self.opt),
      "comm": self.comm,
    }
    if self.bw is not None:
      out["bw"] = list(self.bw)
    return out


def load_profile(path: str | Path, pp: int | None = None) -> CostModel:
  """Reads a measured profile JSON (see the module docstring) into a `CostModel`.

  Raises:
    ValueError: for unreadable JSON or a malformed profile; the message names the file.
  """
  try:
    data = json.loads(Path(path).read_text())
  except OSError as e:
    raise ValueError(f"cannot read profile {path}: {e.strerror or e}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"profile {path} is not valid JSON: {e.msg} (line {e.lineno})") from None
  try:
    return CostModel.from_profile(data, pp)
  except ValueError as e:
    raise ValueError(f"profile {path}: {e}") from None


def save_profile(costs: CostModel | OpCosts, path: str | Path, pp: int | None = None) -> None:
  """Writes op times in the profile format (an `OpCosts` needs `pp` when its times are scalar)."""
  if isinstance(costs, CostModel):
    data = costs.to_profile()
  else:
    n = (
      pp
      if pp is not None
      else next((len(v) for v in (costs.f, costs.b, costs.w) if isinstance(v, tuple)), 1)
    )
    data = {
      key: [getattr(costs, f"{key}_at")(s) for s in range(n)]
      for key in ("f", "b", "w", "ar", "opt")
    }
    data["comm"] = costs.comm
    if costs.bw is not None:
      data["bw"] = [costs.bw_at(s) for s in range(n)]
  Path(path).write_text(json.dumps(data, indent=1) + "\n")
