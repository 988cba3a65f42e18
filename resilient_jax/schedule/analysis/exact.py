"""The optimal adaptive schedule of a tiny grid, by mixed-integer programming (scipy's HiGHS).

Used to measure how far `plan_adaptive`'s list scheduling is from the best possible order. The
routes are `reroute`'s (fixed), every backward is split into B and W, and each worker ends with
AR then OPT, as in `plan_adaptive`: what is optimised is the order of every worker's ops, i.e.
exactly the freedom the heuristic has. The model is disjunctive:

* one start time per F, B and W, one per stage for its AR (a collective: all of the stage's
  workers start it together, once each of them has finished its compute), and the makespan;
* the cost model's precedences: F after the previous stage's F, B after its own F and after the
  next stage's B, W after its B, plus `comm` on every edge between two workers;
* for every pair of ops of one worker that no precedence orders, a binary saying which goes
  first, with big-M constraints so that the two do not overlap;
* for the memory cap, at every F: 1 + the micro-batches whose F is before it and whose W is
  after it (products of order binaries, linearised) stays within the cap.

Big-M disjunctions have a weak LP relaxation, so the model is tightened with what is known
anyway: the heuristic plan's makespan bounds every start (the big-M), and `route_lower_bound`
plus each worker's "earliest start + total work" bound the makespan from below. The number of
binaries still grows with the square of the ops per worker: keep it to a handful of micro-batches
(dp=2, pp=2, m=2 solves in well under a second without a cap, a few seconds with a tight one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
from scipy import optimize, sparse

from resilient_jax.schedule.adaptive import plan_adaptive
from resilient_jax.schedule.core import AR, OPT, B, F, Op, Schedule, W, Worker, make_schedule
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.routing import (
  FailureState,
  Route,
  _live_workers,
  reroute,
  route_lower_bound,
)

__all__ = ["ExactResult", "optimal_makespan", "solve_exact"]

# Past this many order binaries the model is no longer "tiny": refuse rather than run for hours.
_MAX_BINARIES = 2000


@dataclasses.dataclass(frozen=True)
class ExactResult:
  """An optimal plan.

  Attributes:
    makespan: the optimal makespan (the replay of `schedule`, which is the MILP's objective up to
      the solver's tolerance).
    schedule: a schedule reaching it (every worker's ops sorted by their optimal start times),
      named "exact".
  """

  makespan: float
  schedule: Schedule


class _Model:
  """A sparse MILP under construction: its variables' bounds and kinds, and rows
  `lo <= A x <= hi`."""

  def __init__(self):
    self.rows: list[int] = []
    self.cols: list[int] = []
    self.vals: list[float] = []
    self.lo: list[float] = []
    self.hi: list[float] = []
    self.lower: list[float] = []
    self.upper: list[float] = []
    self.integrality: list[int] = []

  @property
  def n_vars(self) -> int:
    return len(self.lower)

  def add_vars(self, count: int, lower: float, upper: float, integer: bool = False) -> int:
    """Adds `count` variables within `[lower, upper]`; returns the first one's index."""
    first = self.n_vars
    self.lower += [lower] * count
    self.upper += [upper] * count
    self.integrality += [int(integer)] * count
    return first

  def add(self, terms: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
    r = len(self.lo)
    for col, val in terms:
      self.rows.append(r)
      self.cols.append(col)
      self.vals.append(val)
    self.lo.append(lo)
    self.hi.append(hi)

  def matrix(self) -> sparse.csr_matrix:
    return sparse.csr_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), self.n_vars))


@dataclasses.dataclass(frozen=True)
class _Ops:
  """The compute ops of the model; op `i`'s start time is variable `i`.

  Attributes:
    ops: every F, B and W, as `(worker, op)`, micro-batch by micro-batch, stage by stage.
    index: the position of each `(worker, op)` in `ops`.
    per_worker: per live worker, the positions of its ops.
    dur: per op, its duration under the costs.
  """

  ops: list[tuple[Worker, Op]]
  index: dict[tuple[Worker, Op], int]
  per_worker: dict[Worker, list[int]]
  dur: list[float]


def _compute_ops(route: Route, live: list[Worker], pp: int, costs: OpCosts) -> _Ops:
  """Every survivor's F, B and W under `route`."""
  ops: list[tuple[Worker, Op]] = []
  index: dict[tuple[Worker, Op], int] = {}
  per_worker: dict[Worker, list[int]] = {w: [] for w in live}
  for mb in range(len(route)):
    for s in range(pp):
      w = (route[mb][s], s)
      for kind in (F, B, W):
        index[(w, Op(kind, mb))] = len(ops)
        per_worker[w].append(len(ops))
        ops.append((w, Op(kind, mb)))
  return _Ops(ops, index, per_worker, [costs.duration(w, op) for w, op in ops])


