"""Oobleck (Jang et al., SOSP'23) as a planning policy: pipeline templates and instantiation.

Oobleck trains with several data-parallel pipelines that need not have the same shape. Ahead of
time it plans one *pipeline template* per node count: the best split of the model's layers into
that many stages, one node per stage. It then *instantiates* a combination of templates that uses
every node and has at least `f + 1` pipelines, so that any `f` failures leave every layer with a
live replica, and deals the global batch out in proportion to each pipeline's speed. After
failures it *re-instantiates* from the same templates on the survivors and copies the layers that
land on a node which did not hold them.

Everything here is pure planning on a per-layer profile (no JAX): the runtime parts are
elsewhere. Step times use the library's own cost model: every pipeline is a `Schedule` with
`dp=1` and its own stage count (a heterogeneous set of pipelines does not fit one `Schedule`,
whose stages are uniform), costed by `cost.simulate`, so Oobleck and the ReCycle planners are
compared on the same model.

Template objective. For a pipeline of K stages with per-micro-batch stage times t_1..t_K (F+B+W),
1F1B takes about `(m - 1) * max_s t_s + sum_s t_s` for m micro-batches: the bottleneck stage
paces the steady state and every stage is crossed once while filling and draining. Stage times
are sums of layer times plus a fixed per-stage overhead, so `sum_s t_s` is the same for every
K-stage split and minimising the bottleneck minimises the whole expression for every m. The
planner therefore solves, exactly, min over splits of max_s t_s subject to each node's memory,
by dynamic programming over (first layer, stages left); `brute_force_partition` checks it.

Memory of a stage: the fixed per-node bytes, plus its layers' resident state (parameters,
gradients, optimizer state), plus one set of stashed activations per micro-batch it holds in
flight, which under 1F1B is `min(K - s, m)` for stage s: the number of stages left from it to the
end, a quantity the dynamic programme knows, so the constraint is exact.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
from scipy import optimize

from resilient_jax.schedule.core import Schedule
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import generate

__all__ = [
  "InstantiationError",
  "LayerProfile",
  "LayersLostError",
  "OobleckInstance",
  "PipelineInstance",
  "PipelineTemplate",
  "RecoveryCost",
  "TemplateSet",
  "brute_force_partition",
  "distribute_microbatches",
  "fault_tolerance_gaps",
  "instantiate",
  "oobleck_recovery_cost",
  "oobleck_step_time",
  "pipeline_schedules",
  "plan_templates",
  "reinstantiate",
  "stage_costs",
  "template_for",
]

LayerRange = tuple[int, int]
"""Layers `[lo, hi)` of one stage."""


class InstantiationError(ScheduleError):
  """No combination of the templates uses exactly the given nodes (with enough pipelines)."""


class LayersLostError(ScheduleError):
  """Some layer has no live replica left: only a restart from a checkpoint can recover."""


def _floats(name: str, values: Iterable[float], n: int | None) -> tuple[float, ...]:
  out = tuple(float(v) for v in values)
  if n is not None and len(out) != n:
    raise ValueError(f"LayerProfile.{name} has {len(out)} entries, expected {n}")
  for v in out:
    if not math.isfinite(v) or v < 0:
      raise ValueError(f"LayerProfile.{name}: {v!r} is not a finite non-negative number")
  return out


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Per-layer costs of one micro-batch, the input of template planning.

  Attributes:
    forward: forward time of each layer.
    backward_input: input-gradient (B) time of each layer.
    backward_weight: weight-gradient (W) time of each layer; B + W is the fused backward.
    param_bytes: bytes of each layer's gradients, the volume of its data-parallel all-reduce.
    state_bytes: bytes resident on a node that owns the layer (parameters, gradients, optimizer
      state): what must be copied when the layer moves to another node.
    activation_bytes: bytes a layer stashes per micro-batch between its forward and backward.
    optimizer: optimizer-step time of each layer; None means zero.
    stage_overhead: fixed time added to every F and every B of a stage (launch, send/receive),
      which makes more stages cost more.
    stage_bytes: fixed memory of every node (runtime, workspace, communication buffers).
  """

  forward: tuple[float, ...]
  backward_input: tuple[float, ...]
  backward_weight: tuple[float, ...]
  param_bytes: tuple[float, ...]
  state_bytes: tuple[float, ...]
  activation_bytes: tuple[float, ...]
  optimizer: tuple[float, ...] | None = None
  stage_overhead: float = 0.0
  stage_bytes: float = 0.0

  def __post_init__(self):
    n = len(tuple(self.forward))
    if n < 1:
      raise ValueError("LayerProfile needs at least one layer")
    for name in (
      "forward",
      "backward_input",
      "backward_weight",
      "param_bytes",
      "state_bytes",
      "activation_bytes",
    ):
      object.__setattr__(self, name, _floats(name, getattr(self, name), n))
    opt = (0.0,) * n if self.optimizer is None else self.optimizer
    object.__setattr__(self, "optimizer", _floats("optimizer", opt, n))
    for name in ("stage_overhead", "stage_bytes"):
      object.__setattr__(self, name, _floats(name, (getattr(self, name),), 1)[0])

  @property
  def num_layers(self) -> int:
    return len(self.forward)

  @classmethod
  def uniform(
    cls,
    num_layers: int,
    *,
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    param_bytes: float = 1.0,
    state_bytes: float = 8.0,
    activation_bytes: float = 1.0,
    stage_overhead: float = 0.0,
    stage_bytes: float = 0.0,
  ) -> LayerProfile:
    """`num_layers` identical layers."""
    n = num_layers
    return cls(
      forward=(forward,) * n,
      backward_input=(backward_input,) * n,
      backward_weight=(backward_weight,) * n,
      param_bytes=(param_bytes,) * n,
      state_bytes=(state_bytes,) * n,
      activation_bytes=(activation_bytes,) * n,
      stage_overhead=stage_overhead,
      stage_bytes=stage_bytes,
    )

  @classmethod
  def gpt(
    cls,
    num_layers: int,
    hidden: int,
    *,
    seq_len: int = 2048,
    micro_batch: int = 1,
    vocab: int = 50304,
    flops_per_s: float = 150e12,
    grad_bytes_per_param: float = 2.0,
    state_bytes_per_param: float = 16.0,
    hbm_bytes_per_s: float | None = None,
    stage_overhead: float = 0.0,
    stage_bytes: float = 0.0,
  ) -> LayerProfile:
    """An analytic profile of a GPT with `num_layers` transformer blocks.

    The token embedding is folded into the first layer and the final norm and (untied) LM head
    into the last, so the profile has exactly `num_layers` layers. Forward FLOPs of a block are
    `tokens * (24 h^2 + 4 s h)` and the head's `2 * tokens * h * vocab`; B and W each cost about
    one forward. Stashed activations follow Korthikanti et al. (2022) with flash attention:
    `34 * s * b * h` bytes per block, plus fp32 logits for the head.

    Args:
      num_layers: transformer blocks.
      hidden: model width h.
      seq_len: tokens per sequence s.
      micro_batch: sequences per micro-batch b.
      vocab: vocabulary size.
      flops_per_s: achieved FLOP/s of one node.
      grad_bytes_per_param: bytes of a gradient element (all-reduce volume).
      state_bytes_per_param: resident bytes per parameter (16 for mixed-precision Adam: bf16
        weight and gradient, fp32 master weight and two moments).
      hbm_bytes_per_s: memory bandwidth for the optimizer step (it streams the state once);
        None makes the step free.
      stage_overhead: as for `LayerProfile`.
      stage_bytes: as for `LayerProfile`.

    Returns:
      The profile.
    """
    if num_layers < 1 or hidden < 1:
      raise ValueError("num_layers and hidden must be positive")
    h, s = float(hidden), float(seq_len)
    tokens = s * micro_batch
    block_params = 12 * h * h + 13 * h
    block_f = tokens * (24 * h * h + 4 * s * h) / flops_per_s
    params = [block_params] * num_layers
    fwd = [block_f] * num_layers
    bwd = [block_f] * num_layers
    act = [34 * tokens * h] * num_layers
    params[0] += vocab * h + s * h
    params[-1] += vocab * h + 2 * h
    head_f = 2 * tokens * h * vocab / flops_per_s
    fwd[-1] += head_f
    bwd[-1] += head_f
    act[-1] += 4 * tokens * vocab
    state = [p * state_bytes_per_param for p in params]
    opt = None if hbm_bytes_per_s is None else [b / hbm_bytes_per_s for b in state]
    return cls(
      forward=fwd,
      backward_input=bwd,
      backward_weight=list(bwd),
      param_bytes=[p * grad_bytes_per_param for p in params],
      state_bytes=state,
      activation_bytes=act,
      optimizer=opt,
      stage_overhead=stage_overhead,
      stage_bytes=stage_bytes,
    )

  @functools.cached_property
  def _prefix(self) -> dict[str, np.ndarray]:
    # Prefix sums make every stage quantity an O(1) difference, the DP's inner loop.
    names = (
      "forward",
      "backward_input",
      "backward_weight",
      "param_bytes",
      "state_bytes",
      "activation_bytes",
      "optimizer",
    )
    return {n: np.concatenate([[0.0], np.cumsum(getattr(self, n))]) for n in names}

  def range_sum(self, name: str, lo: int, hi: int) -> float:
    """Sum of the per-layer field `name` over layers `[lo, hi)`."""
    p = self._prefix[name]
    return float(p[hi] - p[lo])

  def stage_time(self, lo: int, hi: int) -> float:
    """F + B + W of one micro-batch on a stage holding layers `[lo, hi)`, overheads included."""
    return (
      self.range_sum("forward", lo, hi)
      + self.range_sum("backward_input", lo, hi)
      + self.range_sum("backward_weight", lo, hi)
      + 2 * self.stage_overhead
    )

  def stage_memory(self, lo: int, hi: int, inflight: int) -> float:
    """Peak bytes of a node holding layers `[lo, hi)` with `inflight` micro-batches stashed."""
    return (
      self.stage_bytes
      + self.range_sum("state_bytes", lo, hi)
      + inflight * self.range_sum("activation_bytes", lo, hi)
    )


