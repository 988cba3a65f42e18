"""Planners for a grid with failed workers: ReCycle's adaptive schedule and a naive baseline.

Every stage's weights are replicated over the data-parallel pipelines, so when worker `(d, s)`
fails its micro-batches' stage `s` can run on any live `(d', s)` (ReCycle, Gandhi et al., SOSP'24,
arXiv 2405.14009). `reroute` spreads that work evenly over the stage's survivors; the planners
then order every survivor's ops:

* `plan_adaptive` (ReCycle): split backwards (B on the critical path, W deferrable) placed by an
  event-driven list scheduler over the cost model (`list_scheduler.py`), so the re-routed work
  fills pipeline bubbles, and a staggered optimizer (each worker's AR right after its last W,
  OPT right after AR: no global barrier), within a per-worker cap on micro-batches in flight.
* `plan_naive`: the same routes, no bubble filling: each survivor runs its own base list, then the
  failed worker's base list restricted to the micro-batches it took over.

Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterable, Iterator, Sequence

from resilient_jax.schedule.core import (
  AR,
  BW,
  OPT,
  B,
  Op,
  Piece,
  PieceMap,
  Schedule,
  W,
  Worker,
  make_schedule,
)
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import GENERATORS, generate
from resilient_jax.schedule.list_scheduler import _KIND, _VARIANTS, _list_schedule, _nodes
from resilient_jax.schedule.routing import (
  FailureState,
  Route,
  _live_workers,
  _loads,
  memory_cap_for_load,
  reroute,
  speed_scaled,
  split_route,
)
from resilient_jax.schedule.validate import Timing, peak_inflight, validate

__all__ = ["POLICIES", "plan", "plan_adaptive", "plan_naive", "plan_on_route"]

POLICIES = ("adaptive", "naive")


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
  """Pauses Python's cyclic garbage collector while a plan is made.

  The list scheduler allocates a few tuples per op and the plan an `Op` per op, none of them in
  reference cycles, but every 700 allocations trigger a collection, and in a runtime holding a
  large heap those passes added a third to the planning time on the recovery path (measured at
  16k workers).
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def _to_ops(live: Sequence[Worker], raw: list[list[tuple[int, int]]],
            pieces: PieceMap | None = None, samples: int = 1) -> dict[Worker, list[Op]]:
  if not pieces:
    return {w: [Op(_KIND[k], mb) for k, mb in ops] for w, ops in zip(live, raw, strict=True)}
  rows = {(d, s, mb): (lo, hi) for (mb, s), split in pieces.items() for d, lo, hi in split}
  out: dict[Worker, list[Op]] = {}
  for (d, s), ops in zip(live, raw, strict=True):
    out[(d, s)] = [Piece(_KIND[k], mb, *rows[(d, s, mb)], samples) if (d, s, mb) in rows
                   else Op(_KIND[k], mb) for k, mb in ops]
  return out


def _finish(
  name: str, dp: int, pp: int, m: int, route: Route, compute: dict[Worker, list[Op]],
  pieces: PieceMap | None = None, samples: int = 1,
) -> Schedule:
  """Appends the staggered optimizer: AR right after each worker's last W, then OPT."""
  return make_schedule(
    name, dp, pp, m, {w: [*ops, Op(AR), Op(OPT)] for w, ops in compute.items()}, route=route,
    pieces=pieces, samples=samples,
  )


def _split(ops: Iterable[Op]) -> list[Op]:
  """Turns every fused BW into B then W at the same place."""
  out: list[Op] = []
  for op in ops:
    if op.kind == BW:
      out += [Op(B, op.mb), Op(W, op.mb)]
    else:
      out.append(op)
  return out


def _check_base(base: str) -> None:
  if base not in GENERATORS:
    raise ValueError(f"unknown base schedule {base!r}; choose one of {sorted(GENERATORS)}")


