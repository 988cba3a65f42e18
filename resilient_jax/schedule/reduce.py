"""Failure patterns and the reduced grid that the planners run on at cluster scale.

Planning every op of a 2048 x 8 grid per failure state is too slow (`3*D*p*m` ops), and most of
that grid does not matter: pipelines with no failed worker and no re-routed micro-batch run the
fault-free schedule, and the step ends when the most loaded survivors are done. `reroute` gives
every survivor of stage `s` its `m` own micro-batches plus a share of the `k_s * m` orphans, at
most `max_load(D, m, k_s) = ceil(D*m / (D - k_s))` in all, and picks the survivors that carry
the extra from the front of the stage's live list. The step time depends on those loads, which
depend on `(D, k_s)` alone, and on how the orphans' other stages interleave.

So a failure state is reduced to its *pattern*, the failed count per stage plus whether the
failures share pipelines (`stacked`, e.g. a node that held a whole pipeline), and planned on a
small grid with the same per-survivor load:

* sparse (every damaged stage has `max_load == m + 1`; at cluster scale, any `k_s <= D/(m+1)`):
  each failed worker's `m` orphans go one each to `m` healthy survivors near the front of the
  grid. The reduced grid keeps one failed worker per damaged stage, placed at the end behind
  `(p - 1) + m` healthy pipelines, so that, as in a large grid, the survivors that take the
  orphans are healthy pipelines. Example: one failure among D = 2048 pipelines with m = 16,
  p = 8 is planned on 24 pipelines, 85x fewer ops, with the same 17 micro-batches on each
  loaded survivor.
* dense (some stage has `max_load >= m + 2`, i.e. many failures in one stage): the smallest
  `D'` for which every damaged stage has some `k'_s` with the same maximum load, `k'_s / D'` as
  close to `k_s / D` as that allows.

The data-parallel all-reduce is still costed for the full grid's live count, through the
`OpCosts` the caller passes to the planner.

Accuracy (tests/test_sim.py, and the numbers in docs/simulator.md): for the adaptive planner
the reduced makespan is within 3% of the full grid's for single-stage patterns and within a few
percent for most multi-stage ones (up to ~14% for dense multi-stage patterns on D = 16, where
the full grid's own makespan varies by several percent with where the same counts fall). The
naive planner runs each failed worker's orphans after another's and damaged pipelines' work
last, so its makespan depends on chains between damaged pipelines that no small grid keeps:
exact in the sparse regime when the damaged pipelines are not among the front ones that take
orphans (the common case in a large grid), off by up to ~35% in the dense one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from resilient_jax.schedule.core import Worker

__all__ = ["FailurePattern", "failure_pattern", "max_load", "reduce_pattern"]


def max_load(dp: int, m: int, k: int) -> int:
  """Most micro-batches one survivor of a stage carries when `k` of its `dp` workers failed."""
  if k <= 0:
    return m
  if k >= dp:
    raise ValueError(f"k={k} failures leave no survivor among dp={dp}")
  return -(-dp * m // (dp - k))


@dataclasses.dataclass(frozen=True)
class FailurePattern:
  """What a failure state's step time depends on, up to placement.

  Attributes:
    counts: failed workers per stage.
    stacked: whether the failures mostly share pipelines (at least two per damaged pipeline on
      average), as when a node holding a whole pipeline fails.
  """

  counts: tuple[int, ...]
  stacked: bool

  @property
  def failed(self) -> int:
    return sum(self.counts)


def failure_pattern(dp: int, pp: int, failed: Iterable[Worker]) -> FailurePattern:
  """The pattern of a set of failed workers of a `dp x pp` grid."""
  counts = [0] * pp
  pipelines = set()
  n = 0
  for d, s in failed:
    if not (0 <= d < dp and 0 <= s < pp):
      raise ValueError(f"failed worker {(d, s)} is outside the {dp}x{pp} grid")
    counts[s] += 1
    pipelines.add(d)
    n += 1
  return FailurePattern(tuple(counts), n >= 2 * len(pipelines) and n > 0)


def _k_range(dp: int, m: int, load: int) -> tuple[int, int] | None:
  """The failure counts `k` (1 <= k < dp) with `max_load(dp, m, k) == load`, as `(lo, hi)`."""
  # ceil(dp*m / n) == load  <=>  n*(load-1) < dp*m <= n*load, for n = dp - k survivors.
  n_lo = -(-dp * m // load)
  n_hi = -(-dp * m // (load - 1)) - 1 if load > 1 else dp
  n_lo, n_hi = max(n_lo, 1), min(n_hi, dp - 1)
  if n_lo > n_hi:
    return None
  return dp - n_hi, dp - n_lo


def reduce_pattern(
  dp: int, pp: int, m: int, pattern: FailurePattern, *, keep_sources: bool = False
) -> tuple[int, frozenset[Worker]]:
  """A small grid whose plan has the same step time as the full grid's, and its failures.

  Two regimes (see the module docstring):

  * sparse, every damaged stage has `max_load == m + 1`: each failed worker's `m` orphans go
    one each to `m` survivors, different failed workers' to different survivors, and `reroute`
    picks the survivors from the front of the live list. The reduced grid keeps one failed
    worker per damaged stage, on pipelines at the end of the grid, behind
    `(pp - 1) + m` healthy ones: the survivors that take orphans are healthy pipelines, as they
    almost always are in a large grid.
  * dense, some stage has `max_load >= m + 2`: the smallest `dp'` for which every damaged stage
    has some `k'` with the same maximum load, `k'/dp'` as close to `k/dp` as that allows.

  Args:
    dp: the full grid's pipelines.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    pattern: the full grid's failure pattern.
    keep_sources: in the dense regime, also keep `k' >= min(k, load - m)`: a survivor with `e`
      extra micro-batches got them, dealt round-robin, from `min(e, k)` different failed
      workers. The naive planner needs this (it runs one failed worker's orphans after
      another's), the adaptive one does not.

  Returns:
    `(dp', failed')`: plan `dp' x pp` with `failed'` in place of the full grid. With no
    failures, `(1, frozenset())`.

  Raises:
    ValueError: when some stage has no survivor (nothing can be re-routed).
  """
  if len(pattern.counts) != pp:
    raise ValueError(f"pattern has {len(pattern.counts)} stages, pp={pp}")
  loads = []
  for s, k in enumerate(pattern.counts):
    if k >= dp:
      raise ValueError(f"stage {s} has no live worker ({k} of {dp} failed)")
    loads.append(max_load(dp, m, k))
  if not pattern.failed:
    return 1, frozenset()
  if all(load == m + 1 for k, load in zip(pattern.counts, loads, strict=True) if k):
    counts = [min(k, 1) for k in pattern.counts]
    damaged = 1 if pattern.stacked else sum(counts)
    dr = min(dp, (pp - 1) + m + damaged)
    if all(max_load(dr, m, k) == m + 1 for k in counts if k):
      return dr, _place(dr, counts, pattern.stacked)
  for dr in range(2, dp + 1):
    counts = []
    for k, load in zip(pattern.counts, loads, strict=True):
      if k == 0:
        counts.append(0)
        continue
      rng = _k_range(dr, m, load)
      lo = max(rng[0], min(k, load - m)) if rng and keep_sources else rng and rng[0]
      if rng is None or lo > rng[1]:
        break
      counts.append(min(max(round(k * dr / dp), lo), rng[1]))
    else:
      return dr, _place(dr, counts, pattern.stacked)
  raise AssertionError("unreachable: dp' = dp always preserves the loads")


def _place(dp: int, counts: list[int], stacked: bool) -> frozenset[Worker]:
  """Canonical positions, from the last pipeline backwards: stage by stage, either sharing
  pipelines (`stacked`) or each failure in a pipeline of its own as far as the grid allows."""
  failed = set()
  offset = 0
  for s, k in enumerate(counts):
    for i in range(k):
      failed.add((dp - 1 - (i if stacked else (offset + i) % dp), s))
    offset += k
  return frozenset(failed)
