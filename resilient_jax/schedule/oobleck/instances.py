"""Instances: a combination of templates on the nodes, with the batch dealt by speed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from resilient_jax.schedule.oobleck.profile import InstantiationError, LayerProfile, LayerRange
from resilient_jax.schedule.oobleck.templates import (
  PipelineTemplate,
  TemplateSet,
  distribute_microbatches,
)


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
  bottleneck_i) + allreduce_i`. So the step is about `B / W + max_i D_i` with `D_i = latency_i -
  bottleneck_i + allreduce_i` (the fill and drain, then the slowest stage's gradient
  all-reduce: without it the shortest pipelines always won, their stages holding the most
  gradients). For each threshold on D (templates sorted by D) an unbounded knapsack
  over (pipelines, nodes) maximises W among templates under the threshold; the best threshold
  wins. Adding templates in D order lets one knapsack table serve every threshold, so the
  whole search is O(#templates * max_pipelines) vector operations over the node axis.
  """
  if not templates:
    return None

  def tail(t: PipelineTemplate) -> float:  # fill, drain and the all-reduce after them
    return t.latency - t.bottleneck + t.allreduce

  order = sorted(range(len(templates)), key=lambda i: tail(templates[i]))
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
      est = total_mb / scores[k] + tail(templates[i])
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
  from scipy import optimize  # only when re-templating: 0.1 s of every process start otherwise

  rows, cols = optimize.linear_sum_assignment(kept, maximize=True)
  node_lists = [[-1] * t.num_nodes for t in chosen]
  for r, c in zip(rows, cols, strict=True):
    i, s, _ = slots[c]
    node_lists[i][s] = survivors[r]
  return node_lists
