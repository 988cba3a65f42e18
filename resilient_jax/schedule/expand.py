"""Replanning at cluster scale: plan the part of the grid a failure touches, expand to the grid.

A failure re-routes a few stages of a few micro-batches (`routing.rerouted_stages`): the failed
workers' micro-batches go to survivors of the same stage near the front of the grid. Call a
pipeline *touched* when it owns a re-routed micro-batch or runs one. Every micro-batch of an
untouched pipeline stays home, and no micro-batch of a touched pipeline enters an untouched one,
so the touched pipelines form a closed sub-grid: its op lists can be planned alone, with the full
grid's routes restricted to it. Every untouched pipeline is a healthy pipeline of its own, and all
of them get the same lists (renumbered): one of them, the *spare*, is planned with the sub-grid
and the others copy it. The only coupling left is each stage's all-reduce, which starts when the
stage's last worker is done, so the sub-grid's makespan (spare included, full grid's op costs) is
the full step's.

The spare is planned rather than given the base schedule's fault-free lists because the adaptive
planner also speeds up healthy pipelines: with a 1F1B base (fused backward) and a few
micro-batches per pipeline, the fault-free lists would make the step up to ~15% slower than the
full grid's plan.

Why not `reduce.reduce_pattern`'s grid, as the simulator plans: it keeps each stage's failure
*count* and load but not where the failures are (two failures in one pipeline and in two
pipelines reduce alike), so its lists cannot be mapped back onto the grid. The touched sub-grid
is exact, and as small: one failure among D = 2048 pipelines with m = 16 touches 17 of them (the
failed one and the 16 that take one micro-batch each; 18 planned with the spare), against
`reduce_pattern`'s 24.

On a sub-grid renumbered in order, the list scheduler of `adaptive.py` makes, variant by variant,
exactly the lists it makes for those pipelines on the full grid (their events never meet the
others', and every tie is broken by an order that the renumbering keeps), and each variant's
makespan and peak memory are the full grid's, so it picks the same variant: the expanded plan is
the full grid's plan, op for op (tests/test_adaptive.py checks it). One exception, by design: past
50k compute ops the planner tries only its first three variants, and it counts the grid it
plans, so on a grid that large a sub-grid below it may pick a faster variant than the whole
grid's planner would have.

The sub-grid, renumbered, is the failure's `Footprint`; its `key` does not depend on where the
grid is, so one failed worker deep in pipeline 900 or 1500 of the same stage is planned once.
The expanded `Schedule` builds a worker's op list on first use (`ExpandedOps`) and a
micro-batch's route on use (`ExpandedRoute`): the runtime of a multi-process job reads only its
own workers' lists, and building all 16k lists of ~100 ops takes several times as long as the
planning (4.9 s against 0.6 s for one failure on 1024 x 16 x 32, on a loaded machine).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

from resilient_jax.schedule.core import Op, Schedule, Worker
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.routing import Route, rerouted_stages

__all__ = [
  "ExpandedOps",
  "ExpandedRoute",
  "Footprint",
  "expand",
  "footprint",
]


@dataclasses.dataclass(frozen=True)
class Footprint:
  """The pipelines of a DP x PP grid that a failed set touches, as a grid of their own.

  Local pipeline `i` is full-grid pipeline `pipelines[i]`; local micro-batch `i*m + j` is
  full-grid micro-batch `pipelines[i]*m + j`.

  Attributes:
    dp: the full grid's pipelines.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    dead: the full grid's failed workers.
    pipelines: the touched pipelines, ascending (none without failures), then the spare: the
      first untouched pipeline, if any, whose plan every untouched pipeline runs.
    spare: whether the last of `pipelines` is the spare.
    failed: the failed workers, in local numbering.
    route: the full grid's routes of the sub-grid's micro-batches, in local numbering.
  """

  dp: int
  pp: int
  m: int
  dead: frozenset[Worker]
  pipelines: tuple[int, ...]
  spare: bool
  failed: frozenset[Worker]
  route: Route

  @property
  def key(self) -> Hashable:
    """What the sub-grid's plan depends on: the same wherever in the grid the failure is."""
    return (len(self.pipelines), self.pp, self.m, self.failed, self.route)

  @property
  def compute_ops(self) -> int:
    return 3 * len(self.pipelines) * self.pp * self.m


