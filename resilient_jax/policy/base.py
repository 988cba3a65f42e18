"""What every policy shares: the grid it plans for, what plans cost, recovery costs, and the
`Policy` protocol that the runtime's coordinator and the simulator both call.

A policy is asked about a `Grid` and a set of failed workers (positions `(d, s)` of that grid;
the runtime maps them to its nodes): what it runs then (`plan`, a `Planned`), how fast that is
(`step_time`: the cost model's price of that plan, or of a smaller one a test shows costs the
same), and what getting there costs once (`recovery`). Costs come through
`PlanCosts`: the simulator's `CostModel` (specs or a measured profile, seconds) and the runtime's
analytic model (`costs.AnalyticCosts`, block-forward units) both provide it, so one policy prices
plans for both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from resilient_jax.checks import require_ints, require_numbers
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import OpCosts
from resilient_jax.schedule.generators import GENERATORS
from resilient_jax.schedule.oobleck import LayerProfile, OobleckInstance
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import Plan
from resilient_jax.schedule.routing import check_speeds

Planned = Schedule | OobleckInstance | PipelineSet | tuple[int, int]
"""What a policy runs with some workers down, on its grid's positions (worker `(d, s)` at
`d * pp + s`): a re-routed `Schedule` (recycle, naive), an `OobleckInstance`, Bamboo's
`PipelineSet` (stage s as layer s), or the `(dp, pp)` grid a restore lays out (restart). The
coordinator turns it into the runtime's `Plan` with `runtime_plan` (layers and nodes named)."""


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
    global_batch: samples per step, when a re-layout must split it into equal micro-batches
      (the runtime's restore); None: any number of pipelines (the simulator deals them out).
    speeds: workers measured slower (or faster) than their stage's peers, `((worker, speed),
      ...)` sorted, speed 1 left out (`routing.check_speeds`): a policy that re-weights
      (`reweights`) plans for them; the others run their plan at the slow worker's pace.
    samples: samples in a micro-batch. Above 1 the re-routing policies may move pieces of
      micro-batches (`routing.split_route`) on grids they plan whole; 1 (the runtime's, until
      its interpreter runs pieces): whole micro-batches only.
  """

  dp: int
  pp: int
  m: int
  base: str = "zb-h1"
  memory_cap: int | None = None
  global_batch: int | None = None
  speeds: tuple[tuple[Worker, float], ...] = ()
  samples: int = 1

  def __post_init__(self):
    require_ints("Grid.", {"dp": self.dp, "pp": self.pp, "m": self.m, "samples": self.samples})
    if self.base not in GENERATORS:
      raise ValueError(f"Grid.base={self.base!r} is not one of {sorted(GENERATORS)}")
    object.__setattr__(self, "speeds", check_speeds(self.dp, self.pp, self.speeds))

  def with_speeds(self, speeds: Iterable[tuple[Worker, float]] | Mapping[Worker, float],
                  failed: Iterable[Worker] = ()) -> Grid:
    """This grid with `speeds` (those of `failed` workers left out)."""
    if not speeds and not self.speeds:
      return self  # the common case, on the simulator's path: no new grid
    dead = set(failed)
    pairs = speeds.items() if isinstance(speeds, Mapping) else speeds
    return dataclasses.replace(self, speeds=tuple((w, v) for w, v in pairs if w not in dead))

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


class PlanCosts(Protocol):
  """What a policy prices plans with (hashable: plans are cached by it).

  Attributes:
    comm: seconds (or units) of one activation transfer between stages.
  """

  comm: float

  def op_costs(self, live: Sequence[int]) -> OpCosts:
    """The planners' op costs with `live[s]` workers left in stage s."""
    ...

  def layer_profile(self) -> LayerProfile:
    """Per-layer costs for Oobleck's templates.

    Raises:
      PolicyUnavailableError: when these costs have no per-layer form.
    """
    ...

  @property
  def node_memory(self) -> float | None:
    """Bytes of one worker's memory; None: templates are not limited by memory."""
    ...

  @property
  def allreduce_bandwidth(self) -> float | None:
    """Bytes/s of a worker's data-parallel all-reduce; None: the all-reduce is free."""
    ...


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
    require_numbers("recovery.", {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
    require_numbers("recovery.", {"checkpoint_interval_s": self.checkpoint_interval_s},
                    positive=True)


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


@dataclasses.dataclass(frozen=True)
class Transition:
  """A move from failure state `before` to `after` on `grid`, priced with `costs`.

  Attributes:
    step_time_before: the step time in force when it happens (a failure in the middle of a
      step loses, on average, half of it).
  """

  grid: Grid
  before: frozenset[Worker]
  after: frozenset[Worker]
  costs: PlanCosts
  step_time_before: float

  @property
  def failure(self) -> bool:
    """Whether a worker is lost (a failure, not only rejoins)."""
    return not self.after <= self.before

  def in_flight_lost(self) -> float:
    """The step in flight when a worker died is redone: on average half of it is lost."""
    return self.step_time_before / 2 if math.isfinite(self.step_time_before) else 0.0


@runtime_checkable
class Policy(Protocol):
  """Everything the runtime's coordinator and the simulator call on a resilience policy (neither
  probes for other members). `InPlacePolicy` gives the defaults of a policy that goes on in place;
  a user's policy subclasses it (or implements all of this) and is registered by name
  (`registry.register_policy`).

  Attributes:
    name, description: for configs, logs and reports.
    params: the recovery times it prices moves with.
    chooses: it chooses among other policies (`auto`): the one in force is `current`.
    reroutes: a stage with no live worker ends it (the run restores instead).
    reweights: it plans for `Grid.speeds` (moves work off stragglers).
    min_pp: the fewest stages a layout restored for it may have.
  """

  name: str
  description: str
  params: RecoveryParams
  chooses: bool
  reroutes: bool
  reweights: bool
  min_pp: int

  # -- the simulator and the runtime

  def check(self, grid: Grid, costs: PlanCosts) -> None:
    """Raises `PolicyUnavailableError` (with the reason) if it cannot evaluate this grid."""
    ...

  def plan(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> Planned | None:
    """What it runs with `failed` workers down; None where it cannot go on and falls back to
    a restore."""
    ...

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
    """Steady-state seconds per step with `failed` workers down, the replay of what `plan`
    returns; `inf` if it cannot train."""
    ...

  def recovery(self, t: Transition) -> Recovery:
    """The one-off cost of the move `t` from one failure state to the next."""
    ...

  def plans_speeds(self, grid: Grid) -> bool:
    """Whether `plan` and `step_time` account for `grid.speeds` (else the step runs at its
    slowest worker's pace, which the simulator then charges)."""
    ...

  def reset(self, horizon_s: float) -> None:
    """A run through a trace starts, its events `horizon_s` apart on average."""
    ...

  @property
  def current(self) -> Policy | None:
    """The policy in force: itself, or a chooser's choice (None before its first)."""
    ...

  def revert(self, policy: Policy | None) -> None:
    """A chooser puts `policy` back in force (a rejoin it priced was declined)."""
    ...

  def restore_on(self, grid: Grid, costs: PlanCosts, positions: Sequence[int]) -> Planned | None:
    """What it runs when the run restores onto the live `positions` of its grid, keeping the
    grid; None: a fresh layout of the survivors instead."""
    ...



@runtime_checkable
class RuntimePolicy(Policy, Protocol):
  """What the runtime's coordinator also calls on the policy in force (`Policy.current`; a
  chooser such as `auto` is never in force itself)."""

  def runs(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
           previous: Planned | None, *, switched: bool) -> Planned | None:
    """What it runs with `failed` down; None: it cannot go on."""
    ...

  def planned_step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
                        planned: Planned) -> float:
    """The cost model's step time of `planned`, what `runs` returned."""
    ...

  def runtime_plan(self, planned: Planned, layout: Layout, costs: PlanCosts) -> Plan:
    """`planned` as the runtime runs it (`Layout.nodes` maps the grid's positions)."""
    ...

  def report(self, planned: Planned, plan: Plan, layout: Layout, workers: frozenset[Worker],
             failed: frozenset[Worker], *, rejoin: bool = False) -> list[str]:
    """Log lines of what it did about `workers`, lost (or back, `rejoin`)."""
    ...

  def why_not(self, failed: frozenset[Worker], nodes: Sequence[int], step: int,
              configured: str) -> str:
    """Why it cannot go on after `nodes` failed at `step`."""
    ...


@dataclasses.dataclass(frozen=True)
class Layout:
  """What turns a policy's plan into the runtime's (`Policy.runtime_plan`) and names its
  workers in log lines: the layer split of the grid's stages, the model's layer count, and the
  node at each grid position (worker `(d, s)` at `nodes[d * pp + s]`)."""

  grid: Grid
  partition: tuple[tuple[int, int], ...]
  num_layers: int
  nodes: Sequence[int]
  node_of: Mapping[Worker, int]
  """Worker `(d, s)` -> its node."""
  live: frozenset[int]
  """The run's live nodes (some may be outside the grid)."""


def plans_speeds(policy: Policy, grid: Grid) -> bool:
  """Whether `policy`'s plan and step time for `grid` account for its `speeds` (only the
  re-routing policies re-weight stragglers; any other runs at the slow worker's pace)."""
  return policy.plans_speeds(grid)


def stage_lost(grid: Grid, failed: frozenset[Worker]) -> bool:
  """Whether some stage has no live worker left (no re-routing can go on)."""
  return min(grid.live_per_stage(failed)) == 0


class InPlacePolicy:
  """A policy that goes on in place after a failure while it can (re-routing, re-templating,
  failing over), and runs as checkpoint-restart (`restart`) while it cannot.

  Subclasses say when they cannot (`cannot_run`) and what a move costs beyond the regroup
  (`copy_seconds`); the recovery rule is this one:

  * entering a state it cannot run: detection, a restart, and the work since the checkpoint;
  * leaving one: a planned restart (checkpoint first: nothing lost);
  * otherwise a failure costs detection, a regroup, the copies and half the step in flight, a
    rejoin a regroup and the copies.
  """

  chooses = False
  """Whether it chooses among other policies (`auto`): the policy in force is then its choice."""
  reroutes = False
  """Whether a stage with no live worker ends it (re-routing): the run restores instead."""
  reweights = False
  """Whether it plans for `Grid.speeds` (moves work off stragglers); the others ignore them."""
  min_pp = 1
  """The fewest stages a layout restored for it may have."""

  def __init__(self, params: RecoveryParams, restart: Policy):
    self.params = params
    self.restart = restart

  def plans_speeds(self, grid: Grid) -> bool:
    """Whether its plan and step time for `grid` account for `grid.speeds` (else the step runs
    at its slowest worker's pace, which the simulator then charges)."""
    return self.reweights and bool(grid.speeds)

  def reset(self, horizon_s: float) -> None:
    """It chooses nothing by the time until the next event."""
    del horizon_s

  @property
  def current(self) -> Policy:
    return self

  def revert(self, policy: Policy | None) -> None:
    del policy

  # -- the runtime's coordinator asks these; the simulator needs none of them

  def runs(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
           previous: Planned | None, *, switched: bool) -> Planned | None:
    """What it runs with `failed` down (its own terms, as `plan`); `previous`: what it ran
    before, unless it was not in force (`switched`). None: it cannot go on."""
    del previous, switched
    return self.plan(grid, failed, costs)

  def planned_step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts,
                        planned: Planned) -> float:
    """The cost model's step time of `planned`, what `runs` returned."""
    del planned
    return self.step_time(grid, failed, costs)

  def runtime_plan(self, planned: Planned, layout: Layout, costs: PlanCosts) -> Plan:
    """`planned` as the runtime runs it, on the grid's positions (`Layout.nodes` maps them)."""
    raise NotImplementedError

  def report(self, planned: Planned, plan: Plan, layout: Layout, workers: frozenset[Worker],
             failed: frozenset[Worker], *, rejoin: bool = False) -> list[str]:
    """Log lines of what it did about `workers`, lost (or back, `rejoin`), with `failed` down,
    running `plan` (on nodes)."""
    raise NotImplementedError

  def why_not(self, failed: frozenset[Worker], nodes: Sequence[int], step: int,
              configured: str) -> str:
    """Why it cannot go on after `nodes` failed at `step` (`configured`: `resilience.policy`)."""
    return (f"{self.name} cannot continue after nodes {list(nodes)} failed at step {step}: "
            "some layers lost every replica")

  def restore_on(self, grid: Grid, costs: PlanCosts, positions: Sequence[int]) -> Planned | None:
    """What it runs when the run restores onto the live `positions` of its grid, keeping the
    grid; None: a fresh layout of the survivors instead (`restart.restore_layout`)."""
    del grid, costs, positions
    return None

  def cannot_run(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> bool:
    """Whether the policy cannot train with `failed` down (it then runs as restart)."""
    raise NotImplementedError

  def copy_seconds(self, t: Transition) -> float:
    """Seconds of state moved by the move `t` (none unless the policy moves layers)."""
    del t
    return 0.0

  def recovery(self, t: Transition) -> Recovery:
    if t.before == t.after:
      return Recovery(0.0)
    p = self.params
    lost_before = self.cannot_run(t.grid, t.before, t.costs)
    lost_after = self.cannot_run(t.grid, t.after, t.costs)
    if lost_before and lost_after:
      return self.restart.recovery(t)
    if lost_after:
      return Recovery(p.detect_s + p.restart_s, rollback=True)
    if lost_before:
      return Recovery(p.restart_s, restart=True)
    extra = self.copy_seconds(t)
    if t.failure:
      return Recovery(p.detect_s + p.regroup_s + extra + t.in_flight_lost())
    return Recovery(p.regroup_s + extra)


def usable_policies(
  policies: Mapping[str, Policy], grid: Grid, costs: PlanCosts
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
