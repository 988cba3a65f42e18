"""Pipeline templates: the best split of the layers for each node count (dynamic programme)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from resilient_jax.schedule.oobleck.profile import InstantiationError, LayerProfile, LayerRange


@dataclasses.dataclass(frozen=True)
class PipelineTemplate:
  """The planned split of the model over a pipeline of `num_nodes` nodes, one stage per node.

  Attributes:
    stages: layers `[lo, hi)` of every stage, in pipeline order, covering the model.
    stage_times: F + B + W of one micro-batch on every stage.
    stage_memory: peak bytes of every stage's node under 1F1B (see the module docstring).
    microbatches: the micro-batches per pipeline the memory check assumed (None: at least as
      many as stages, the worst case).
    allreduce: the slowest stage's gradient all-reduce over many pipelines (a ring: twice its
      gradient bytes over the link's bandwidth), which ends a step after that stage's last
      backward; 0 where the costs price no all-reduce.
  """

  stages: tuple[LayerRange, ...]
  stage_times: tuple[float, ...]
  stage_memory: tuple[float, ...]
  microbatches: int | None = None
  allreduce: float = 0.0

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
    """1F1B estimate for `microbatches` micro-batches: `(m - 1) * bottleneck + latency`, then
    the all-reduce."""
    return (microbatches - 1) * self.bottleneck + self.latency + self.allreduce


def _template(
  profile: LayerProfile, stages: Sequence[LayerRange], m: int | None,
  allreduce_bandwidth: float | None = None,
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
    allreduce=0.0 if allreduce_bandwidth is None else 2.0 * max(
      profile.range_sum("param_bytes", lo, hi) for lo, hi in stages) / allreduce_bandwidth,
  )


def template_for(
  profile: LayerProfile, stages: Sequence[LayerRange], microbatches: int | None = None,
  allreduce_bandwidth: float | None = None,
) -> PipelineTemplate:
  """The template of a given split (e.g. a DP x PP grid's, to re-instantiate from it)."""
  return _template(profile, stages, microbatches, allreduce_bandwidth)


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
  allreduce_bandwidth: float | None = None,
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
    allreduce_bandwidth: bytes/s of a node's link in the gradient all-reduce, for each
      template's `allreduce` (what instantiation weighs besides the pipeline's fill and drain:
      a short pipeline's stages hold more gradients); None: not priced.

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
    templates[k] = _template(profile, stages, microbatches, allreduce_bandwidth)
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
