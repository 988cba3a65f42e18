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

import dataclasses
import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from resilient_jax.schedule import adaptive
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.generators import GENERATORS, generate
from resilient_jax.sim.cost_model import CostModel
from resilient_jax.sim.reduce import failure_pattern, reduce_pattern

__all__ = [
  "POLICY_NAMES",
  "Grid",
  "Policy",
  "PolicyUnavailableError",
  "Recovery",
  "RecoveryParams",
  "build_policies",
  "policy_status",
  "usable_policies",
]

POLICY_NAMES = ("recycle", "naive", "oobleck", "bamboo", "restart", "auto")

# Grids with at most this many compute ops (3 * D * p * m) are planned whole, not reduced:
# planning 12k ops takes well under a second.
DEFAULT_EXACT_OPS = 12_000
AUTO_TIE = 0.01


class PolicyUnavailableError(RuntimeError):
  """A registered policy cannot be evaluated: its planner is missing from this checkout, or it
  cannot handle this grid or cost model (the message says which)."""


@dataclasses.dataclass(frozen=True)
class Grid:
  """The DP x PP grid a policy plans for.

  Attributes:
    dp: data-parallel pipelines (D), failed ones included.
    pp: pipeline stages (p).
    m: micro-batches per pipeline per step.
    base: fault-free base schedule ("gpipe", "1f1b" or "zb-h1"), as the coordinator uses it.
    memory_cap: in-flight cap for the adaptive planner; None: its default.
  """

  dp: int
  pp: int
  m: int
  base: str = "zb-h1"
  memory_cap: int | None = None

  def __post_init__(self):
    for key in ("dp", "pp", "m"):
      v = getattr(self, key)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Grid.{key} must be a positive integer, got {v!r}")
    if self.base not in GENERATORS:
      raise ValueError(f"Grid.base={self.base!r} is not one of {sorted(GENERATORS)}")

  @property
  def workers(self) -> int:
    return self.dp * self.pp

  @property
  def compute_ops(self) -> int:
    return 3 * self.dp * self.pp * self.m

  def live_per_stage(self, failed: Iterable[Worker]) -> tuple[int, ...]:
    live = [self.dp] * self.pp
    for _, s in failed:
      live[s] -= 1
    return tuple(live)


@dataclasses.dataclass(frozen=True)
class RecoveryParams:
  """Seconds that recovery steps take.

  Attributes:
    detect_s: from a failure to the coordinator knowing. The runtime proves a crashed process
      dead at once (its ports refuse connections); a host that goes silent is declared dead
      only after the heartbeat timeout, which this default models.
    regroup_s: replanning and rebuilding the all-reduce groups over the survivors.
    restart_s: a whole-job restart: rescheduling, start-up, checkpoint restore.
    checkpoint_interval_s: wall time between checkpoints (what a rollback can lose).
  """

  detect_s: float = 30.0
  regroup_s: float = 10.0
  restart_s: float = 600.0
  checkpoint_interval_s: float = 1800.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      v = getattr(self, field.name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"recovery.{field.name} must be a non-negative number, got {v!r}")
    if self.checkpoint_interval_s <= 0:
      raise ValueError("recovery.checkpoint_interval_s must be positive")


@dataclasses.dataclass(frozen=True)
class Recovery:
  """The one-off cost of entering a failure state.

  Attributes:
    pause_s: seconds without training progress.
    rollback: whether the progress since the last checkpoint is lost (the job restarts).
    restart: whether the job restarts from a checkpoint saved at the event (a planned restart:
      nothing is lost, and the checkpoint clock starts again when it resumes).
  """

  pause_s: float
  rollback: bool = False
  restart: bool = False


@runtime_checkable
class Policy(Protocol):
  """What the simulator needs from a resilience policy."""

  name: str
  available: bool
  description: str

  def check(self, grid: Grid, costs: CostModel) -> None:
    """Raises `PolicyUnavailableError` (with the reason) if it cannot evaluate this grid."""
    ...

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    """Steady-state seconds per step with `failed` workers down; `inf` if it cannot train."""
    ...

  def recovery(
    self,
    grid: Grid,
    before: frozenset[Worker],
    after: frozenset[Worker],
    costs: CostModel,
    step_time_before: float,
  ) -> Recovery:
    """The one-off cost of going from failure state `before` to `after`."""
    ...


def is_failure(before: frozenset[Worker], after: frozenset[Worker]) -> bool:
  """Whether going from `before` to `after` loses a worker (a failure, not only rejoins)."""
  return not after <= before


def _stage_lost(grid: Grid, failed: frozenset[Worker]) -> bool:
  return min(grid.live_per_stage(failed)) == 0