def _check_cap(memory_cap: int | None) -> None:
  if memory_cap is None:
    return
  if isinstance(memory_cap, bool) or not isinstance(memory_cap, int):
    raise ValueError(f"memory_cap must be an int, got {memory_cap!r}")
  if memory_cap < 1:
    # Every F puts one micro-batch in flight: with no room at all nothing can run.
    raise ScheduleError(f"memory_cap={memory_cap} leaves no room for a single micro-batch")


_SHEDS = (0, 1, 2)
"""Micro-batches a slow worker gives up beyond its proportional share, tried in turn (ties go to
the first). On the 4x4 zb-h1 grid of `benchmarks/straggler.py` the best is 0 or 1 depending on
the slow worker's stage and m, 2 sometimes ties; never 3."""


def plan_adaptive(
  state: FailureState, costs: OpCosts, *, memory_cap: int | None = None, base: str = "zb-h1"
) -> Schedule:
  """`plan_adaptive_timed`'s schedule."""
  return plan_adaptive_timed(state, costs, memory_cap=memory_cap, base=base)[0]


def plan_adaptive_timed(
  state: FailureState, costs: OpCosts, *, memory_cap: int | None = None, base: str = "zb-h1"
) -> tuple[Schedule, float]:
  """ReCycle's adaptive schedule for the survivors of `state.failed`, and its makespan under
  `costs` (what `simulate` gives: the planner times every candidate that way).

  Routes come from `reroute`. Every backward is split into B and W, and each worker's ops are
  placed by event-driven list scheduling over `costs`: an idle worker starts a ready B first (it
  is on the critical path of the micro-batch and of the stages below), else a ready F while it
  holds fewer than the cap in flight (so the bottleneck survivors are fed early), else a ready W
  (deferrable: it fills what would be a bubble). Each worker's AR follows its own last W and its
  OPT follows its AR, with no global barrier. A few variants (`_VARIANTS`: which ready F goes
  first, and F before B under 1F1B's warm-up depth) are each timed exactly as `simulate` would
  replay them; the shortest makespan, then the lowest peak memory, wins and is validated. For a
  grid without failures the base order itself (backwards split) is a candidate too.

  Args:
    state: the grid and its failed workers.
    costs: the op costs the plan is optimised for.
    memory_cap: most micro-batches any worker may hold in flight (F done, W not done); None
      means `default_memory_cap(dp, pp, m, failed, base)`.
    base: the fault-free generator whose peak memory sets the default cap (and whose order is a
      candidate when nothing failed).

  Returns:
    A valid schedule named "adaptive", within the cap, and its makespan.

  With `state.speeds` (stragglers), routes share each stage's micro-batches in proportion to
  its workers' speeds (`reroute`), and with each slow worker giving up one or two more
  (`_SHEDS`): a share rounded to whole micro-batches can leave the slow worker the step's
  longest list, where one fewer lets its peers absorb it in their bubbles; each route is
  planned and the fastest kept (at most 3x the planning, on grids planned whole). Every op is
  timed at its worker's speed, and the base order
  on the base routes (no re-routing at all) is a candidate too when nothing failed: a
  slowdown too small to pay for moving work keeps the plan as it is.

  Raises:
    StageLostError: when every worker of a stage has failed.
    ScheduleError: when `memory_cap` is below 1 (no plan can start a micro-batch).
    ValueError: for a bad shape, failed worker or base name.
  """
  _check_base(base)
  _check_cap(memory_cap)
  dp, pp, m, dead, speeds = state.dp, state.pp, state.m, state.failed, state.speeds
  costs.check_stages(pp)
  best: tuple[tuple[float, int], Schedule, float, Timing | None, int] | None = None
  # A worker already down to one micro-batch sheds nothing: its routes are planned once.
  routes: dict[tuple[Route, tuple], None] = dict.fromkeys(
    (reroute(dp, pp, m, dead, speeds, shed), ()) for shed in (_SHEDS if speeds else (0,)))
  if state.samples > 1 and (dead or speeds):
    routes.update(dict.fromkeys(_split_candidates(state)))
  for i, (route, split) in enumerate(routes):
    pieces = dict(split)
    cap = memory_cap if memory_cap is not None else memory_cap_for_load(
      max(_loads(route, pieces).values()), pp, m, base)
    planned = _adaptive_on_route(dp, pp, m, dead, route, costs, cap, base, speeds, pieces,
                                 state.samples)
    score = (round(planned[1], 9), i)
    if best is None or score < best[0]:
      best = (score, *planned, cap)
  _, schedule, makespan, timing, cap = best
  validate(schedule, memory_cap=cap, timing=timing)
  return schedule, makespan