def _order_pairs(ops: _Ops) -> list[tuple[int, int]]:
  """The pairs of one worker's ops that no precedence orders: each needs an order binary.

  Raises:
    ScheduleError: past `_MAX_BINARIES` of them.
  """
  pairs: list[tuple[int, int]] = []
  for idx in ops.per_worker.values():
    for a_pos, i in enumerate(idx):
      for j in idx[a_pos + 1 :]:
        if ops.ops[i][1].mb != ops.ops[j][1].mb:  # F < B < W of one micro-batch are precedences
          pairs.append((i, j))
  if len(pairs) > _MAX_BINARIES:
    raise ScheduleError(
      f"exact model needs {len(pairs)} order binaries (> {_MAX_BINARIES}): not a tiny case"
    )
  return pairs


def _add_precedences(
  model: _Model, ops: _Ops, route: Route, pp: int, ar_var: dict[int, int], comm: float
) -> None:
  """The cost model's precedences: F after the previous stage's F, B after its own F and the
  next stage's B, W after its B (plus `comm` between workers); each stage's AR after all of its
  workers' ops."""
  index, dur, inf = ops.index, ops.dur, np.inf
  for k, (w, op) in enumerate(ops.ops):
    mb, s = op.mb, w[1]
    if op.kind == F and s > 0:
      up = index[((route[mb][s - 1], s - 1), Op(F, mb))]
      model.add([(k, 1.0), (up, -1.0)], dur[up] + comm, inf)
    elif op.kind == B:
      model.add([(k, 1.0), (index[(w, Op(F, mb))], -1.0)], dur[index[(w, Op(F, mb))]], inf)
      if s < pp - 1:
        down = index[((route[mb][s + 1], s + 1), Op(B, mb))]
        model.add([(k, 1.0), (down, -1.0)], dur[down] + comm, inf)
    elif op.kind == W:
      b = index[(w, Op(B, mb))]
      model.add([(k, 1.0), (b, -1.0)], dur[b], inf)
    # The stage's AR starts after every op of every one of its workers.
    model.add([(ar_var[s], 1.0), (k, -1.0)], dur[k], inf)


def _add_makespan_bounds(
  model: _Model, ops: _Ops, costs: OpCosts, ar_var: dict[int, int], c_var: int, floor: float
) -> None:
  """The makespan after every stage's AR and OPT, and the cuts that give the LP its bound:
  `floor` below the makespan, and every op after the earliest start of its stage (the forward
  chain), every AR after that plus its worker's total work."""
  inf, pp = np.inf, len(ar_var)
  for s in range(pp):
    model.add([(c_var, 1.0), (ar_var[s], -1.0)], costs.ar_at(s) + costs.opt_at(s), inf)
  model.add([(c_var, 1.0)], floor, inf)
  head = [0.0] * pp
  for s in range(1, pp):
    head[s] = head[s - 1] + costs.f_at(s - 1) + costs.comm
  for w, idx in ops.per_worker.items():
    model.add([(ar_var[w[1]], 1.0)], head[w[1]] + sum(ops.dur[i] for i in idx), inf)
    for i in idx:
      model.add([(i, 1.0)], head[w[1]], inf)


def _add_disjunctions(
  model: _Model, ops: _Ops, order_var: dict[tuple[int, int], int], horizon: float
) -> None:
  """Big-M rows so that two ops of a worker do not overlap, in the order their binary says."""
  for (i, j), y in order_var.items():
    # y = 1: i then j; y = 0: j then i.
    model.add([(j, 1.0), (i, -1.0), (y, -horizon)], ops.dur[i] - horizon, np.inf)
    model.add([(i, 1.0), (j, -1.0), (y, horizon)], ops.dur[j], np.inf)


def _add_memory_cap(
  model: _Model, ops: _Ops, order_var: dict[tuple[int, int], int], memory_cap: int
) -> None:
  """At every F: 1 + the micro-batches whose F is before it and whose W is after it stays
  within `memory_cap`; each such "before and after" is a product of order binaries, linearised
  by a new variable."""

  def before(i: int, j: int) -> tuple[int, float, float]:
    """(var, coef, const) with coef * x[var] + const == 1 iff op i runs before op j."""
    if (i, j) in order_var:
      return order_var[(i, j)], 1.0, 0.0
    return order_var[(j, i)], -1.0, 1.0

  for idx in ops.per_worker.values():
    fs = {ops.ops[i][1].mb: i for i in idx if ops.ops[i][1].kind == F}
    ws = {ops.ops[i][1].mb: i for i in idx if ops.ops[i][1].kind == W}
    if len(fs) <= memory_cap:
      continue
    for x, fx in fs.items():
      terms: list[tuple[int, float]] = []
      for y_mb, fy in fs.items():
        if y_mb == x:
          continue
        # z >= [F_y before F_x] + [F_x before W_y] - 1, z in [0, 1]; sum of z <= cap - 1.
        z = model.add_vars(1, 0.0, 1.0)
        v1, c1, k1 = before(fy, fx)
        v2, c2, k2 = before(fx, ws[y_mb])
        model.add([(z, 1.0), (v1, -c1), (v2, -c2)], k1 + k2 - 1.0, np.inf)
        terms.append((z, 1.0))
      model.add(terms, -np.inf, memory_cap - 1.0)