class RestartPolicy:
  """Checkpoint-restart onto the largest grid the survivors form (see the module docstring)."""

  name = "restart"
  available = True
  description = "checkpoint-restart on the largest D'' x p grid of survivors"

  def __init__(self, params: RecoveryParams):
    self.params = params
    self._cache: dict[Hashable, float] = {}

  def check(self, grid: Grid, costs: CostModel) -> None:
    del grid, costs  # any grid

  def pipelines(self, grid: Grid, failed: frozenset[Worker]) -> int:
    """Pipelines `D''` the survivors form after a restart."""
    return (grid.workers - len(failed)) // grid.pp

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    dp = self.pipelines(grid, failed)
    key = (grid, dp, costs)
    if key not in self._cache:
      if dp == 0:
        self._cache[key] = math.inf
      else:
        # Pipelines of a fault-free grid are independent and identical, and every stage's
        # all-reduce is one collective: one pipeline with the all-reduce of D'' gives the makespan
        # of the whole grid. The busiest pipelines carry ceil(D*m / D'') micro-batches.
        m = -(-grid.dp * grid.m // dp)
        op = costs.op_costs((dp,) * grid.pp)
        self._cache[key] = simulate(generate(grid.base, 1, grid.pp, m), op).makespan
    return self._cache[key]

  def recovery(
    self,
    grid: Grid,
    before: frozenset[Worker],
    after: frozenset[Worker],
    costs: CostModel,
    step_time_before: float,
  ) -> Recovery:
    del costs, step_time_before
    if before == after:
      return Recovery(0.0)
    if is_failure(before, after):
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    if self.pipelines(grid, after) > self.pipelines(grid, before):
      return Recovery(self.params.restart_s, restart=True)
    return Recovery(0.0)


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

  def recovery(
    self,
    grid: Grid,
    before: frozenset[Worker],
    after: frozenset[Worker],
    costs: CostModel,
    step_time_before: float,
  ) -> Recovery:
    if before == after:
      return Recovery(0.0)
    lost_before, lost_after = _stage_lost(grid, before), _stage_lost(grid, after)
    if lost_after or lost_before:
      if not lost_after:
        # The stage is back: a planned restart onto the full grid re-routing can run on again.
        return Recovery(self.params.restart_s, restart=True)
      if not lost_before:
        return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
      return self.restart.recovery(grid, before, after, costs, step_time_before)
    if is_failure(before, after):
      # The step in flight when the worker died is redone: on average half of it is lost.
      lost = step_time_before / 2 if math.isfinite(step_time_before) else 0.0
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

  def recovery(
    self,
    grid: Grid,
    before: frozenset[Worker],
    after: frozenset[Worker],
    costs: CostModel,
    step_time_before: float,
  ) -> Recovery:
    self._fail()
    raise AssertionError("unreachable")


class AutoPolicy:
  """Per failure state, the fastest of `candidates` by the cost model.

  Step times within `AUTO_TIE` (1%) of the fastest count as a tie, which the candidate listed
  first wins (the re-routing policies come before `restart`).

  Candidates that cannot evaluate the grid (`check` fails, e.g. Oobleck past its size limit)
  are left out. Switching between two in-place policies costs what the new one's recovery
  costs; switching to or from `restart` is a re-layout of the job, so it costs a restart (with a
  rollback when a failure forced it).
  """

  name = "auto"
  available = True

  def __init__(self, candidates: Mapping[str, Policy], params: RecoveryParams):
    if not candidates:
      raise ValueError("auto needs at least one available policy")
    self.candidates = dict(candidates)
    self.params = params
    self.description = "per failure state the fastest of " + ", ".join(self.candidates)
    self._usable: dict[Hashable, list[Policy]] = {}

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
      # policies before restart): switching layout costs a restart of minutes, which a step a
      # few microseconds shorter (e.g. one fewer all-reduce peer) never pays back.
      if best is None or t < best_t * (1 - AUTO_TIE):
        best, best_t = policy, t
    if best is None:
      self.check(grid, costs)
    return best

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: CostModel) -> float:
    return self.choice(grid, failed, costs).step_time(grid, failed, costs)

  def recovery(
    self,
    grid: Grid,
    before: frozenset[Worker],
    after: frozenset[Worker],
    costs: CostModel,
    step_time_before: float,
  ) -> Recovery:
    old, new = self.choice(grid, before, costs), self.choice(grid, after, costs)
    if old is new or "restart" not in (old.name, new.name):
      return new.recovery(grid, before, after, costs, step_time_before)
    if is_failure(before, after):
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    return Recovery(self.params.restart_s, restart=True)


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