_SHED_SAMPLES = (0, 2, 1, 4)
"""Micro-batches' worth of samples, in halves, a slow worker gives up beyond its proportional
share in `_split_candidates` (0, one, a half, two), tried in turn like `_SHEDS`."""


def _split_candidates(state: FailureState) -> list[tuple[Route, tuple]]:
  """Sample-granular routes for `plan_adaptive` to time besides the whole-micro-batch ones
  (`split_route`): the failed workers' samples over `2m, 4m, ...` takers per stage and over
  every survivor (few large pieces or many small ones: the fixed cost of an op decides which
  is faster), and a slow worker's proportional share of samples, shedding a little more.

  Cost: `log2(D / 2m) + 1` more plans for failures (4 for a straggler), each as a plan of
  whole micro-batches with at most one more node per taking worker and micro-batch split; only
  asked for when `FailureState.samples` is above 1, which the policies set on grids they plan
  whole (the runtime's recovery path, on grids planned by footprint, never pays it)."""
  dp, pp, m, size = state.dp, state.pp, state.m, state.samples
  if state.speeds:
    sheds = dict.fromkeys(h * size // 2 for h in _SHED_SAMPLES)
    out = [split_route(dp, pp, m, size, state.failed, state.speeds, shed=h) for h in sheds]
  else:
    most = dp - min(sum(1 for _, s in state.failed if s == st)
                    for st in {s for _, s in state.failed})
    counts: list[int | None] = []
    t = 2 * m
    while t < most:
      counts.append(t)
      t *= 2
    counts.append(None)
    out = [split_route(dp, pp, m, size, state.failed, takers=t) for t in counts]
  return [(route, tuple(sorted(pieces.items()))) for route, pieces in out]


@_collector_paused()
def _adaptive_on_route(
  dp: int, pp: int, m: int, dead: frozenset[Worker], route: Route, costs: OpCosts, cap: int,
  base: str, speeds: tuple[tuple[Worker, float], ...] = (), pieces: PieceMap | None = None,
  samples: int = 1,
) -> tuple[Schedule, float, Timing | None]:
  """`plan_adaptive` on given routes (and pieces), unvalidated; returns the schedule, its
  makespan and the list scheduler's start times (None when the base order won), `validate`'s
  certificate."""
  live = _live_workers(dp, pp, dead)
  speed_of = dict(speeds)
  speed = [speed_of.get(w, 1.0) for w in live] if speeds else None
  loads = _loads(route, pieces)
  graph = _nodes(pp, route, live, pieces, samples, costs.fixed)
  ramp = [math.ceil((pp - s) * loads[(d, s)] / m) for d, s in live]
  # Each variant costs one O(#ops log #ops) pass; past ~50k ops only the first few are tried so
  # that planning a 64x16 grid stays within a few seconds.
  variants = _VARIANTS if 3 * len(route) * pp <= 50_000 else _VARIANTS[:3]
  best: tuple[float, int] | None = None
  raw: list[list[tuple[int, int]]] = []
  # Variants that would repeat a plan already made are skipped (planning is on the recovery
  # path): "local" after a "feed" that picked as it would, "crit" when it orders as "mb".
  same_as_local: set[tuple[tuple[int, ...], str | None]] = set()
  crit_is_mb = False
  for order, f_key, limit in variants:
    if f_key == "local" and (order, limit) in same_as_local:
      continue
    if f_key == "crit" and crit_is_mb and (order, "mb", limit) in variants:
      continue
    out, starts, span, peak, feed_was_local, crit_is_mb = _list_schedule(
      pp, m, route, live, costs, cap, order, f_key, ramp if limit == "ramp" else None, speed,
      beat=math.inf if best is None else best[0], beat_peak=0 if best is None else best[1],
      pieces=pieces, samples=samples, graph=graph)
    if feed_was_local:
      same_as_local.add((order, limit))
    score = (round(span, 9), peak)
    if best is None or score < best:
      best, raw, makespan, times = score, out, span, starts
  chosen = _to_ops(live, raw, pieces, samples)
  timing: Timing | None = Timing(dict(zip(live, times, strict=True)),
                                 speed_scaled(costs, speeds), costs.comm)
  if not dead:
    # Without failures the base order itself (backwards split, on the base routes) is a
    # candidate, so that the adaptive plan of a healthy grid, or of one whose stragglers are
    # not worth re-routing for, is never slower than its base schedule.
    fault_free = generate(base, dp, pp, m)
    base_compute = {w: _split(op for op in ops if op.mb >= 0) for w, ops in fault_free.ops.items()}
    cand = _finish("adaptive", dp, pp, m, fault_free.route, base_compute)
    peak = max(peak_inflight(ops) for ops in base_compute.values())
    span = simulate(cand, speed_scaled(costs, speeds), comm=costs.comm).makespan
    score = (round(span, 9), peak)
    if peak <= cap and best is not None and score < best:
      chosen, makespan, route, timing = base_compute, span, fault_free.route, None
      pieces = None
  return _finish("adaptive", dp, pp, m, route, chosen, pieces, samples), makespan, timing


def plan_on_route(
  policy: str,
  dp: int,
  pp: int,
  m: int,
  dead: frozenset[Worker],
  route: Route,
  costs: OpCosts,
  *,
  memory_cap: int | None = None,
  base: str,
  check: bool = False,
) -> tuple[Schedule, float | None]:
  """What `plan` makes, on routes given by the caller; validated only with `check`.

  The runtime plans a failure on the part of the grid it touches (`expand.py`), whose routes are
  the full grid's `reroute` restricted to it, not `reroute` of the smaller grid. With `check`
  the plan is validated, the adaptive one by its planner's times (`validate.Timing`: a few
  lookups an op, not a replay), the naive one by a replay.

  Args:
    policy: "adaptive" or "naive".
    dp: pipelines of this grid.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    dead: its failed workers (at least one).
    route: `route[mb][stage]`, live workers only.
    costs: op costs (the full grid's, all-reduce included).
    memory_cap: the in-flight cap for "adaptive"; None: `memory_cap_for_load` of the busiest
      worker under `route`, as `default_memory_cap` would give the full grid.
    base: the fault-free generator.
    check: validate the plan (within the cap it was planned under).

  Returns:
    The schedule and, for "adaptive", its makespan under `costs` (the list scheduler's, equal to
    `simulate`'s); None for "naive".

  Raises:
    ScheduleError: when `memory_cap` is below 1.
    ValueError: for an unknown policy or base.
  """
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICIES)}")
  _check_base(base)
  if policy == "naive":
    naive = _finish("naive", dp, pp, m, route, _naive_compute(dp, pp, m, dead, route, base))
    if check:
      validate(naive)
    return naive, None
  _check_cap(memory_cap)
  costs.check_stages(pp)
  cap = memory_cap
  if cap is None:
    cap = memory_cap_for_load(max(_loads(route).values()), pp, m, base)
  schedule, makespan, timing = _adaptive_on_route(dp, pp, m, dead, route, costs, cap, base)
  if check:
    validate(schedule, memory_cap=cap, timing=timing)
  return schedule, makespan


