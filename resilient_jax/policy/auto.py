"""`auto`: the policy expected to train the most until the next failure or repair.

It chooses among the other policies at every event, weighing the one-off cost of getting there
(copies, compiles, a restore and the work it rolls back) against the step time it reaches, over
the expected time until the next event: the trace's mean time between events in the simulator,
`resilience.mean_steps_between_failures` in the runtime. The runtime's coordinator and the
simulator call this one class, so `auto` decides the same in both.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

from resilient_jax.policy.base import (
  Grid,
  PlanCosts,
  Policy,
  PolicyUnavailableError,
  Recovery,
  RecoveryParams,
  Transition,
  plans_speeds,
  usable_policies,
)
from resilient_jax.policy.rejoin import steps_until_next_event
from resilient_jax.schedule.core import Worker

AUTO_TIE = 0.01
"""Step times (or steps trained) within 1% count as a tie."""


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
  chooses = True
  """The policy in force is one of its candidates (`current`), never itself."""
  reroutes = False
  reweights = False
  """Whether it re-weights is its choice's (`plans_speeds`)."""
  min_pp = 1

  def restore_on(self, grid: Grid, costs: PlanCosts, positions: Sequence[int]) -> None:
    """A restore onto the survivors is a fresh layout (whichever candidate is in force)."""
    return None

  def __init__(self, candidates: Mapping[str, Policy], params: RecoveryParams):
    if not candidates:
      raise ValueError("auto needs at least one candidate policy")
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

  def usable(self, grid: Grid, costs: PlanCosts) -> list[Policy]:
    """The candidates that can evaluate this grid with these costs."""
    key = (grid, costs)
    if key not in self._usable:
      self._usable[key] = list(usable_policies(self.candidates, grid, costs)[0].values())
    return self._usable[key]

  def check(self, grid: Grid, costs: PlanCosts) -> None:
    if not self.usable(grid, costs):
      raise PolicyUnavailableError("auto: no candidate policy can evaluate this grid")

  def choice(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> Policy:
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

  @property
  def current(self) -> Policy | None:
    """The candidate in force during a run (None before its first step time)."""
    return self._current

  def revert(self, policy: Policy | None) -> None:
    """Puts `policy` back in force: a rejoin `recovery` chose a move for was declined
    (`rejoin.rejoin_choice`), so the candidate that was running goes on."""
    self._current = policy

  def plans_speeds(self, grid: Grid) -> bool:
    """Whether the candidate in force re-plans for `grid.speeds` (its step time is auto's)."""
    return self._current is not None and plans_speeds(self._current, grid)

  def plan(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts):
    """The plan of the candidate in force (during a run) or of the fastest one."""
    policy = self._current if self._running and self._current else self.choice(grid, failed, costs)
    return policy.plan(grid, failed, costs)

  def step_time(self, grid: Grid, failed: frozenset[Worker], costs: PlanCosts) -> float:
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
      step = policy.step_time(t.grid, t.after, t.costs)
      steps = steps_until_next_event(self.horizon_s, rec, step, self.params.checkpoint_interval_s)
      # Ties (within AUTO_TIE) keep the policy in force, then the first listed.
      if best is None or steps > best_value * (1 + AUTO_TIE) or (
        policy is old and steps >= best_value * (1 - AUTO_TIE)
      ):
        best, best_value, best_rec = policy, steps, rec
    self._current = best
    return best_rec