@dataclasses.dataclass(frozen=True)
class PipelineTemplate:
  """The planned split of the model over a pipeline of `num_nodes` nodes, one stage per node.

  Attributes:
    stages: layers `[lo, hi)` of every stage, in pipeline order, covering the model.
    stage_times: F + B + W of one micro-batch on every stage.
    stage_memory: peak bytes of every stage's node under 1F1B (see the module docstring).
    microbatches: the micro-batches per pipeline the memory check assumed (None: at least as
      many as stages, the worst case).
  """

  stages: tuple[LayerRange, ...]
  stage_times: tuple[float, ...]
  stage_memory: tuple[float, ...]
  microbatches: int | None = None

  @property
  def num_nodes(self) -> int:
    return len(self.stages)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def bottleneck(self) -> float:
    """The slowest stage's time per micro-batch: the steady-state period."""
    return max(self.stage_times)

  @property
  def latency(self) -> float:
    """One micro-batch's forward and backward through every stage."""
    return sum(self.stage_times)

  def iteration_time(self, microbatches: int) -> float:
    """1F1B estimate for `microbatches` micro-batches: `(m - 1) * bottleneck + latency`."""
    return (microbatches - 1) * self.bottleneck + self.latency

  def stage_of_layer(self, layer: int) -> int:
    for s, (lo, hi) in enumerate(self.stages):
      if lo <= layer < hi:
        return s
    raise ValueError(f"layer {layer} is not in this template")