def _naive_compute(
  dp: int, pp: int, m: int, dead: frozenset[Worker], route: Route, base: str,
  slow: Iterable[Worker] = (),
) -> dict[Worker, list[Op]]:
  """Every survivor's compute ops under the naive policy (see `plan_naive`).

  Each worker runs, owner pipeline by owner pipeline, the ops that owner's base list at this
  stage has for the micro-batches routed here, in that list's order: intact pipelines first
  (a survivor's own list), then damaged pipelines by id (the failed workers' lists it took over
  from). Every list is thereby sorted by one global key, (owner's rank, start time in the
  fault-free base run), which every dependency increases (a dependency never leaves its
  micro-batch), so the plan cannot deadlock. Plain "own list, then the orphans" can: with
  failures in two stages, two damaged pipelines may each wait at the end of their lists for work
  the other one only does at the end of its own. A `slow` worker's pipeline counts as damaged
  (its peers take its work after their own).
  """
  sched = generate(base, dp, pp, m)
  damaged = {d for d, _ in dead} | {d for d, _ in slow}
  compute: dict[Worker, list[Op]] = {w: [] for w in _live_workers(dp, pp, dead)}
  owners = sorted(range(dp), key=lambda d: (d in damaged, d))
  for d in owners:
    for s in range(pp):
      for op in sched.ops[(d, s)]:
        if op.mb >= 0:
          compute[(route[op.mb][s], s)].append(op)
  return compute


