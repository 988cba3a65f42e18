"""Resilience policies as the simulator sees them, behind one small Protocol.

A policy answers two questions about a `Grid` and a set of failed workers:

* `step_time`: seconds per training step (the whole global batch) in the steady state of that
  failure state, or `inf` when it cannot train at all;
* `recovery`: the one-off cost of moving from one failure state to the next: a pause, and
  whether the work since the last checkpoint is lost (`rollback`).

The re-routing policies call the library's own planners (`resilient_jax.schedule.adaptive`) and
price their schedules with the library's own cost model (`resilient_jax.schedule.cost.simulate`):
the simulator has no second implementation of a schedule. At cluster scale they plan on the
reduced grid of `resilient_jax.sim.reduce`. Step times are cached by failure pattern (or, on
grids small enough to plan exactly, by the failed set), because failure states repeat.

Registered policies:

* `recycle`: ReCycle's adaptive planner (`plan_adaptive`); a failure costs detection, a regroup
  of the all-reduce groups and, on average, half of the step in flight.
* `naive`: the same re-routing without bubble filling (`plan_naive`); same recovery.
* `restart`: checkpoint-restart. A failure loses the work since the last checkpoint and pays
  detection plus a restart (rescheduling, start-up, restore); training resumes on the largest
  grid the survivors can form: `D'' = floor(live workers / p)` pipelines (the stage count is
  kept: it is what makes a stage fit in memory), each running `ceil(D*m / D'')` micro-batches so
  that the global batch is unchanged. With `D'' = 0` it waits for a repair. A repair that lets
  `D''` grow is taken with a planned restart (checkpoint first: no work lost).
* `oobleck`, `bamboo`: the planners of `resilient_jax/schedule/oobleck.py` and `bamboo.py`
  through the adapters in `external.py`; if those modules do not import they are registered as
  not available and raise if selected, and `check` says when one cannot handle a grid.
* `auto`: per failure state, the fastest available policy by the cost model (within 1% counts
  as a tie, which the in-place policies win over `restart`).

When every worker of a stage has failed no re-routing policy can go on: `recycle` and `naive`
then behave as `restart` until the stage has a live worker again (the runtime exits with code 3
and the cluster scheduler restarts it from a checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping

from resilient_jax.schedule import adaptive
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.sim.cost_model import CostModel
from resilient_jax.sim.policy_base import (
  Grid,
  Policy,
  PolicyUnavailableError,
  Recovery,
  RecoveryParams,
  RestartPolicy,
  Transition,
  _stage_lost,
)
from resilient_jax.sim.reduce import failure_pattern, reduce_pattern

__all__ = [
  "POLICY_NAMES",
  "AutoPolicy",
  "PlannerPolicy",
  "UnavailablePolicy",
  "build_policies",
  "policy_status",
  "usable_policies",
]

POLICY_NAMES = ("recycle", "naive", "oobleck", "bamboo", "restart", "auto")

# Grids with at most this many compute ops (3 * D * p * m) are planned whole, not reduced:
# planning 12k ops takes well under a second.
DEFAULT_EXACT_OPS = 12_000
AUTO_TIE = 0.01


class PlannerPolicy:
  """A re-routing policy: one of `adaptive.plan`'s planners on the survivors.

  Args:
    name: the policy's name ("recycle", "naive").
    planner: the `adaptive.plan` policy ("adaptive", "naive").
    description: one line for reports.
    params: recovery times.
    restart: the policy used while a stage has no live worker.
    exact_ops: grids with at most this many compute ops are planned whole, not reduced.
    keep_sources: passed to `reduce_pattern` (the naive planner needs it).
  """

  available = True

  def __init__(
    self,
    name: str,
    planner: str,
    description: str,
    params: RecoveryParams,
    restart: RestartPolicy,
    exact_ops: int = DEFAULT_EXACT_OPS,
    *,
    keep_sources: bool = False,
  ):
    self.name = name
    self.planner = planner
    self.description = description
    self.params = params
    self.restart = restart
    self.exact_ops = exact_ops
    self.keep_sources = keep_sources
    self._cache: dict[Hashable, float] = {}
    self.plans = 0

  def check(self, grid: Grid, costs: CostModel) -> None:
    del grid, costs  # any grid

  def planning_grid(
    self, grid: Grid, failed: frozenset[Worker], *, reduce: bool | None = None
  ) -> tuple[int, frozenset[Worker], Hashable]:
    """`(dp, failed, cache key)` of the grid actually planned for this failure state.

    Args:
      grid: the full grid.
      failed: its failed workers.
      reduce: True: always the reduced grid; False: always the full one; None: reduced once the
        full grid has more than `exact_ops` compute ops.
    """
    state = self._state(grid, failed, reduce)
    if state[0] == "exact":
      return grid.dp, failed, state
    dp, reduced = reduce_pattern(grid.dp, grid.pp, grid.m, state[1], keep_sources=self.keep_sources)
    return dp, reduced, state

  def _state(self, grid: Grid, failed: frozenset[Worker], reduce: bool | None) -> tuple:
    """What the step time depends on: the failed set on a small grid, else its pattern."""
    if reduce is None:
      reduce = grid.compute_ops > self.exact_ops
    if not reduce:
      return ("exact", failed)
    return ("pattern", failure_pattern(grid.dp, grid.pp, failed))

  def schedule(
    self, grid: Grid, failed: frozenset[Worker], costs: CostModel, *, reduce: bool | None = None
  ) -> tuple[Schedule, OpCosts]:
    """The schedule this policy runs for `failed` (on the planning grid) and its op costs.

    The op costs carry the full grid's all-reduce (live workers per stage of `grid`).

    Raises:
      StageLostError: when a stage has no live worker.
    """
    op = costs.op_costs(grid.live_per_stage(failed))
    dp, planned_failed, _ = self.planning_grid(grid, failed, reduce=reduce)
    self.plans += 1
    sched = adaptive.plan(
      self.planner,
      dp,
      grid.pp,
      grid.m,
      planned_failed,
      op,
      memory_cap=grid.memory_cap,
      base=grid.base,
    )
    return sched, op

  def step_time(
    self,
    grid: Grid,
    failed: frozenset[Worker],
    costs: CostModel,
    *,
    reduce: bool | None = None,
  ) -> float:
    if _stage_lost(grid, failed):
      return self.restart.step_time(grid, failed, costs)
    key = (grid, self._state(grid, failed, reduce), costs)
    if key not in self._cache:
      sched, op = self.schedule(grid, failed, costs, reduce=reduce)
      self._cache[key] = simulate(sched, op).makespan
    return self._cache[key]

  def recovery(self, t: Transition) -> Recovery:
    if t.before == t.after:
      return Recovery(0.0)
    lost_before, lost_after = _stage_lost(t.grid, t.before), _stage_lost(t.grid, t.after)
    if lost_after or lost_before:
      if not lost_after:
        # The stage is back: a planned restart onto the full grid re-routing can run on again.
        return Recovery(self.params.restart_s, restart=True)
      if not lost_before:
        return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
      return self.restart.recovery(t)
    if t.failure:
      # The step in flight when the worker died is redone: on average half of it is lost.
      lost = t.step_time_before / 2 if math.isfinite(t.step_time_before) else 0.0
      return Recovery(self.params.detect_s + self.params.regroup_s + lost)
    return Recovery(self.params.regroup_s)


class UnavailablePolicy:
  """A registered policy whose planner is not in this checkout: selecting it is an error."""

  available = False

  def __init__(self, name: str, reason: str):
    self.name = name
    self.reason = reason
    self.description = f"not available: {reason}"

  def _fail(self) -> float:
    raise PolicyUnavailableError(f"policy {self.name!r} is not available: {self.reason}")

  def check(self, grid: Grid, costs: CostModel) -> None:
    self._fail()

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    return self._fail()

  def recovery(self, t: Transition) -> Recovery:
    self._fail()
    raise AssertionError("unreachable")


class AutoPolicy:
  """The policy expected to train the most until the next failure or repair.

  In a sweep (no run in progress) it is the fastest candidate in the steady state of each
  failure state: step times within `AUTO_TIE` (1%) of the fastest count as a tie, which the
  candidate listed first wins (the re-routing policies come before `restart`).

  Through a trace (`reset` starts a run) it chooses at every event, weighing the one-off cost of
  getting there: for each candidate, the pause of moving to it from the policy in force (a
  switch to or from `restart` is a re-layout: a restart, with a rollback when a failure forced
  it; other switches cost what the new policy's own recovery costs), plus on a rollback the
  expected work lost (half a checkpoint interval), against its step time in the new state, over
  `horizon_s`, the expected time until the next event. A faster steady state that cannot pay
  back its switch before the next failure is not taken.

  Candidates that cannot evaluate the grid (`check` fails, e.g. Oobleck past its size limit)
  are left out.
  """

  name = "auto"
  available = True

  def __init__(self, candidates: Mapping[str, Policy], params: RecoveryParams):
    if not candidates:
      raise ValueError("auto needs at least one available policy")
    self.candidates = dict(candidates)
    self.params = params
    self.description = (
      "per event the policy expected to train the most until the next one, switch costs "
      "included, of " + ", ".join(self.candidates)
    )
    self._usable: dict[Hashable, list[Policy]] = {}
    self.horizon_s = params.checkpoint_interval_s
    self._current: Policy | None = None
    self._running = False

  def reset(self, horizon_s: float) -> None:
    """Starts a run through a trace whose events are `horizon_s` apart on average."""
    self.horizon_s = horizon_s
    self._current = None
    self._running = True

  def usable(self, grid: Grid, costs: CostModel) -> list[Policy]:
    """The candidates that can evaluate this grid with these costs."""
    key = (grid, costs)
    if key not in self._usable:
      ok = []
      for policy in self.candidates.values():
        try:
          policy.check(grid, costs)
        except PolicyUnavailableError:
          continue
        ok.append(policy)
      self._usable[key] = ok
    return self._usable[key]

  def check(self, grid: Grid, costs: CostModel) -> None:
    if not self.usable(grid, costs):
      raise PolicyUnavailableError("auto: no candidate policy can evaluate this grid")

  def choice(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> Policy:
    """The candidate with the shortest step time (the first listed on a tie)."""
    best, best_t = None, math.inf
    for policy in self.usable(grid, costs):
      t = policy.step_time(grid, failed, costs)
      # Within AUTO_TIE of the fastest counts as a tie, won by the policy listed first (in-place
      # policies before restart).
      if best is None or t < best_t * (1 - AUTO_TIE):
        best, best_t = policy, t
    if best is None:
      self.check(grid, costs)
    return best

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    if self._running and self._current is None:
      self._current = self.choice(grid, failed, costs)  # the run's fault-free start
    policy = self._current if self._running else self.choice(grid, failed, costs)
    return policy.step_time(grid, failed, costs)

  def _switch(self, old: Policy, new: Policy, t: Transition) -> Recovery:
    """The one-off cost of `t` when `old` was in force and `new` takes over."""
    if old is new or "restart" not in (old.name, new.name):
      return new.recovery(t)
    if t.failure:
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    return Recovery(self.params.restart_s, restart=True)

  def recovery(self, t: Transition) -> Recovery:
    if not self._running:
      old, new = self.choice(t.grid, t.before, t.costs), self.choice(t.grid, t.after, t.costs)
      return self._switch(old, new, t)
    old = self._current or self.choice(t.grid, t.before, t.costs)
    best, best_value, best_rec = None, -math.inf, None
    for policy in self.usable(t.grid, t.costs):
      rec = self._switch(old, policy, t)
      lost = self.params.checkpoint_interval_s / 2 if rec.rollback else 0.0
      step = policy.step_time(t.grid, t.after, t.costs)
      steps = max(self.horizon_s - rec.pause_s - lost, 0.0) / step if math.isfinite(step) else 0.0
      # Ties (within AUTO_TIE) keep the policy in force, then the first listed.
      if best is None or steps > best_value * (1 + AUTO_TIE) or (
        policy is old and steps >= best_value * (1 - AUTO_TIE)
      ):
        best, best_value, best_rec = policy, steps, rec
    self._current = best
    return best_rec


def _external(name: str, params: RecoveryParams, restart: RestartPolicy) -> Policy:
  """The adapter for a planner module written outside the simulator, if it imports."""
  try:
    from resilient_jax.sim import external
  except ImportError as e:  # the planner module is missing or its API changed
    return UnavailablePolicy(name, f"resilient_jax/schedule/{name}.py does not import ({e})")
  if name == "oobleck":
    return external.OobleckPolicy(params, restart)
  return external.BambooPolicy(params, restart)


def usable_policies(
  policies: Mapping[str, Policy], grid: Grid, costs: CostModel
) -> tuple[dict[str, Policy], dict[str, str]]:
  """Splits `policies` into those that can evaluate `grid` with `costs` and, for the others,
  the reason why not."""
  usable, reasons = {}, {}
  for name, policy in policies.items():
    try:
      policy.check(grid, costs)
    except PolicyUnavailableError as e:
      reasons[name] = str(e)
      continue
    usable[name] = policy
  return usable, reasons


def policy_status(
  grid: Grid | None = None, costs: CostModel | None = None
) -> dict[str, str | None]:
  """Every registered policy and why it is unavailable (None: available), for `grid` and
  `costs` when given (some policies only handle some grids)."""
  out: dict[str, str | None] = {}
  for name, policy in build_policies(POLICY_NAMES, _check=False).items():
    if not policy.available:
      out[name] = policy.reason
      continue
    out[name] = None
    if grid is not None and costs is not None:
      try:
        policy.check(grid, costs)
      except PolicyUnavailableError as e:
        out[name] = str(e)
  return out


def build_policies(
  names: Iterable[str] | None = None,
  *,
  params: RecoveryParams | None = None,
  exact_ops: int = DEFAULT_EXACT_OPS,
  _check: bool = True,
) -> dict[str, Policy]:
  """Fresh policy objects (with empty caches) for one simulation.

  Args:
    names: policies to build, in order; None: every available one.
    params: recovery times.
    exact_ops: see `PlannerPolicy`.

  Returns:
    `{name: policy}`. `auto` chooses among the other available policies.

  Raises:
    ValueError: for an unknown name.
    PolicyUnavailableError: when a named policy is not available in this checkout.
  """
  params = params or RecoveryParams()
  restart = RestartPolicy(params)
  every: dict[str, Policy] = {
    "recycle": PlannerPolicy(
      "recycle",
      "adaptive",
      "ReCycle: re-route to peers, fill bubbles (plan_adaptive)",
      params,
      restart,
      exact_ops,
    ),
    "naive": PlannerPolicy(
      "naive",
      "naive",
      "re-route to peers, no bubble filling (plan_naive)",
      params,
      restart,
      exact_ops,
      keep_sources=True,
    ),
    "oobleck": _external("oobleck", params, restart),
    "bamboo": _external("bamboo", params, restart),
    "restart": restart,
  }
  every["auto"] = AutoPolicy({n: p for n, p in every.items() if p.available}, params)
  if names is None:
    return {n: p for n, p in every.items() if p.available}
  out = {}
  for name in names:
    if name not in every:
      raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    policy = every[name]
    if _check and not policy.available:
      policy.check(Grid(1, 1, 1), None)  # raises PolicyUnavailableError
    out[name] = policy
  return out