def _template(
  profile: LayerProfile, stages: Sequence[LayerRange], m: int | None
) -> PipelineTemplate:
  k = len(stages)
  inflight = [k - s if m is None else min(k - s, m) for s in range(k)]
  return PipelineTemplate(
    stages=tuple((int(lo), int(hi)) for lo, hi in stages),
    stage_times=tuple(profile.stage_time(lo, hi) for lo, hi in stages),
    stage_memory=tuple(
      profile.stage_memory(lo, hi, j) for (lo, hi), j in zip(stages, inflight, strict=True)
    ),
    microbatches=m,
  )


def template_for(
  profile: LayerProfile, stages: Sequence[LayerRange], microbatches: int | None = None
) -> PipelineTemplate:
  """The template of a given split (e.g. a DP x PP grid's, to re-instantiate from it)."""
  return _template(profile, stages, microbatches)


@dataclasses.dataclass(frozen=True)
class TemplateSet(Mapping[int, PipelineTemplate]):
  """The templates of one model, by node count, with the profile they were planned from.

  Attributes:
    profile: the per-layer profile.
    templates: the best template for every feasible node count.
    node_memory: the per-node memory the plan respected (None: unbounded).
  """

  profile: LayerProfile
  templates: Mapping[int, PipelineTemplate]
  node_memory: float | None = None

  def __getitem__(self, num_nodes: int) -> PipelineTemplate:
    return self.templates[num_nodes]

  def __iter__(self) -> Iterator[int]:
    return iter(sorted(self.templates))

  def __len__(self) -> int:
    return len(self.templates)

  @property
  def sizes(self) -> list[int]:
    return sorted(self.templates)


def _check_microbatches(m: int | None) -> None:
  if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
    raise ValueError(f"microbatches must be a positive int or None, got {m!r}")


def plan_templates(
  profile: LayerProfile,
  min_nodes: int,
  max_nodes: int,
  node_memory: float | None = None,
  *,
  microbatches: int | None = None,
) -> TemplateSet:
  """The optimal template for every node count in `[min_nodes, max_nodes]` that fits.

  A template has one stage per node and at least one layer per stage, so counts above the
  number of layers are not single pipelines (more nodes are used through more pipelines) and
  are skipped, as are counts for which no split fits in `node_memory`.

  Dynamic programme: `best[j][l]` is the smallest bottleneck of layers `[l, L)` cut into `j`
  stages whose first one holds `min(j, m)` micro-batches in flight; `best[j][l] = min over r of
  max(t(l, r), best[j-1][r])` over memory-feasible first stages `[l, r)`. One table answers every
  node count at once (`best[K][0]`), in O(L^2 * K) vectorised work: about 0.1 s for 96 layers.

  Args:
    profile: per-layer costs.
    min_nodes: smallest pipeline to plan.
    max_nodes: largest pipeline to plan (capped at the number of layers).
    node_memory: bytes per node; None for no limit.
    microbatches: micro-batches per pipeline, which bounds the activations a stage stashes;
      None assumes at least as many as stages (the worst case). The time objective does not
      depend on it (module docstring).

  Returns:
    The templates, by node count.

  Raises:
    InstantiationError: when no node count in the range fits in memory.
    ValueError: for a bad range.
  """
  _check_microbatches(microbatches)
  if min_nodes < 1 or max_nodes < min_nodes:
    raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}, {max_nodes}")
  n = profile.num_layers
  kmax = min(max_nodes, n)
  pre = profile._prefix
  time_p = pre["forward"] + pre["backward_input"] + pre["backward_weight"]
  lo = np.arange(n)[:, None]
  hi = np.arange(n + 1)[None, :]
  valid = hi > lo
  # t[l, r] and the stage's resident and stashed bytes, for layers [l, r); inf/ignored if r <= l.
  t = np.where(valid, time_p[hi] - time_p[lo] + 2 * profile.stage_overhead, np.inf)
  resident = profile.stage_bytes + pre["state_bytes"][hi] - pre["state_bytes"][lo]
  stashed = pre["activation_bytes"][hi] - pre["activation_bytes"][lo]

  best = np.full((kmax + 1, n + 1), np.inf)
  best[0, n] = 0.0  # zero stages cover the empty suffix
  choice = np.zeros((kmax + 1, n), dtype=np.int64)
  for j in range(1, kmax + 1):
    inflight = j if microbatches is None else min(j, microbatches)
    ok = valid
    if node_memory is not None:
      ok = valid & (resident + inflight * stashed <= node_memory)
    cand = np.where(ok, np.maximum(t, best[j - 1][None, :]), np.inf)
    # argmin takes the first minimum: the shortest first stage, which stashes the most.
    choice[j] = np.argmin(cand, axis=1)
    best[j, :n] = cand[np.arange(n), choice[j]]

  templates: dict[int, PipelineTemplate] = {}
  for k in range(min_nodes, kmax + 1):
    if not math.isfinite(best[k, 0]):
      continue
    stages, layer = [], 0
    for j in range(k, 0, -1):
      r = int(choice[j, layer])
      stages.append((layer, r))
      layer = r
    templates[k] = _template(profile, stages, microbatches)
  if not templates:
    raise InstantiationError(
      f"no pipeline of {min_nodes}..{kmax} nodes fits the {n}-layer model in "
      f"{node_memory} bytes per node"
    )
  return TemplateSet(profile=profile, templates=templates, node_memory=node_memory)


