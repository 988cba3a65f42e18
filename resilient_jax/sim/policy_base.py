"""What every simulated policy shares: the grid it plans for, recovery costs, the `Policy`
protocol, and checkpoint-restart (the fallback of every other policy). `policies.py` registers
the policies, `external.py` adapts Oobleck's and Bamboo's planners; both build on this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable
from typing import Protocol, runtime_checkable

from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.generators import GENERATORS, generate
from resilient_jax.sim.cost_model import CostModel


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
  costs: CostModel
  step_time_before: float

  @property
  def failure(self) -> bool:
    """Whether a worker is lost (a failure, not only rejoins)."""
    return not self.after <= self.before


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

  def recovery(self, t: Transition) -> Recovery:
    """The one-off cost of the move `t` from one failure state to the next."""
    ...




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

  def recovery(self, t: Transition) -> Recovery:
    if t.before == t.after:
      return Recovery(0.0)
    if t.failure:
      return Recovery(self.params.detect_s + self.params.restart_s, rollback=True)
    if self.pipelines(t.grid, t.after) > self.pipelines(t.grid, t.before):
      return Recovery(self.params.restart_s, restart=True)
    return Recovery(0.0)