def plan_naive(state: FailureState, *, base: str = "1f1b") -> Schedule:
  """The re-routing without bubble filling: the baseline `plan_adaptive` is measured against.

  Each survivor runs its own base-schedule compute ops, then those of every failed worker of its
  stage restricted to the micro-batches it took over, in the failed worker's own order, then AR
  and OPT. The backward stays as the base has it (fused BW for "1f1b" and "gpipe"). When failures
  in several stages make a damaged pipeline take over another damaged pipeline's work, the lists
  are ordered by pipeline (intact ones, then damaged ones by id) instead, which is what keeps
  the plan deadlock free.

  Args:
    state: the grid and its failed workers.
    base: the fault-free generator whose lists are reused.

  Returns:
    A valid schedule named "naive".

  Raises:
    StageLostError: when every worker of a stage has failed.
    ValueError: for a bad shape, failed worker or base name.
  """
  _check_base(base)
  dp, pp, m, dead = state.dp, state.pp, state.m, state.failed
  route = reroute(dp, pp, m, dead, state.speeds)
  slow = [w for w, _ in state.speeds]
  schedule = _finish("naive", dp, pp, m, route, _naive_compute(dp, pp, m, dead, route, base, slow))
  validate(schedule)
  return schedule


def plan(
  policy: str,
  state: FailureState,
  costs: OpCosts,
  *,
  memory_cap: int | None = None,
  base: str | None = None,
) -> Schedule:
  """`plan_timed`'s schedule."""
  return plan_timed(policy, state, costs, memory_cap=memory_cap, base=base)[0]


def plan_timed(
  policy: str,
  state: FailureState,
  costs: OpCosts,
  *,
  memory_cap: int | None = None,
  base: str | None = None,
) -> tuple[Schedule, float | None]:
  """The schedule `policy` runs on the survivors of `state.failed`, and its makespan under
  `costs` where the planner timed it ("adaptive" on failures; else None: `simulate` it).

  Args:
    policy: "adaptive" (`plan_adaptive`) or "naive" (`plan_naive`).
    state: the grid and its failed workers; with none, the base generator's schedule is
      returned as is, so fault-free behaviour does not depend on the policy.
    costs: op costs (used by "adaptive").
    memory_cap: in-flight cap for "adaptive"; "naive" keeps its base's memory per list.
    base: the fault-free generator; None means "zb-h1" for "adaptive" and "1f1b" for "naive".

  Returns:
    The schedule, and its makespan or None.

  Raises:
    StageLostError: when every worker of a stage has failed.
    ScheduleError: when the memory cap makes planning impossible.
    ValueError: for an unknown policy, a bad shape, failed worker or base name.
  """
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICIES)}")
  if base is None:
    base = "zb-h1" if policy == "adaptive" else "1f1b"
  _check_base(base)
  if not state.failed and not state.speeds:
    return generate(base, state.dp, state.pp, state.m), None
  if policy == "adaptive":
    return plan_adaptive_timed(state, costs, memory_cap=memory_cap, base=base)
  return plan_naive(state, base=base), None