def _solve(model: _Model, c_var: int, time_limit: float) -> np.ndarray:
  """The optimal values of the variables, minimising the makespan `c_var`.

  Raises:
    ScheduleError: when HiGHS does not prove optimality within `time_limit`.
  """
  objective = np.zeros(model.n_vars)
  objective[c_var] = 1.0
  result = optimize.milp(
    objective,
    constraints=optimize.LinearConstraint(model.matrix(), model.lo, model.hi),
    integrality=np.array(model.integrality),
    bounds=optimize.Bounds(model.lower, model.upper),
    # HiGHS stops at a 1e-4 relative gap by default: "optimal" has to mean optimal here.
    options={"time_limit": time_limit, "mip_rel_gap": 1e-9},
  )
  if result.status != 0 or result.x is None:
    raise ScheduleError(f"exact model not solved to optimality: {result.message}")
  return result.x


def solve_exact(
  state: FailureState,
  costs: OpCosts,
  memory_cap: int | None = None,
  *,
  time_limit: float = 60.0,
) -> ExactResult:
  """Finds the optimal order of every survivor's ops for `reroute`'s routes.

  Args:
    state: the grid and its failed workers.
    costs: op costs (per stage, plus `comm` on every dependency between two workers).
    memory_cap: most micro-batches in flight (F done, W not) on any worker; None: no cap.
    time_limit: seconds HiGHS may spend before this gives up.

  Returns:
    The optimal makespan and a schedule that reaches it.

  Raises:
    ScheduleError: when the model is too large to be "tiny", the cap is infeasible (below 1) or
      the solver does not prove optimality within `time_limit`.
    StageLostError: when a stage has no live worker.
  """
  dp, pp, m, dead = state.dp, state.pp, state.m, state.failed
  costs.check_stages(pp)
  route = reroute(dp, pp, m, dead)
  live = _live_workers(dp, pp, dead)
  if memory_cap is not None and memory_cap < 1:
    raise ScheduleError(f"memory_cap={memory_cap} leaves no room for a single micro-batch")
  ops = _compute_ops(route, live, pp, costs)
  # The heuristic's plan is feasible, so its makespan bounds every start of an optimal plan: a
  # big-M that small keeps the LP relaxation from being useless.
  cap = memory_cap if memory_cap is not None else dp * m
  heuristic = plan_adaptive(state, costs, memory_cap=cap)
  horizon = simulate(heuristic, costs).makespan + 1e-6
  pairs = _order_pairs(ops)

  # Variables: one start per compute op, one AR start per stage, the makespan, order binaries,
  # then the memory products.
  model = _Model()
  model.add_vars(len(ops.ops), 0.0, horizon)
  ar_var = {s: model.add_vars(1, 0.0, horizon) for s in range(pp)}
  c_var = model.add_vars(1, 0.0, horizon)
  first_order = model.add_vars(len(pairs), 0.0, 1.0, integer=True)
  order_var = {pair: first_order + k for k, pair in enumerate(pairs)}
  _add_precedences(model, ops, route, pp, ar_var, costs.comm)
  floor = route_lower_bound(state, costs, memory_cap=memory_cap)
  _add_makespan_bounds(model, ops, costs, ar_var, c_var, floor)
  _add_disjunctions(model, ops, order_var, horizon)
  if memory_cap is not None:
    _add_memory_cap(model, ops, order_var, memory_cap)
  x = _solve(model, c_var, time_limit)

  lists: dict[Worker, list[Op]] = {}
  for w, idx in ops.per_worker.items():
    # Ties (zero durations) keep F < B < W of a micro-batch in their precedence order.
    ranked = sorted(idx, key=lambda i: (round(x[i], 6), "FBW".index(ops.ops[i][1].kind), i))
    lists[w] = [ops.ops[i][1] for i in ranked] + [Op(AR), Op(OPT)]
  schedule = make_schedule("exact", dp, pp, m, lists, route=route)
  # The replay of the optimal order: the objective up to the solver's float tolerance.
  return ExactResult(makespan=simulate(schedule, costs).makespan, schedule=schedule)


def optimal_makespan(state: FailureState, costs: OpCosts, memory_cap: int | None = None) -> float:
  """The best makespan any order of the survivors' ops reaches (`solve_exact`'s arguments and
  errors)."""
  return solve_exact(state, costs, memory_cap).makespan
