"""`schedule.price.replay_program`: the replay every policy's plan is priced by."""

import pytest

from resilient_jax.schedule import adaptive
from resilient_jax.schedule.core import F, Op
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.plan import GridPlan, SlotProgram, StepProgram, step_program
from resilient_jax.schedule.price import replay_measured, replay_program
from resilient_jax.schedule.routing import FailureState

COSTS = OpCosts(f=1.0, b=1.5, w=0.5, ar=0.5, opt=0.2, comm=0.1)


def _grid_plan(schedule):
  pp = schedule.pp
  nodes = {(d, s): d * pp + s for d in range(schedule.dp) for s in range(pp)}
  return GridPlan(schedule, tuple((s, s + 1) for s in range(pp)), nodes)


@pytest.mark.parametrize("base", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("dp,pp,m,failed", [(1, 2, 2, ()), (2, 4, 8, ((1, 1),)),
                                            (3, 3, 5, ((0, 2), (2, 0)))])
def test_one_slot_per_node_is_the_schedule_replay(base, dp, pp, m, failed):
  schedule = generate(base, dp, pp, m)
  if failed:
    schedule = adaptive.plan("adaptive", FailureState(dp, pp, m, frozenset(failed)), COSTS,
                             base=base)
  expected = simulate(schedule, COSTS)
  got = replay_program(step_program(_grid_plan(schedule)), COSTS.duration, comm=COSTS.comm)
  assert got.makespan == expected.makespan
  assert sorted((s.worker, s.op, s.start, s.end) for s in got.spans) == sorted(
    (s.worker, s.op, s.start, s.end) for s in expected.spans)


def test_a_deadlock_and_a_missing_measurement_are_one_clear_error():
  # Two slots, each waiting for the other's forward: nothing can start.
  split = ((0, 1), (1, 2))
  slots = {(0, 0): SlotProgram(0, split, 0, (Op(F, 0),)),
           (0, 1): SlotProgram(1, split, 1, (Op(F, 1), Op(F, 0)))}
  sp = StepProgram("stuck", slots, ((((0, 0), (0, 1))), (((0, 0), (0, 1)))))
  with pytest.raises(ScheduleError, match="deadlock"):
    replay_program(sp, COSTS.duration)
  sp = step_program(_grid_plan(generate("1f1b", 1, 2, 2)))
  with pytest.raises(ScheduleError, match="no measured duration"):
    replay_measured(sp, {})