def brute_force_partition(
  profile: LayerProfile,
  num_stages: int,
  microbatches: int,
  node_memory: float | None = None,
) -> tuple[float, tuple[LayerRange, ...]] | None:
  """The best split by enumerating all of them (for tests: C(L-1, K-1) splits).

  Args:
    profile: per-layer costs.
    num_stages: stages K.
    microbatches: m, for the objective `(m - 1) * max_s t_s + sum_s t_s` and for memory.
    node_memory: bytes per node; None for no limit.

  Returns:
    `(objective, stages)` of an optimal split, or None when none fits.
  """
  n, k = profile.num_layers, num_stages
  best: tuple[float, tuple[LayerRange, ...]] | None = None
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0, *cuts, n)
    stages = tuple(zip(bounds[:-1], bounds[1:], strict=True))
    if node_memory is not None and any(
      profile.stage_memory(lo, hi, min(k - s, microbatches)) > node_memory
      for s, (lo, hi) in enumerate(stages)
    ):
      continue
    times = [profile.stage_time(lo, hi) for lo, hi in stages]
    obj = (microbatches - 1) * max(times) + sum(times)
    if best is None or obj < best[0]:
      best = (obj, stages)
  return best


def distribute_microbatches(bottlenecks: Sequence[float], total: int) -> tuple[int, ...]:
  """Deals `total` micro-batches to pipelines in proportion to their speed, 1 / bottleneck.

  Largest remainders (Hamilton): each pipeline gets the floor of its share, the leftovers go to
  the largest fractional parts, so every count is within one of its exact share and the counts
  sum to `total`. A pipeline must run at least one micro-batch; when a share is below one the
  pipeline gets one from the pipeline furthest above its share.

  Args:
    bottlenecks: per pipeline, its time per micro-batch in steady state (> 0).
    total: micro-batches in the global batch, at least the number of pipelines.

  Returns:
    Micro-batches per pipeline.

  Raises:
    ValueError: for fewer micro-batches than pipelines or a non-positive bottleneck.
  """
  q = len(bottlenecks)
  if q < 1 or total < q:
    raise ValueError(f"{total} micro-batches cannot keep {q} pipelines busy")
  if any(not b > 0 for b in bottlenecks):
    raise ValueError(f"pipeline bottlenecks must be positive, got {list(bottlenecks)}")
  speed = [1.0 / b for b in bottlenecks]
  whole = sum(speed)
  shares = [total * v / whole for v in speed]
  counts = [math.floor(x) for x in shares]
  left = total - sum(counts)
  for i in sorted(range(q), key=lambda i: (counts[i] - shares[i], i))[:left]:
    counts[i] += 1
  for i in range(q):
    if counts[i] == 0:
      donor = max((j for j in range(q) if counts[j] > 1), key=lambda j: counts[j] - shares[j])
      counts[donor] -= 1
      counts[i] = 1
  return tuple(counts)


@dataclasses.dataclass(frozen=True)
class PipelineInstance:
  """One running pipeline: a template placed on nodes, with its share of the batch.

  Attributes:
    template: its layer split.
    nodes: the node running every stage, in stage order.
    microbatches: micro-batches it runs per step.
    first_microbatch: the global id of its first micro-batch; it owns
      `first_microbatch .. first_microbatch + microbatches - 1`.
  """

  template: PipelineTemplate
  nodes: tuple[int, ...]
  microbatches: int
  first_microbatch: int = 0

  @property
  def iteration_time(self) -> float:
    return self.template.iteration_time(self.microbatches)


