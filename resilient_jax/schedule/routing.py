"""Where a failed (or slow) worker's micro-batches go, and what that costs at best.

`reroute` spreads each failed worker's stage of its micro-batches evenly over the stage's live
data-parallel peers; `relative_throughput_bound` and `route_lower_bound` say how fast any
schedule on those routes can be, which the planners (`adaptive.py`) are measured against.

A straggler is the same mechanism applied in part (ReCycle's re-routing, weighted): with
per-worker speeds, a stage's `D * m` micro-batches are shared in proportion to its workers'
speeds (`proportional_loads`), so a worker at speed `v` keeps about `v` times its share and
its peers take the rest; a failed worker is a worker of speed 0. A stage's synchronous
throughput is then bounded by `sum(speeds) / D` of the fault-free one
(`capacity_bound`), where without re-weighting it runs at its slowest worker's pace.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

from resilient_jax.schedule.core import AR, Op, Worker
from resilient_jax.schedule.cost import DurationFn, OpCosts
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import check_shape, generate
from resilient_jax.schedule.validate import validate

Route = tuple[tuple[int, ...], ...]


class StageLostError(ScheduleError):
  """Every data-parallel replica of one stage has failed: no planner can recover the step.

  Attributes:
    stage: the stage with no live worker.
  """

  def __init__(self, stage: int, dp: int):
    super().__init__(
      f"stage {stage} is lost: all {dp} of its data-parallel workers failed, so its weights "
      "have no live replica to re-route to"
    )
    self.stage = stage


def _check_grid(dp: int, pp: int, m: int, failed: Iterable[Worker]) -> frozenset[Worker]:
  check_shape(dp, pp, m)
  dead = frozenset(tuple(w) for w in failed)
  for d, s in dead:
    if not (0 <= d < dp and 0 <= s < pp):
      raise ValueError(f"failed worker {(d, s)} is outside the {dp}x{pp} grid")
  return dead


@dataclasses.dataclass(frozen=True)
class FailureState:
  """A DP x PP grid with `m` micro-batches per pipeline and the workers of it that failed: what
  the re-routing planners, their bounds and the exact solver plan for (validated here, once).

  Attributes:
    dp: data-parallel pipelines, failed ones included.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    failed: the failed workers `(dp, stage)` (any iterable; stored as a frozenset).
    speeds: live workers that run at another speed than their peers, `((worker, speed), ...)`
      (any iterable of pairs or a mapping; stored sorted, speed 1 left out): the planners move
      micro-batches off a slow worker in proportion (`proportional_loads`) and time its ops
      at `1 / speed` of the cost model's.
    samples: samples in one micro-batch. Above 1 the adaptive planner also re-routes pieces of
      micro-batches (`split_route`), sample counts rather than whole micro-batches.
  """

  dp: int
  pp: int
  m: int
  failed: frozenset[Worker] = frozenset()
  speeds: tuple[tuple[Worker, float], ...] = ()
  samples: int = 1

  def __post_init__(self):
    object.__setattr__(self, "failed", _check_grid(self.dp, self.pp, self.m, self.failed))
    object.__setattr__(self, "speeds", check_speeds(self.dp, self.pp, self.speeds, self.failed))
    if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
      raise ValueError(f"samples per micro-batch must be an int >= 1, got {self.samples!r}")


def check_speeds(dp: int, pp: int, speeds: Iterable[tuple[Worker, float]] | Mapping,
                 failed: Collection[Worker] = ()) -> tuple[tuple[Worker, float], ...]:
  """`speeds` as a sorted tuple of `((d, s), speed)` without the workers at speed 1 (a hashable
  plan-cache key), checked: workers inside the grid and live, speeds finite and positive.

  Raises:
    ValueError: the first bad entry.
  """
  pairs = speeds.items() if isinstance(speeds, Mapping) else speeds
  out: dict[Worker, float] = {}
  for worker, speed in pairs:
    d, s = worker
    if not (0 <= d < dp and 0 <= s < pp):
      raise ValueError(f"slow worker {(d, s)} is outside the {dp}x{pp} grid")
    if (d, s) in failed:
      raise ValueError(f"worker {(d, s)} is both failed and given a speed")
    if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
      raise ValueError(f"worker {(d, s)}'s speed must be a finite number > 0, got {speed!r}")
    if speed != 1:
      out[(d, s)] = float(speed)
  return tuple(sorted(out.items()))


def _live_workers(dp: int, pp: int, dead: Collection[Worker]) -> list[Worker]:
  return [(d, s) for d in range(dp) for s in range(pp) if (d, s) not in dead]


def reroute(dp: int, pp: int, m: int, failed: Iterable[Worker],
            speeds: Iterable[tuple[Worker, float]] = (), shed: int = 0) -> Route:
  """Routes every micro-batch's stages around the failed workers.

  Stage `s` of a micro-batch whose owner `(d, s)` is alive stays there. The `k * m` micro-batches
  of the `k` failed workers of stage `s` are dealt round-robin, in id order, to that stage's
  `D - k` survivors so that every survivor ends with `floor(D*m/(D-k))` or `ceil(D*m/(D-k))`
  micro-batches at that stage. Round-robin dealing gives every survivor an early orphan instead
  of one late block, so the extra work reaches it while there are still bubbles to fill. Which
  survivors take the `ceil` rotates with the stage so that failures in several stages do not
  pile the extra micro-batches onto one pipeline. Deterministic: the same inputs give the same
  routes.

  Args:
    dp: data-parallel pipelines (D), failed ones included.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    failed: the failed workers `(dp, stage)`.
    speeds: `((worker, speed), ...)` of live workers slower (or faster) than their peers: in
      their stages the micro-batches are shared by `proportional_loads` instead.
    shed: micro-batches each slow worker (speed < 1) gives up beyond its proportional share
      (`_weighted_stage`; the planner tries a few).

  Returns:
    `route[mb][stage]`: the dp index of the live worker running that stage of `mb`.

  Raises:
    StageLostError: when every worker of some stage has failed.
    ValueError: for a bad shape or a failed worker outside the grid.
  """
  moved = rerouted_stages(dp, pp, m, failed, speeds, shed)
  route = [[mb // m] * pp for mb in range(dp * m)]
  for (mb, s), d in moved.items():
    route[mb][s] = d
  return tuple(tuple(r) for r in route)


def rerouted_stages(
  dp: int, pp: int, m: int, failed: Iterable[Worker],
  speeds: Iterable[tuple[Worker, float]] = (),
  shed: int = 0,
) -> dict[tuple[int, int], int]:
  """The part of `reroute` that leaves the owners: `{(mb, stage): dp}` for every stage of a
  micro-batch that runs outside its own pipeline.

  Costs O(failed * m + D * pp), not O(D * m * pp) as the whole route does: at cluster scale the
  runtime's replanning needs only these entries (`expand.footprint`). A stage with a slow
  worker costs O(D * m) more (`_weighted_stage`).

  Raises:
    StageLostError: when every worker of some stage has failed.
    ValueError: for a bad shape, a failed worker outside the grid or a bad speed.
  """
  dead = _check_grid(dp, pp, m, failed)
  speed = dict(check_speeds(dp, pp, speeds, dead))
  lost_by_stage: dict[int, list[int]] = {}
  for d, s in sorted(dead):
    lost_by_stage.setdefault(s, []).append(d)
  moved: dict[tuple[int, int], int] = {}
  weighted = {s for _, s in speed}
  for s in range(pp):
    if s in weighted:
      moved.update(_weighted_stage(dp, m, s, set(lost_by_stage.get(s, ())), speed, shed))
      continue
    lost = lost_by_stage.get(s)
    if not lost:
      continue
    gone = set(lost)
    live = [d for d in range(dp) if d not in gone]
    if not live:
      raise StageLostError(s, dp)
    q, r = divmod(dp * m, len(live))
    # Rotate which survivors get the one extra micro-batch, by stage.
    extra = {live[(s + i) % len(live)] for i in range(r)}
    room = [q - m + (1 if d in extra else 0) for d in live]
    orphans = [mb for d in lost for mb in range(d * m, (d + 1) * m)]
    moved.update(_deal(orphans, live, room, s))
  return moved


def _deal(orphans: Sequence[int], takers: Sequence[int], room: list[int], s: int
          ) -> dict[tuple[int, int], int]:
  """Micro-batches `orphans` of stage `s` dealt round-robin to `takers`, each up to its
  `room` (which this uses up)."""
  moved: dict[tuple[int, int], int] = {}
  i = 0
  for mb in orphans:
    while room[i] == 0:
      i = (i + 1) % len(takers)
    moved[(mb, s)] = takers[i]
    room[i] -= 1
    i = (i + 1) % len(takers)
  return moved


def proportional_loads(speeds: Sequence[float], total: int, rotate: int = 0) -> list[int]:
  """Micro-batches per worker of one stage, in proportion to `speeds`, summing to `total`.

  Largest remainders: each worker gets `floor(total * v / sum)`, and the remaining ones go to
  the largest fractions (ties: the workers after `rotate`, so that several stages with equal
  remainders do not pile the extras onto one pipeline). A worker of speed 0 (failed) gets none,
  any other at least one (taken from the most loaded) where there are enough to go round.

  Raises:
    ValueError: when no speed is positive.
  """
  norm = sum(speeds)
  if norm <= 0:
    raise ValueError(f"no worker of {list(speeds)} has a positive speed")
  exact = [total * v / norm for v in speeds]
  loads = [math.floor(x) for x in exact]
  n = len(speeds)
  order = sorted(range(n), key=lambda i: (-(exact[i] - loads[i]), (i - rotate) % n))
  for i in order[: total - sum(loads)]:
    loads[i] += 1
  # A live worker keeps at least one (when there are enough): a plan with nothing for it would
  # be a failure's, and its speed is only a measurement.
  for i in range(n):
    if speeds[i] > 0 and loads[i] == 0 and total >= sum(v > 0 for v in speeds):
      loads[max(range(n), key=lambda j: (loads[j], -j))] -= 1
      loads[i] = 1
  return loads


def _weighted_stage(dp: int, m: int, s: int, dead: set[int], speed: Mapping[Worker, float],
                    shed: int = 0) -> dict[tuple[int, int], int]:
  """`rerouted_stages`'s entries of stage `s`, whose workers run at different speeds.

  Every worker's load is `proportional_loads` of the stage's `dp * m` micro-batches (failed
  workers at speed 0). With `shed`, each slow worker (speed < 1) keeps `shed` fewer (at least
  one) and the others share the rest in proportion: a proportional share rounds to whole
  micro-batches, and a slow worker left some slack can lose less to it than its peers, who
  fill bubbles with what it gave up (the planner times both and keeps the faster,
  `adaptive.plan_adaptive_timed`). A worker below its own `m` keeps an evenly spaced part of
  its own micro-batches (so its pipeline still feeds it at a steady pace) and gives the others
  away; the given-away ones, in id order, are dealt round-robin to the workers above `m`, as
  failed workers' are (`rerouted_stages`).
  """
  weights = [0.0 if d in dead else speed.get((d, s), 1.0) for d in range(dp)]
  loads = proportional_loads(weights, dp * m, rotate=s)
  slow = [d for d in range(dp) if 0 < weights[d] < 1]
  if shed and len(slow) < sum(w > 0 for w in weights):
    for d in slow:
      loads[d] = max(1, loads[d] - shed)
    rest = [0.0 if d in slow else w for d, w in enumerate(weights)]
    others = proportional_loads(rest, dp * m - sum(loads[d] for d in slow), rotate=s)
    loads = [loads[d] if d in slow else others[d] for d in range(dp)]
  orphans: list[int] = []
  for d in range(dp):
    keep = min(loads[d], m)
    # Own micro-batch j is kept when floor((j + 1) * keep / m) steps up: `keep` of them, spread.
    orphans += [d * m + j for j in range(m) if (j + 1) * keep // m == j * keep // m]
  takers = [d for d in range(dp) if loads[d] > m]
  return _deal(sorted(orphans), takers, [loads[d] - m for d in takers], s)


def capacity_bound(dp: int, pp: int, speeds: Iterable[tuple[Worker, float]],
                   failed: Iterable[Worker] = ()) -> tuple[float, float]:
  """The throughput, relative to fault free, that the grid's compute capacity allows.

  Returns:
    `(grid, stage)`: the sum of every worker's speed over the number of workers (work could go
    anywhere), and the smallest such ratio of one stage (work stays in its stage, as
    re-routing keeps it). Neither counts pipeline bubbles, which re-routed work may fill.
  """
  dead = set(failed)
  speed = dict(check_speeds(dp, pp, speeds, dead))
  per_stage = [sum(0.0 if (d, s) in dead else speed.get((d, s), 1.0) for d in range(dp)) / dp
               for s in range(pp)]
  return sum(per_stage) / pp, min(per_stage)


def relative_throughput_bound(dp: int, pp: int, m: int, k: int) -> float:
  """ReCycle's ceiling on throughput with `k` of a stage's `dp` workers failed, vs fault free.

  With perfect reuse of 1F1B's bubble (`pp - 1` of `m + pp - 1` slots), the `dp - k` survivors
  of the stage carry `m * dp / (dp - k)` micro-batches, so the step keeps at most
  `min(1, (m + pp - 1) * (dp - k) / (m * dp))` of its fault-free throughput.

  Args:
    dp: data-parallel pipelines (D).
    pp: pipeline stages (p).
    m: micro-batches per pipeline.
    k: failed workers in the most damaged stage, `0 <= k < dp`.

  Returns:
    The bound, in (0, 1].

  Raises:
    ValueError: unless `0 <= k < dp`.
  """
  if not 0 <= k < dp:
    raise ValueError(f"k must be in [0, dp={dp}), got {k}")
  return min(1.0, (m + pp - 1) * (dp - k) / (m * dp))


def speed_scaled(costs: OpCosts, speeds: Iterable[tuple[Worker, float]]) -> DurationFn:
  """`costs.duration` with every op but the all-reduce of a worker at speed `v` taking `1 / v`
  as long (a slow device computes slowly; its collective is paced by the link)."""
  speed = dict(speeds)
  if not speed:
    return costs.duration

  def duration(worker: Worker, op: Op) -> float:
    t = costs.duration(worker, op)
    return t if op.kind == AR else t / speed.get(worker, 1.0)

  return duration


def _loads(route: Route, pieces: Mapping | None = None) -> dict[Worker, int]:
  """Micro-batches per (live) worker under `route`, a piece counting as one (`pieces`: the
  split stages, whose first piece the route names)."""
  loads: dict[Worker, int] = {}
  for r in route:
    for s, d in enumerate(r):
      loads[(d, s)] = loads.get((d, s), 0) + 1
  for (_, s), split in (pieces or {}).items():
    for d, _, _ in split[1:]:
      loads[(d, s)] = loads.get((d, s), 0) + 1
  return loads


def default_memory_cap(dp: int, pp: int, m: int, failed: Iterable[Worker], base: str,
                       speeds: Iterable[tuple[Worker, float]] = ()) -> int:
  """The in-flight cap `plan_adaptive` uses when none is given.

  The fault-free base schedule's peak (micro-batches with F done and W/BW not done, worst
  worker), scaled by how many micro-batches the busiest survivor carries relative to `m`:
  `ceil(peak * max_load / m)`, and never above `max_load`. A survivor that does `x` times the
  work may hold `x` times the stash, which keeps its bubbles fillable; a grid without failures
  keeps exactly the base schedule's memory.

  Args:
    dp: data-parallel pipelines.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    failed: the failed workers.
    base: the fault-free generator whose peak is scaled.
    speeds: `((worker, speed), ...)` of slow workers (`reroute`).

  Returns:
    The cap, at least 1.
  """
  return memory_cap_for_load(max(_loads(reroute(dp, pp, m, failed, speeds)).values()), pp, m,
                             base)


def memory_cap_for_load(max_load: int, pp: int, m: int, base: str) -> int:
  """`default_memory_cap` for a grid whose busiest survivor carries `max_load` micro-batches."""
  return max(1, min(max_load, math.ceil(_base_peak(base, pp, m) * max_load / m)))


@functools.lru_cache(maxsize=64)
def _base_peak(base: str, pp: int, m: int) -> int:
  # One pipeline suffices (every pipeline runs the same lists); cached because the runtime asks
  # on every failure and validating even one pipeline is O(pp * m).
  return validate(generate(base, 1, pp, m)).max_peak_inflight


def route_lower_bound(state: FailureState, costs: OpCosts, *, memory_cap: int | None = None
                      ) -> float:
  """A makespan that no order of the survivors' ops on `reroute`'s routes can beat.

  Per live worker `(d, s)` carrying `n` micro-batches: nothing reaches stage `s` before the
  forward chain of the stages above it, and nothing but forwards can run there before the first
  B comes back from the last stage; before that at most `min(n, memory_cap)` forwards fit (each
  stays in flight until its W). So the worker's compute ends no earlier than
  `first_B + n*(f+b+w) - min(min(n, cap)*f, first_B - first_F)`, and its stage's AR and OPT
  follow. This is the pipeline fill that ReCycle's bound ignores: it explains why a stage deep
  in the pipeline, whose survivors cannot start before the fill, misses that bound.

  Args:
    state: the grid and its failed workers.
    costs: op costs.
    memory_cap: most micro-batches in flight per worker; None: no cap.

  Returns:
    The bound, in the unit of `costs`.
  """
  pp = state.pp
  costs.check_stages(pp)
  loads = _loads(reroute(state.dp, pp, state.m, state.failed))
  comm = costs.comm
  f = [costs.f_at(s) for s in range(pp)]
  b = [costs.b_at(s) for s in range(pp)]
  bound = 0.0
  for (_, s), n in loads.items():
    first_f = sum(f[:s]) + s * comm
    first_b = sum(f) + sum(b[s + 1 :]) + (2 * pp - 2 - s) * comm
    room = n if memory_cap is None else min(n, memory_cap)
    work = n * (f[s] + b[s] + costs.w_at(s))
    end = first_b + work - min(room * f[s], first_b - first_f)
    bound = max(bound, end + costs.ar_at(s) + costs.opt_at(s))
  return bound


def split_route(dp: int, pp: int, m: int, samples: int, failed: Iterable[Worker],
                speeds: Iterable[tuple[Worker, float]] = (), *, takers: int | None = None,
                shed: int = 0) -> tuple[Route, dict[tuple[int, int], tuple[tuple[int, int, int],
                                                                      ...]]]:
  """Routes at sample granularity: the samples a failed or slow worker gives up go, as pieces
  of micro-batches (`core.Piece`), to more of its stage's peers than it has micro-batches.

  Per stage with failed or slow workers every worker gets a load in samples: a failed worker
  none; without slow workers, `takers` survivors (all by default; which ones rotates with the
  stage as in `reroute`) share the failed workers' `k * m * samples` as evenly as samples
  allow and the others keep their own; with slow workers, every worker's share in proportion
  to its speed (`proportional_loads` over samples), each slow one giving up `shed` samples
  more. A worker below its own `m * samples` keeps whole micro-batches evenly spaced (as
  `_weighted_stage`) and the first samples of one more; everything else it owned, in id order,
  is cut into consecutive chunks, one per worker above its own, in the order of the stage's
  workers. A micro-batch's stage ending on one worker is routed whole; one on several is split.

  Args:
    dp: data-parallel pipelines, failed ones included.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    samples: samples in one micro-batch.
    failed: the failed workers.
    speeds: `((worker, speed), ...)` of slow (or fast) live workers.
    takers: survivors that share a stage's failed workers' samples (no slow worker there);
      None: all of them.
    shed: samples each slow worker gives up beyond its proportional share (keeping at least
      one).

  Returns:
    `(route, pieces)`: `route[mb][stage]` (a split stage names its first piece's worker) and
    the `core.PieceMap` of the split stages.

  Raises:
    StageLostError: when every worker of some stage has failed.
    ValueError: for a bad shape, worker or speed.
  """
  dead = _check_grid(dp, pp, m, failed)
  speed = dict(check_speeds(dp, pp, speeds, dead))
  if samples < 1:
    raise ValueError(f"samples must be >= 1, got {samples}")
  route = [[mb // m] * pp for mb in range(dp * m)]
  pieces: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}
  own = m * samples
  for s in range(pp):
    weights = [0.0 if (d, s) in dead else speed.get((d, s), 1.0) for d in range(dp)]
    if all(w == 1.0 for w in weights):
      continue
    live = [d for d in range(dp) if weights[d] > 0]
    if not live:
      raise StageLostError(s, dp)
    if all(w in (0.0, 1.0) for w in weights):
      n = len(live) if takers is None else max(1, min(takers, len(live)))
      chosen = [live[(s + i) % len(live)] for i in range(n)]
      q, r = divmod((dp - len(live)) * own, n)
      loads = [0 if w == 0 else own for w in weights]
      for i, d in enumerate(chosen):
        loads[d] += q + (1 if i < r else 0)
    else:
      loads = proportional_loads(weights, dp * own, rotate=s)
      slow = [d for d in range(dp) if 0 < weights[d] < 1]
      if shed and len(slow) < len(live):
        for d in slow:
          loads[d] = max(1, loads[d] - shed)
        rest = [0.0 if d in slow else w for d, w in enumerate(weights)]
        others = proportional_loads(rest, dp * own - sum(loads[d] for d in slow), rotate=s)
        loads = [loads[d] if d in slow else others[d] for d in range(dp)]
    _split_stage(dp, m, samples, s, loads, route, pieces)
  return tuple(tuple(r) for r in route), pieces


def _split_stage(dp: int, m: int, samples: int, s: int, loads: list[int],
                 route: list[list[int]],
                 pieces: dict[tuple[int, int], tuple[tuple[int, int, int], ...]]) -> None:
  """`split_route`'s stage `s` for per-worker sample `loads`: fills `route` and `pieces`."""
  own = m * samples
  parts: dict[int, list[tuple[int, int, int]]] = {}
  line: list[tuple[int, int, int]] = []  # (mb, lo, hi) given away, in id order
  for d in range(dp):
    keep = min(loads[d], own)
    if keep == own:
      continue
    whole, part = divmod(keep, samples)
    kept = [j for j in range(m) if (j + 1) * whole // m != j * whole // m]
    first_given = True
    for j in range(m):
      mb = d * m + j
      if j in kept:
        continue
      if part and first_given:
        parts.setdefault(mb, []).append((d, 0, part))
        line.append((mb, part, samples))
      else:
        line.append((mb, 0, samples))
      first_given = False
  i = 0
  for d in range(dp):
    extra = loads[d] - own
    while extra > 0:
      mb, lo, hi = line[i]
      take = min(extra, hi - lo)
      parts.setdefault(mb, []).append((d, lo, lo + take))
      extra -= take
      if lo + take < hi:
        line[i] = (mb, lo + take, hi)
      else:
        i += 1
  for mb, ps in parts.items():
    ps.sort(key=lambda p: p[1])
    if len(ps) == 1:
      route[mb][s] = ps[0][0]
    else:
      route[mb][s] = ps[0][0]
      pieces[(mb, s)] = tuple(ps)
