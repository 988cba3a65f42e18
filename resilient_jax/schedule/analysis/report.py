"""The planner half of the failures benchmark: how much throughput each policy keeps.

For every grid shape and failure set, `planner_table` plans the step with the adaptive (ReCycle)
and the naive policy and compares both with the fault-free step of a baseline schedule under the
same op costs, next to ReCycle's bound `min(1, (m+p-1)(D-k)/(m D))` and two lower bounds on the
adaptive makespan. Pure Python: no JAX, milliseconds per row.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

from resilient_jax.schedule.adaptive import plan_adaptive, plan_naive
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.cost import OpCosts, lower_bound, simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.routing import (
  FailureState,
  default_memory_cap,
  relative_throughput_bound,
  route_lower_bound,
)
from resilient_jax.schedule.validate import peak_inflight

__all__ = ["GPT_COSTS", "PlannerRow", "failure_sets", "format_table", "planner_table"]

GPT_COSTS = OpCosts(f=1.0, b=1.0, w=0.8, ar=0.1, opt=0.1)
"""A GPT-like stage profile: B as long as F, W a bit shorter, small AR and OPT."""


@dataclasses.dataclass(frozen=True)
class PlannerRow:
  """One shape and failure set.

  Attributes:
    dp: data-parallel pipelines (D).
    pp: pipeline stages (p).
    m: micro-batches per pipeline.
    layout: "stage s" (all failures in stage s) or "spread" (each in a different stage, as far
      as there are stages).
    failed: the failed workers.
    k: most failures in one stage: the `k` of the bound.
    baseline: the fault-free schedule the throughputs are relative to.
    baseline_makespan: its fault-free makespan under the same costs.
    base_makespan: the fault-free makespan of the adaptive planner's own base schedule.
    adaptive_makespan: the adaptive plan's makespan.
    naive_makespan: the naive plan's makespan.
    bound: ReCycle's `min(1, (m+p-1)(D-k)/(m D))`.
    lower_bound: `cost.lower_bound` of the adaptive plan (critical path, busiest worker).
    route_bound: `route_lower_bound` (pipeline fill and memory cap) with the adaptive cap.
    memory_cap: the in-flight cap the adaptive plan was made under.
    peak_inflight: the adaptive plan's highest per-worker in-flight count.
  """

  dp: int
  pp: int
  m: int
  layout: str
  failed: tuple[Worker, ...]
  k: int
  baseline: str
  baseline_makespan: float
  base_makespan: float
  adaptive_makespan: float
  naive_makespan: float
  bound: float
  lower_bound: float
  route_bound: float
  memory_cap: int
  peak_inflight: int

  @property
  def adaptive(self) -> float:
    """Relative throughput of the adaptive plan: baseline makespan / adaptive makespan."""
    return self.baseline_makespan / self.adaptive_makespan

  @property
  def naive(self) -> float:
    """Relative throughput of the naive plan."""
    return self.baseline_makespan / self.naive_makespan

  @property
  def adaptive_vs_base(self) -> float:
    """Adaptive throughput relative to the fault-free step of its own base schedule."""
    return self.base_makespan / self.adaptive_makespan

  @property
  def of_bound(self) -> float:
    """Adaptive relative throughput as a fraction of ReCycle's bound."""
    return self.adaptive / self.bound

  @property
  def ceiling(self) -> float:
    """The most relative throughput any order of these routes within the cap could reach."""
    return self.baseline_makespan / max(self.lower_bound, self.route_bound)

  @property
  def over_lower_bound(self) -> float:
    """Adaptive makespan / `cost.lower_bound` (1.0: provably optimal)."""
    return self.adaptive_makespan / self.lower_bound

  @property
  def over_best_bound(self) -> float:
    """Adaptive makespan / the larger of the two lower bounds."""
    return self.adaptive_makespan / max(self.lower_bound, self.route_bound)