@dataclasses.dataclass(frozen=True)
class OobleckInstance:
  """A set of heterogeneous pipelines that together train on every node.

  Attributes:
    pipelines: the pipelines, largest first.
    tolerate: failures it is built to survive (it has at least `tolerate + 1` pipelines).
    global_microbatches: micro-batches of the global batch, summed over pipelines.
    profile: the profile its templates came from.
  """

  pipelines: tuple[PipelineInstance, ...]
  tolerate: int
  global_microbatches: int
  profile: LayerProfile = dataclasses.field(repr=False, compare=False)

  @property
  def num_pipelines(self) -> int:
    return len(self.pipelines)

  @property
  def nodes(self) -> list[int]:
    return sorted(n for p in self.pipelines for n in p.nodes)

  @property
  def step_time(self) -> float:
    """The analytic step time: the slowest pipeline's `iteration_time`."""
    return max(p.iteration_time for p in self.pipelines)

  def layers_of(self) -> dict[int, LayerRange]:
    """The layers `[lo, hi)` every node holds."""
    return {
      node: rng
      for p in self.pipelines
      for node, rng in zip(p.nodes, p.template.stages, strict=True)
    }

  def describe(self) -> str:
    lines = [
      f"oobleck: {self.num_pipelines} pipelines on {len(self.nodes)} nodes, "
      f"B={self.global_microbatches} micro-batches, tolerates {self.tolerate}"
    ]
    for p in self.pipelines:
      lines.append(
        f"  {p.template.num_nodes:3d} nodes m={p.microbatches:4d} "
        f"bottleneck={p.template.bottleneck:.4g} iter={p.iteration_time:.4g} "
        f"stages={list(p.template.stages)}"
      )
    return "\n".join(lines)


def _templates_list(templates: TemplateSet) -> list[PipelineTemplate]:
  out = [templates[k] for k in templates]
  if any(not t.bottleneck > 0 for t in out):
    raise ValueError("every template needs a positive bottleneck stage time")
  return out


def _max_pipelines(sizes: Sequence[int], total: int) -> np.ndarray:
  """`most[n]`: the most pipelines of the given sizes that use exactly n nodes (-1: none)."""
  most = np.full(total + 1, -1, dtype=np.int64)
  most[0] = 0
  for n in range(1, total + 1):
    prev = [most[n - s] for s in sizes if s <= n and most[n - s] >= 0]
    if prev:
      most[n] = max(prev) + 1
  return most


def fault_tolerance_gaps(templates: TemplateSet, num_nodes: int, tolerate: int) -> list[int]:
  """Where Oobleck's `tolerate + 1` guarantee breaks for this template set.

  The guarantee: `num_nodes` nodes can be covered by at least `tolerate + 1` pipelines (so any
  `tolerate` failures leave one pipeline, i.e. a replica of every layer, intact), and for every
  `k <= tolerate` failures the `num_nodes - k` survivors can again be covered exactly by
  templates. Nodes are interchangeable, so only the number of survivors matters. With templates
  for every size in `[n0, n1]` and `n1 >= 2 * n0 - 1`, every count from `n0` up is coverable
  (q pipelines cover `[q * n0, q * n1]`, and consecutive ranges then touch).

  Args:
    templates: the planned templates.
    num_nodes: nodes at the start.
    tolerate: failures to survive (f).

  Returns:
    The node counts that break it, in decreasing order (empty: the guarantee holds).
  """
  most = _max_pipelines(templates.sizes, num_nodes)
  gaps = []
  if most[num_nodes] < tolerate + 1:
    gaps.append(num_nodes)
  for k in range(1, tolerate + 1):
    if num_nodes - k < 0 or most[num_nodes - k] < 1:
      gaps.append(num_nodes - k)
  return gaps


