"""Whether a policy takes a rejoined worker back: the one rule the runtime's coordinator and the
simulator both apply.

A rejoin is a `Transition` whose `after` is a subset of `before` (`Transition.failure` is
False). Each policy prices it with its own `recovery`:

* the in-place policies (recycle, naive, oobleck, bamboo) take the worker back in place: a
  regroup and the state copies (`InPlacePolicy.recovery`), always taken - the step gets faster
  (or stays the same) for a pause of one regroup;
* a rejoin that grows the layout through a planned restart (`restart`, or an in-place policy
  running as restart after it lost a stage, or `auto` switching to or from restart) pauses for a
  restart: it is taken only if it trains more until the next event than waiting does, the
  horizon being the expected time to the next event (`auto`'s cost model: steps trained =
  (horizon - pause) / step time). Declined, the worker stays idle (live, in no plan) until a
  later event re-lays the job out;
* `auto` re-decides among its candidates (`AutoPolicy.recovery`) and the same pay-back rule
  applies to what it chose; a declined choice puts the candidate in force back.
"""

from __future__ import annotations

import dataclasses
import math

from resilient_jax.policy.base import Policy, Recovery, Transition

WAIT_TIE = 0.01
"""A planned restart must train more than 1% more steps until the next event than waiting."""


@dataclasses.dataclass(frozen=True)
class RejoinChoice:
  """What a policy does about a rejoin.

  Attributes:
    take: the rejoined workers go back into the plan (False: they stay idle).
    recovery: the one-off cost of the move (`Recovery(0)` when not taken).
    step_time_after: the steady-state step time once taken.
    step_time_waiting: the step time in force (kept when not taken).
  """

  take: bool
  recovery: Recovery
  step_time_after: float
  step_time_waiting: float

  def describe(self) -> str:
    """One line for the log: the step times weighed and the outcome."""
    ratio = (self.step_time_after / self.step_time_waiting
             if math.isfinite(self.step_time_waiting) and self.step_time_waiting else 0.0)
    how = "with a planned restart" if self.recovery.restart else "in place"
    if self.take:
      return f"taken back {how}: predicted step time x{ratio:.2f}"
    return (f"not taken back: the planned restart it needs (pause {self.recovery.pause_s:.1f}) "
            f"would not pay back its step time x{ratio:.2f} before the next expected failure")


def steps_until_next_event(horizon_s: float, rec: Recovery, step_time: float,
                           checkpoint_interval_s: float) -> float:
  """Steps trained in `horizon_s` after paying `rec` at `step_time` (a rollback also loses half
  a checkpoint interval on average). The measure `auto` and the rejoin rule both maximise."""
  if not math.isfinite(step_time) or step_time <= 0:
    return 0.0
  lost = checkpoint_interval_s / 2 if rec.rollback else 0.0
  return max(horizon_s - rec.pause_s - lost, 0.0) / step_time


def rejoin_choice(policy: Policy, t: Transition, horizon_s: float) -> RejoinChoice:
  """Whether `policy` takes back the workers in `t.before - t.after`, and at what cost.

  Args:
    policy: the policy in force (for `auto`, the `AutoPolicy` itself: it re-decides).
    t: the rejoin (`t.after <= t.before`; `t.step_time_before` is the step time in force).
    horizon_s: the expected time until the next event, in the costs' units.

  Raises:
    ValueError: `t` loses a worker (a failure goes through `Policy.recovery` alone).
  """
  if t.failure:
    raise ValueError("rejoin_choice prices rejoins; this transition loses a worker")
  previous = policy.current
  rec = policy.recovery(t)
  after = policy.step_time(t.grid, t.after, t.costs)
  waiting = t.step_time_before
  take = True
  if rec.restart:
    interval = policy.params.checkpoint_interval_s
    grow = steps_until_next_event(horizon_s, rec, after, interval)
    wait = steps_until_next_event(horizon_s, Recovery(0.0), waiting, interval)
    take = grow > wait * (1 + WAIT_TIE)
  if not take:
    policy.revert(previous)
    return RejoinChoice(False, Recovery(0.0), after, waiting)
  return RejoinChoice(True, rec, after, waiting)