def failure_sets(
  dp: int, pp: int, *, stages: Sequence[int] | None = None
) -> list[tuple[str, frozenset[Worker]]]:
  """The failure sets of the benchmark for one grid.

  Args:
    dp: data-parallel pipelines.
    pp: pipeline stages.
    stages: stages that lose `k = 1 .. dp-1` workers (pipelines 0..k-1); None means the first,
      middle and last stage.

  Returns:
    `(layout, failed)` pairs: the single-stage sets, then `k = 2 .. dp-1` failures spread over
    different pipelines and stages (stage `i*pp // k` for the i-th, or round robin once there
    are more failures than stages).
  """
  if stages is None:
    stages = sorted({0, pp // 2, pp - 1})
  sets: list[tuple[str, frozenset[Worker]]] = []
  for s in stages:
    for k in range(1, dp):
      sets.append((f"stage {s}", frozenset((d, s) for d in range(k))))
  for k in range(2, dp):
    sets.append(("spread", frozenset((i, (i * pp) // k if k <= pp else i % pp) for i in range(k))))
  return sets


def planner_table(
  shapes: Iterable[tuple[int, int, int]],
  costs: OpCosts = GPT_COSTS,
  *,
  baseline: str = "1f1b",
  base: str = "zb-h1",
  naive_base: str = "1f1b",
  stages: Sequence[int] | None = None,
  memory_cap: int | None = None,
) -> list[PlannerRow]:
  """Plans every failure set of `failure_sets` for every shape and measures both policies.

  Args:
    shapes: `(dp, pp, m)` grids.
    costs: op costs (the same for the baseline, both policies and the bounds).
    baseline: the fault-free schedule whose makespan is the numerator of relative throughput.
      "1f1b" by default: ReCycle's bound counts 1F1B's `(p-1)/(m+p-1)` bubble, so only against
      1F1B is it the ceiling of perfect bubble reuse.
    base: the adaptive planner's base (sets its default cap); its own fault-free makespan is
      reported as `base_makespan` too.
    naive_base: the naive planner's base schedule.
    stages: as for `failure_sets`.
    memory_cap: in-flight cap for the adaptive planner; None: its default.

  Returns:
    One row per shape and failure set.
  """
  rows = []
  for dp, pp, m in shapes:
    baseline_span = simulate(generate(baseline, dp, pp, m), costs).makespan
    base_span = simulate(generate(base, dp, pp, m), costs).makespan
    for layout, failed in failure_sets(dp, pp, stages=stages):
      cap = memory_cap if memory_cap is not None else default_memory_cap(dp, pp, m, failed, base)
      state = FailureState(dp, pp, m, failed)
      adaptive = plan_adaptive(state, costs, memory_cap=cap, base=base)
      naive = plan_naive(state, base=naive_base)
      k = max(Counter(s for _, s in failed).values())
      rows.append(
        PlannerRow(
          dp=dp,
          pp=pp,
          m=m,
          layout=layout,
          failed=tuple(sorted(failed)),
          k=k,
          baseline=baseline,
          baseline_makespan=baseline_span,
          base_makespan=base_span,
          adaptive_makespan=simulate(adaptive, costs).makespan,
          naive_makespan=simulate(naive, costs).makespan,
          bound=relative_throughput_bound(dp, pp, m, k),
          lower_bound=lower_bound(adaptive, costs),
          route_bound=route_lower_bound(state, costs, memory_cap=cap),
          memory_cap=cap,
          peak_inflight=max(peak_inflight(ops) for ops in adaptive.ops.values()),
        )
      )
  return rows


def format_table(rows: Iterable[PlannerRow]) -> str:
  """A fixed-width text table of `rows`, one line each."""
  head = (
    f"{'D x p x m':>10} {'layout':>8} {'k':>2} {'#f':>3} {'adaptive':>8} {'naive':>6} "
    f"{'bound':>6} {'ad/bnd':>6} {'ceiling':>7} {'vs base':>7} {'ms/LB':>6} {'ms/LB*':>6} "
    f"{'cap':>4} {'peak':>4}"
  )
  lines = [head]
  for r in rows:
    lines.append(
      f"{f'{r.dp}x{r.pp}x{r.m}':>10} {r.layout:>8} {r.k:>2} {len(r.failed):>3} "
      f"{r.adaptive:>8.3f} {r.naive:>6.3f} {r.bound:>6.3f} {r.of_bound:>6.3f} "
      f"{r.ceiling:>7.3f} {r.adaptive_vs_base:>7.3f} {r.over_lower_bound:>6.3f} "
      f"{r.over_best_bound:>6.3f} {r.memory_cap:>4} {r.peak_inflight:>4}"
    )
  return "\n".join(lines)