def footprint(dp: int, pp: int, m: int, failed: Iterable[Worker]) -> Footprint:
  """The touched sub-grid of `failed` (see the module docstring); O(failed * m + D * pp).

  Raises:
    StageLostError: when every worker of some stage has failed.
    ValueError: for a bad shape or a failed worker outside the grid.
  """
  dead = frozenset(tuple(w) for w in failed)
  moved = rerouted_stages(dp, pp, m, dead)
  touched = {d for d, _ in dead} | {mb // m for mb, _ in moved} | set(moved.values())
  spare = next((d for d in range(dp) if d not in touched), None) if touched else None
  # The spare goes last, out of order: it shares no micro-batch with the touched pipelines, so
  # where it sits does not change their plan, and the key stays free of its position.
  pipelines = tuple(sorted(touched)) + ((spare,) if spare is not None else ())
  local = {d: i for i, d in enumerate(pipelines)}
  route = [[i] * pp for i in range(len(pipelines)) for _ in range(m)]
  for (mb, s), d in moved.items():
    route[local[mb // m] * m + mb % m][s] = local[d]
  return Footprint(
    dp=dp,
    pp=pp,
    m=m,
    dead=dead,
    pipelines=pipelines,
    spare=spare is not None,
    failed=frozenset((local[d], s) for d, s in dead),
    route=tuple(tuple(r) for r in route),
  )


@functools.lru_cache(maxsize=64)
def _pattern(base: str, pp: int, m: int) -> tuple[tuple[Op, ...], ...]:
  """Per stage, the ops of pipeline 0 of the fault-free `base` (every pipeline runs them,
  shifted onto its own micro-batches)."""
  sched = generate(base, 1, pp, m)
  return tuple(sched.ops[(0, s)] for s in range(pp))


class ExpandedOps(Mapping[Worker, tuple[Op, ...]]):
  """Every live worker's op list of an expanded plan, each built on first use and kept.

  Attributes:
    base: the fault-free generator of the plan.
    folded: the healthy pipelines other than the spare: they run the spare's lists on their own
      micro-batches (`base`'s fault-free lists when nothing failed); `Schedule.to_text` shows
      them as one line, `folded_note`.
    folded_note: what they run, in words.
    footprint: the failure's touched sub-grid.
    sub: the plan of that sub-grid (None when nothing failed): with `footprint` and `base`,
      all the plan is (`schedule/codec.py` publishes these, not the lists).
  """

  def __init__(self, fp: Footprint, sub: Schedule | None, base: str):
    self.base = base
    self.footprint = fp
    self.sub = sub
    self._fp = fp
    self._sub = sub.ops if sub is not None else {}
    self._local = {d: i for i, d in enumerate(fp.pipelines)}
    if fp.spare:
      del self._local[fp.pipelines[-1]]
    m = fp.m
    if not self._sub or not fp.spare:
      self._healthy = _pattern(base, fp.pp, m)
    else:
      # The spare's lists with local ids 0..m-1: one pattern per stage, shifted per pipeline.
      spare = len(fp.pipelines) - 1
      self._healthy = tuple(
        tuple(Op(op.kind, op.mb - spare * m) if op.mb >= 0 else op
              for op in self._sub[(spare, s)])
        for s in range(fp.pp)
      )
    template = fp.pipelines[-1] if self._sub and fp.spare else None
    self.folded = frozenset(
      d for d in range(fp.dp) if d not in self._local and d != template
    )
    self.folded_note = (
      f"run pipeline {template}'s lists on their own micro-batches" if template is not None
      else f"run {base}'s fault-free lists"
    )
    self._lists: dict[Worker, tuple[Op, ...]] = {}

  def __contains__(self, worker: object) -> bool:
    # Mapping's default would build the list to answer.
    if not isinstance(worker, tuple) or len(worker) != 2:
      return False
    d, s = worker
    return 0 <= d < self._fp.dp and 0 <= s < self._fp.pp and worker not in self._fp.dead

  def __getitem__(self, worker: Worker) -> tuple[Op, ...]:
    ops = self._lists.get(worker)
    if ops is not None:
      return ops
    if worker not in self:
      raise KeyError(worker)
    d, s = worker
    m = self._fp.m
    i = self._local.get(d)
    if i is None:
      shift = d * m
      ops = tuple(Op(op.kind, op.mb + shift) if op.mb >= 0 else op for op in self._healthy[s])
    else:
      pipes = self._fp.pipelines
      ops = tuple(
        Op(op.kind, pipes[op.mb // m] * m + op.mb % m) if op.mb >= 0 else op
        for op in self._sub[(i, s)]
      )
    self._lists[worker] = ops
    return ops

  def __iter__(self) -> Iterator[Worker]:
    dead = self._fp.dead
    return ((d, s) for d in range(self._fp.dp) for s in range(self._fp.pp) if (d, s) not in dead)

  def __len__(self) -> int:
    return self._fp.dp * self._fp.pp - len(self._fp.dead)


class ExpandedRoute(Sequence[tuple[int, ...]]):
  """`route[mb]` of an expanded plan, built on use: an untouched pipeline's micro-batches stay
  home, a touched one's take the sub-grid's route mapped back."""

  def __init__(self, fp: Footprint):
    self._fp = fp
    self._local = {d: i for i, d in enumerate(fp.pipelines)}
    if fp.spare:
      del self._local[fp.pipelines[-1]]  # its route is every healthy pipeline's: home

  def __len__(self) -> int:
    return self._fp.dp * self._fp.m

  def __getitem__(self, mb):  # int -> tuple[int, ...]; slice -> tuple of those
    if isinstance(mb, slice):
      return tuple(self[i] for i in range(*mb.indices(len(self))))
    n = len(self)
    if mb < 0:
      mb += n
    if not 0 <= mb < n:
      raise IndexError(f"micro-batch {mb} outside the route of {n}")
    fp = self._fp
    d = mb // fp.m
    i = self._local.get(d)
    if i is None:
      return (d,) * fp.pp
    return tuple(fp.pipelines[x] for x in fp.route[i * fp.m + mb % fp.m])

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Sequence):
      return NotImplemented
    return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

  __hash__ = None  # type: ignore[assignment]  # equal to tuples, which hash differently


def expand(sub: Schedule | None, fp: Footprint, base: str) -> Schedule:
  """The full grid's schedule: `sub` (planned on `fp`'s sub-grid) on the touched pipelines, its
  spare's lists on every other one (`base`'s fault-free lists when nothing failed).

  Args:
    sub: the sub-grid's plan (`fp.key`'s shape); None when nothing failed.
    fp: the footprint it was planned for.
    base: the fault-free generator the untouched pipelines run.

  Returns:
    A `Schedule` of the full grid, named as `sub` (as `base` when nothing failed), whose lists
    and routes are built on use.
  """
  if sub is not None and (sub.dp, sub.pp, sub.microbatches) != (len(fp.pipelines), fp.pp, fp.m):
    raise ValueError(
      f"a {sub.dp}x{sub.pp}x{sub.microbatches} plan does not fit the footprint's "
      f"{len(fp.pipelines)}x{fp.pp}x{fp.m} sub-grid"
    )
  return Schedule(
    name=sub.name if sub is not None else base,
    dp=fp.dp,
    pp=fp.pp,
    microbatches=fp.m,
    route=ExpandedRoute(fp),
    ops=ExpandedOps(fp, sub, base),
  )