def _choose(
  templates: Sequence[PipelineTemplate], num_nodes: int, min_pipelines: int, total_mb: int
) -> list[PipelineTemplate] | None:
  """A combination of templates using exactly `num_nodes`, with `min_pipelines` or more.

  With micro-batches dealt in proportion to speed w_i = 1 / bottleneck_i, pipeline i takes about
  `B * w_i / W` of them (W = sum of speeds) and finishes at about `B / W + (latency_i -
  bottleneck_i)`. So the step is about `B / W + max_i D_i` with `D_i = latency_i - bottleneck_i`
  (the fill and drain). For each threshold on D (templates sorted by D) an unbounded knapsack
  over (pipelines, nodes) maximises W among templates under the threshold; the best threshold
  wins. Adding templates in D order lets one knapsack table serve every threshold, so the
  whole search is O(#templates * max_pipelines) vector operations over the node axis.
  """
  if not templates:
    return None
  order = sorted(
    range(len(templates)), key=lambda i: templates[i].latency - templates[i].bottleneck
  )
  cmax = min(total_mb, num_nodes // min(t.num_nodes for t in templates))
  if cmax < min_pipelines:
    return None

  def knapsack(items: list[int], track: bool):
    best = np.full((cmax + 1, num_nodes + 1), -np.inf)
    best[0, 0] = 0.0
    pick = np.full((cmax + 1, num_nodes + 1), -1, dtype=np.int64) if track else None
    scores = []
    for i in items:
      size, w = templates[i].num_nodes, 1.0 / templates[i].bottleneck
      if size > num_nodes:
        scores.append(-np.inf)
        continue
      for c in range(1, cmax + 1):
        # Ascending c: row c - 1 already holds combinations that use this template.
        cand = best[c - 1, : num_nodes + 1 - size] + w
        better = cand > best[c, size:]
        if better.any():
          best[c, size:][better] = cand[better]
          if track:
            pick[c, size:][better] = i
      scores.append(best[min_pipelines:, num_nodes].max())
    return best, pick, scores

  _, _, scores = knapsack(order, track=False)
  best_k, best_t = -1, math.inf
  for k, i in enumerate(order):
    if scores[k] > 0:
      d = templates[i].latency - templates[i].bottleneck
      est = total_mb / scores[k] + d
      if est < best_t:
        best_k, best_t = k, est
  if best_k < 0:
    return None
  best, pick, _ = knapsack(order[: best_k + 1], track=True)
  c = min_pipelines + int(np.argmax(best[min_pipelines:, num_nodes]))
  n, chosen = num_nodes, []
  while c > 0:
    i = int(pick[c, n])
    chosen.append(templates[i])
    n -= templates[i].num_nodes
    c -= 1
  assert n == 0, "knapsack reconstruction must end at zero nodes"
  return sorted(chosen, key=lambda t: (-t.num_nodes, t.stages))


def _build(
  chosen: Sequence[PipelineTemplate],
  node_lists: Sequence[Sequence[int]],
  tolerate: int,
  total_mb: int,
  profile: LayerProfile,
) -> OobleckInstance:
  counts = distribute_microbatches([t.bottleneck for t in chosen], total_mb)
  pipes, first = [], 0
  for t, nodes, m in zip(chosen, node_lists, counts, strict=True):
    pipes.append(PipelineInstance(t, tuple(nodes), m, first))
    first += m
  return OobleckInstance(tuple(pipes), tolerate, total_mb, profile)


def _check_counts(tolerate: int, total_mb: int) -> None:
  if isinstance(tolerate, bool) or not isinstance(tolerate, int) or tolerate < 0:
    raise ValueError(f"tolerate must be an int >= 0, got {tolerate!r}")
  if isinstance(total_mb, bool) or not isinstance(total_mb, int) or total_mb < tolerate + 1:
    raise ValueError(
      f"global_microbatches must be an int >= tolerate + 1 = {tolerate + 1}, got {total_mb!r}"
    )


def instantiate(
  templates: TemplateSet,
  num_nodes: int,
  tolerate: int,
  global_microbatches: int,
  *,
  nodes: Sequence[int] | None = None,
) -> OobleckInstance:
  """Pipelines from `templates` on all `num_nodes` nodes, at least `tolerate + 1` of them.

  The combination minimises the estimated step time (see `_choose`), the global batch is dealt
  in proportion to pipeline speed (`distribute_microbatches`), and nodes are handed out in
  order, largest pipeline first.

  Args:
    templates: from `plan_templates`.
    num_nodes: nodes to use, all of them.
    tolerate: failures to survive (f; `resilience.tolerate`).
    global_microbatches: micro-batches of the global batch; their sum over pipelines.
    nodes: the node ids; default `0 .. num_nodes - 1`.

  Returns:
    The instance.

  Raises:
    InstantiationError: when no combination uses exactly `num_nodes` with enough pipelines.
    ValueError: for bad arguments.
  """
  _check_counts(tolerate, global_microbatches)
  ids = list(range(num_nodes)) if nodes is None else list(nodes)
  if len(ids) != num_nodes or len(set(ids)) != num_nodes:
    raise ValueError(f"need {num_nodes} distinct node ids, got {len(set(ids))}")
  chosen = _choose(_templates_list(templates), num_nodes, tolerate + 1, global_microbatches)
  if chosen is None:
    raise InstantiationError(
      f"{num_nodes} nodes cannot be covered by {tolerate + 1} or more pipelines of sizes "
      f"{templates.sizes} with {global_microbatches} micro-batches"
    )
  node_lists, at = [], 0
  for t in chosen:
    node_lists.append(ids[at : at + t.num_nodes])
    at += t.num_nodes
  return _build(chosen, node_lists, tolerate, global_microbatches, templates.profile)


def _assign(
  chosen: Sequence[PipelineTemplate], survivors: Sequence[int], old: OobleckInstance
) -> list[list[int]]:
  """Places survivors on the new stages so that they keep as many of their bytes as possible.

  A maximum-weight assignment (scipy's Hungarian solver) of nodes to stages, the weight being
  the resident bytes of the layers a node already holds that the stage needs.
  """
  prefix = old.profile._prefix["state_bytes"]
  held = old.layers_of()
  old_lo = np.array([held[n][0] for n in survivors])
  old_hi = np.array([held[n][1] for n in survivors])
  slots = [(i, s, rng) for i, t in enumerate(chosen) for s, rng in enumerate(t.stages)]
  new_lo = np.array([r[0] for _, _, r in slots])
  new_hi = np.array([r[1] for _, _, r in slots])
  lo = np.maximum(old_lo[:, None], new_lo[None, :])
  hi = np.minimum(old_hi[:, None], new_hi[None, :])
  kept = np.where(hi > lo, prefix[np.maximum(hi, lo)] - prefix[lo], 0.0)
  rows, cols = optimize.linear_sum_assignment(kept, maximize=True)
  node_lists = [[-1] * t.num_nodes for t in chosen]
  for r, c in zip(rows, cols, strict=True):
    i, s, _ = slots[c]
    node_lists[i][s] = survivors[r]
  return node_lists


@dataclasses.dataclass(frozen=True)
class RecoveryCost:
  """State to copy when re-instantiating.

  Attributes:
    total_bytes: bytes copied over all nodes.
    per_node: bytes each node receives (nodes receiving nothing are left out).
    moves: `(node, lo, hi)`: node receives layers `[lo, hi)` (one contiguous run per entry).
  """

  total_bytes: float
  per_node: dict[int, float]
  moves: tuple[tuple[int, int, int], ...]

  @property
  def max_node_bytes(self) -> float:
    """The most any node receives: with one link per node, copy time is this / bandwidth."""
    return max(self.per_node.values(), default=0.0)


def oobleck_recovery_cost(old: OobleckInstance, new: OobleckInstance) -> RecoveryCost:
  """The parameters and optimizer state to copy to go from `old` to `new`.

  A node of `new` needs every layer of its new stage it did not hold in `old` (all of them if it
  was not in `old`); the bytes are the profile's `state_bytes`.

  Args:
    old: the instance before the failures.
    new: the re-instantiated one, on surviving nodes.

  Returns:
    The copy volume.

  Raises:
    LayersLostError: when a needed layer has no holder among `new`'s nodes in `old`.
  """
  prefix = old.profile._prefix["state_bytes"]
  before = old.layers_of()
  live = set(new.nodes)
  holders = [False] * old.profile.num_layers
  for node, (lo, hi) in before.items():
    if node in live:
      for layer in range(lo, hi):
        holders[layer] = True
  per_node: dict[int, float] = {}
  moves = []
  for node, (lo, hi) in sorted(new.layers_of().items()):
    olo, ohi = before.get(node, (0, 0))
    # The new range minus the old one is at most two runs: below and above the kept overlap.
    runs = [(lo, hi)] if ohi <= lo or olo >= hi or olo >= ohi else [(lo, olo), (ohi, hi)]
    for a, b in runs:
      if a >= b:
        continue
      missing = [layer for layer in range(a, b) if not holders[layer]]
      if missing:
        raise LayersLostError(f"layers {missing} have no surviving replica")
      per_node[node] = per_node.get(node, 0.0) + float(prefix[b] - prefix[a])
      moves.append((node, a, b))
  return RecoveryCost(sum(per_node.values()), per_node, tuple(moves))


def reinstantiate(
  instance: OobleckInstance,
  failed: Iterable[int],
  templates: TemplateSet,
  *,
  tolerate: int | None = None,
) -> OobleckInstance:
  """Re-plans after `failed` nodes died, on all survivors, with the same global batch.

  Two candidates are built and the faster (then the cheaper to reach) is returned:

  * local repair, as Oobleck does first: pipelines that lost no node are kept as they are; the
    survivors of the damaged ones are pooled and re-cut into the best templates for their count;
  * a global re-plan: `instantiate`'s best combination for the survivors.

  Survivors are then placed on stages by a maximum-retention assignment, and the batch is dealt
  again in proportion to speed. It keeps `tolerate + 1` pipelines when the survivors allow it,
  else as many as they allow (the new instance's `tolerate` says which).

  Args:
    instance: the running instance.
    failed: failed node ids.
    templates: the template set it was built from.
    tolerate: failures the new instance should survive; default the old instance's.

  Returns:
    The new instance (the old one if nothing failed).

  Raises:
    LayersLostError: when some layer lost every replica.
    InstantiationError: when the survivors cannot be covered by templates at all.
    ValueError: for unknown node ids.
  """
  dead = set(failed)
  unknown = dead - set(instance.nodes)
  if unknown:
    raise ValueError(f"failed nodes {sorted(unknown)} are not in the instance")
  if not dead:
    return instance
  survivors = [n for n in instance.nodes if n not in dead]
  covered = [False] * instance.profile.num_layers
  for node, (lo, hi) in instance.layers_of().items():
    if node not in dead:
      covered[lo:hi] = [True] * (hi - lo)
  if not all(covered):
    lost = [i for i, c in enumerate(covered) if not c]
    raise LayersLostError(f"layers {lost} lost every replica: restart from a checkpoint")
  total_mb = instance.global_microbatches
  sizes = templates.sizes
  most = _max_pipelines(sizes, len(survivors))
  if most[len(survivors)] < 1:
    raise InstantiationError(
      f"{len(survivors)} surviving nodes cannot be covered by pipelines of sizes {sizes}"
    )
  want = (instance.tolerate if tolerate is None else tolerate) + 1
  want = max(1, min(want, int(most[len(survivors)]), total_mb))
  tlist = _templates_list(templates)

  candidates: list[list[PipelineTemplate]] = []
  glob = _choose(tlist, len(survivors), want, total_mb)
  if glob is not None:
    candidates.append(glob)
  kept = [p.template for p in instance.pipelines if not dead.intersection(p.nodes)]
  pooled = sum(p.template.num_nodes for p in instance.pipelines if dead.intersection(p.nodes))
  pooled -= len(dead)
  if pooled == 0:
    if len(kept) >= want:
      candidates.append(kept)
  else:
    need = max(1, want - len(kept))
    local = _choose(tlist, pooled, need, max(need, total_mb - len(kept)))
    if local is not None:
      candidates.append(sorted(kept + local, key=lambda t: (-t.num_nodes, t.stages)))
  if not candidates:
    raise InstantiationError(f"no combination of sizes {sizes} covers {len(survivors)} nodes")

  built = [
    _build(chosen, _assign(chosen, survivors, instance), want - 1, total_mb, instance.profile)
    for chosen in candidates
  ]
  # The faster, then the cheaper to reach; the first of equals.
  return min(
    built, key=lambda new: (new.step_time, oobleck_recovery_cost(instance, new).total_bytes)
  )


def stage_costs(
  profile: LayerProfile,
  stages: Sequence[LayerRange],
  *,
  replicas: int = 1,
  allreduce_bandwidth: float | None = None,
  comm: float = 0.0,
) -> OpCosts:
  """Per-stage `OpCosts` of a pipeline cut as `stages`: the bridge to `cost.simulate`.

  The same function prices a homogeneous DP x PP grid for ReCycle (pass its stage split and
  `replicas=dp`), so every policy is costed by the same profile and the same replay.

  Args:
    profile: per-layer costs.
    stages: layer ranges, in pipeline order.
    replicas: data-parallel replicas of every layer (pipelines), for the all-reduce time.
    allreduce_bandwidth: bytes/s of each node's link in a ring all-reduce, which moves
      `2 * (r - 1) / r` of the gradient bytes; None makes the all-reduce free.
    comm: transfer latency between consecutive stages.

  Returns:
    Per-stage costs.
  """
  ov = profile.stage_overhead

  def per_stage(name: str, extra: float = 0.0) -> tuple[float, ...]:
    return tuple(profile.range_sum(name, lo, hi) + extra for lo, hi in stages)

  if allreduce_bandwidth is None or replicas <= 1:
    ar = (0.0,) * len(stages)
  else:
    factor = 2.0 * (replicas - 1) / replicas / allreduce_bandwidth
    ar = tuple(factor * g for g in per_stage("param_bytes"))
  return OpCosts(
    f=per_stage("forward", ov),
    b=per_stage("backward_input", ov),
    w=per_stage("backward_weight"),
    ar=ar,
    opt=per_stage("optimizer"),
    comm=comm,
  )


def pipeline_schedules(
  instance: OobleckInstance,
  *,
  base: str = "1f1b",
  comm: float = 0.0,
  allreduce_bandwidth: float | None = None,
) -> list[tuple[PipelineInstance, Schedule, OpCosts]]:
  """Every pipeline of `instance` as a `dp=1` schedule of its own stage count, with its costs.

  Micro-batch ids in these schedules are local (`0 .. m_i - 1`); the pipeline's global ids start
  at its `first_microbatch`.
  """
  out = []
  for p in instance.pipelines:
    costs = stage_costs(
      instance.profile,
      p.template.stages,
      replicas=instance.num_pipelines,
      allreduce_bandwidth=allreduce_bandwidth,
      comm=comm,
    )
    out.append((p, generate(base, 1, p.template.num_stages, p.microbatches), costs))
  return out


def oobleck_step_time(
  instance: OobleckInstance,
  *,
  base: str = "1f1b",
  comm: float = 0.0,
  allreduce_bandwidth: float | None = None,
) -> float:
  """The step time of `instance` by the cost model: the slowest pipeline's simulated makespan.

  Every pipeline is replayed alone (`pipeline_schedules`), its all-reduce and optimizer step at
  the end of its list; the cross-pipeline all-reduce is folded in as each pipeline's AR time,
  i.e. the step ends when the slowest pipeline has reduced and stepped. Identical pipelines
  (same template and micro-batches) are simulated once.

  Args:
    instance: the pipelines.
    base: the per-pipeline schedule ("gpipe", "1f1b" or "zb-h1").
    comm: transfer latency between stages.
    allreduce_bandwidth: as for `stage_costs`.

  Returns:
    The step time, in the profile's time unit.
  """
  cache: dict[tuple, float] = {}
  worst = 0.0
  for p in instance.pipelines:
    key = (p.template.stages, p.microbatches)
    if key not in cache:
      costs = stage_costs(
        instance.profile,
        p.template.stages,
        replicas=instance.num_pipelines,
        allreduce_bandwidth=allreduce_bandwidth,
        comm=comm,
      )
      sched = generate(base, 1, p.template.num_stages, p.microbatches)
      cache[key] = simulate(sched, costs).makespan
    worst = max(worst, cache[key])
  return worst
