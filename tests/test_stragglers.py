"""Stragglers: the planners re-weight a slow worker's share (`schedule/routing.py`,
`schedule/adaptive.py`), and a run with an injected slowdown finds it, re-weights it and gives
its share back when it recovers, with the fault-free losses (`training/stragglers.py`)."""

import json

import pytest

from resilient_jax.config import ConfigError
from resilient_jax.observe.events import Speeds
from resilient_jax.policy.base import Grid, plans_speeds
from resilient_jax.policy.costs import AnalyticCosts
from resilient_jax.policy.registry import build_policies
from resilient_jax.schedule import adaptive
from resilient_jax.schedule.adaptive import plan_timed
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.routing import (
  FailureState,
  capacity_bound,
  proportional_loads,
  speed_scaled,
)
from resilient_jax.schedule.validate import validate
from resilient_jax.training.api import train
from resilient_jax.training.stragglers import StragglerWatch, peer_ratios
from tests.helpers import assert_matches_reference, tiny_config

COSTS = OpCosts(f=1.0, b=1.0, w=1.0, ar=0.5, opt=0.2)


def _loads(schedule, pp):
  return {(d, s): len(schedule.microbatches_of((d, s))) for d in range(schedule.dp)
          for s in range(pp)}


@pytest.mark.parametrize("policy", ["adaptive", "naive"])
def test_a_slow_worker_keeps_its_share_in_proportion_and_every_microbatch_runs_once(policy):
  """4x4, m=8, worker (1, 2) at half speed: it keeps about half its 8 micro-batches (0.5 of
  the stage's 32 over 3.5 speeds: 4.6), its stage peers take the rest, the other stages keep
  their own; the plan is valid (every stage of every micro-batch once, no deadlock)."""
  state = FailureState(4, 4, 8, speeds={(1, 2): 0.5})
  schedule, _ = plan_timed(policy, state, COSTS)
  validate(schedule)
  loads = _loads(schedule, 4)
  # The proportional share (naive); the adaptive planner also times the slow worker giving up
  # one more, which here lets its peers absorb it in bubbles (next test).
  keeps, peers = (5, [9, 9, 9]) if policy == "naive" else (4, [9, 9, 10])
  assert loads[(1, 2)] == keeps and sorted(loads[(d, 2)] for d in (0, 2, 3)) == peers
  assert all(n == 8 for (d, s), n in loads.items() if s != 2)
  assert sum(loads[(d, 2)] for d in range(4)) == 32


def test_the_adaptive_planner_keeps_the_faster_of_the_shares_it_tries(monkeypatch):
  """Worker (1, 2) at half speed, m=8: the proportional share (5 of 8) leaves it the step's
  longest list; giving up one more is faster, and the planner keeps that."""
  state = FailureState(4, 4, 8, speeds={(1, 2): 0.5})
  slow = speed_scaled(COSTS, state.speeds)
  chosen, makespan = plan_timed("adaptive", state, COSTS)
  monkeypatch.setattr(adaptive, "_SHEDS", (0,))
  proportional, proportional_makespan = plan_timed("adaptive", state, COSTS)
  assert len(proportional.microbatches_of((1, 2))) == 5
  assert simulate(chosen, slow).makespan == pytest.approx(makespan)
  assert makespan < proportional_makespan - 0.5


def test_re_weighting_reaches_the_stage_capacity_bound_where_waiting_does_not():
  """The same grid replayed at the worker's speed: the fault-free plan runs at the slow
  worker's pace (0.54 of fault-free), the re-weighted one at >= 0.9 of the stage's capacity
  (sum of speeds / D = 0.875)."""
  speeds = (((1, 2), 0.5),)
  slow = speed_scaled(COSTS, speeds)
  fault_free = simulate(generate("zb-h1", 4, 4, 8), COSTS).makespan
  waiting = simulate(generate("zb-h1", 4, 4, 8), slow).makespan
  planned, makespan = plan_timed("adaptive", FailureState(4, 4, 8, speeds=speeds), COSTS)
  assert simulate(planned, slow).makespan == pytest.approx(makespan)
  grid_bound, stage_bound = capacity_bound(4, 4, speeds)
  assert (grid_bound, stage_bound) == (15.5 / 16, 3.5 / 4)
  assert fault_free / waiting < 0.6
  assert fault_free / makespan >= 0.9 * stage_bound


def test_loads_are_proportional_and_a_recovered_or_failed_grid_plans_as_without_speeds():
  assert proportional_loads([1, 1, 1, 0.5], 32) == [9, 9, 9, 5]
  assert proportional_loads([1, 0, 1], 6) == [3, 0, 3]
  assert proportional_loads([1, 0.05], 8) == [7, 1]  # 7.6 and 0.4: it still keeps one
  # A worker at full speed again: the fault-free schedule, whatever the policy.
  assert plan_timed("adaptive", FailureState(2, 2, 4, speeds={(1, 0): 1.0}), COSTS)[0] == \
    generate("zb-h1", 2, 2, 4)
  # A failure and a straggler in one stage: the survivors share by speed, the dead gets none.
  both, _ = plan_timed("adaptive", FailureState(3, 2, 4, {(0, 0)}, {(1, 0): 0.5}), COSTS)
  validate(both)
  assert [len(both.microbatches_of((d, 0))) for d in (1, 2)] == [4, 8]
  with pytest.raises(ValueError, match="both failed and given a speed"):
    FailureState(2, 2, 4, {(0, 0)}, {(0, 0): 0.5})


def test_recycle_prices_the_re_weighted_plan_and_restart_does_not_re_weight():
  """The policy layer (runtime and simulator alike): recycle's step time on a grid with a slow
  worker is its re-weighted plan's, below the fault-free plan run at that worker's pace."""
  grid = Grid(2, 2, 4, "zb-h1")
  costs = AnalyticCosts(OpCosts(f=1.0, b=1.0, w=1.0), None)
  policies = build_policies()
  slow = grid.with_speeds({(1, 0): 0.25})
  recycle = policies["recycle"]
  assert plans_speeds(recycle, slow) and not plans_speeds(policies["restart"], slow)
  op = costs.op_costs((2, 2))
  waiting = simulate(generate("zb-h1", 2, 2, 4), speed_scaled(op, slow.speeds)).makespan
  assert recycle.step_time(slow, frozenset(), costs) < waiting
  assert recycle.step_time(grid, frozenset(), costs) == simulate(generate("zb-h1", 2, 2, 4),
                                                                 op).makespan


def test_the_watch_needs_steps_in_a_row_and_gives_the_share_back():
  # Each against its peers' median (itself left out), later ops against later ops, a worker
  # that ran one op by its first against theirs (a first W allocates the accumulator); a stage
  # of one has no ratio.
  times = {(0, 0): {"W": (2.0, 1.0)}, (1, 0): {"W": (6.0, None)}, (2, 0): {"W": (2.0, 1.0)},
           (0, 1): {"B": (1.0, 1.0)}}
  assert peer_ratios(times) == {(0, 0): 1.0, (1, 0): 3.0, (2, 0): 1.0}
  watch = StragglerWatch(threshold=1.5, steps=3)
  watch.observe({(1, 0): 3.0, (0, 0): 1.0})
  watch.observe({(1, 0): 5.0, (0, 0): 1.0})
  assert watch.speeds({}) == {}  # two slow steps of three are not a straggler yet
  watch.observe({(1, 0): 4.0, (0, 0): 1.2})
  assert watch.speeds({}) == {(1, 0): 0.25}  # the median ratio of its window, 4
  for r in (8.4, 9.6, 9.0):
    watch.observe({(1, 0): r})
  assert watch.speeds({(1, 0): 0.25}) == {(1, 0): 0.25}  # in force until it recovers
  for r in (1.1, 4.5, 1.0):  # one noisy step: the window's median still says recovered
    watch.observe({(1, 0): r})
  assert watch.speeds({(1, 0): 0.25}) == {}


@pytest.mark.parametrize("spec", ["3:1.0", "3:1.0:0.5", "3:1.9:2", "99:1.0:2"])
def test_a_bad_slowdown_is_one_line(spec):
  with pytest.raises(ConfigError, match="faults.slow entry"):
    tiny_config(faults__slow=spec)


def test_a_run_finds_the_straggler_re_weights_it_and_gives_its_share_back(tmp_path):
  """2x2, m=4, 9 steps: worker (1, 0)'s ops take 6x as long from step 2 until step 6. Measured
  after steps 2, 3 and 4 (step 1 compiles), it is re-weighted from step 5 (it keeps 1 of its 4
  micro-batches); at full speed again after steps 6, 7 and 8 (step 5 is a new plan's first),
  it gets its share back from step 9 (or, one noisy step later, after the run's last).
  Samples and losses are the fault-free single-device run's. (Only its own lines and events
  are asserted: op times on shared cores may read another worker slow for a step.)"""
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=9, faults__slow="2:1.0:6,6:1.0:1",
                    resilience__straggler_every=1, resilience__straggler_steps=3,
                    resilience__straggler_threshold=2.0)
  lines = []
  result = train(cfg, tmp_path, log=lines.append)
  found = [e for e in result.events if isinstance(e, Speeds) and (
    (1, 0) in {(d, s) for d, s, _ in e.speeds} | set(e.recovered))]
  assert len(found) == 2, (found, [(r["step"], r.get("straggler_ratios"), r["compile_s"])
                                   for r in result.metrics])
  assert found[0].step == 5 and (1, 0) not in found[0].recovered
  back = found[1].step
  assert back in (9, 10) and (1, 0) in found[1].recovered, found[1]
  base = cfg.pipeline.schedule
  assert [r["schedule"] for r in result.metrics][:8] == [base] * 4 + ["adaptive"] * 4
  events = json.loads((tmp_path / "goodput.json").read_text())["events"]
  assert [(e["kind"], e["step"], e["speed"] == 1, e["microbatches"] == 1) for e in events
          if e["worker"] == [1, 0]] == [("straggler", 5, False, True),
                                        ("straggler_recovered", back, True, False)]
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_the_simulator_runs_the_same_re_weighting():
  """A 4x4 trace in which device 2 of node 1 (worker (1, 2)) runs at half speed for an hour:
  recycle trains that hour at its re-weighted plan's step time (the same planner call as the
  runtime's), restart at the fault-free plan's stretched to the slow worker's pace."""
  from resilient_jax.sim import CostModel, run_trace
  from resilient_jax.sim.layout import Layout
  from resilient_jax.sim.traces import Event, Trace

  lay = Layout(dp=4, pp=4, microbatches=8, devices_per_node=4)  # node d = pipeline d
  costs = CostModel.from_profile({"f": [1.0] * 4, "b": [1.0] * 4, "w": [0.8] * 4, "ar": 0.5,
                                  "opt": 0.2, "comm": 0.0})
  trace = Trace(7200.0, (Event(1800.0, "slow", 1, 2, "", 0.5),
                         Event(5400.0, "slow_end", 1, 2, "", 0.5)), lay.nodes, 4)
  policies = build_policies(["recycle", "restart"])
  result = run_trace(lay, costs, policies, trace, checkpoint_interval_s=1e9)
  grid = Grid(4, 4, 8)
  fault_free = policies["recycle"].step_time(grid, frozenset(), costs)
  reweighted = policies["recycle"].step_time(grid.with_speeds({(1, 2): 0.5}), frozenset(), costs)
  factors = {name: [seg[5] for seg in run.segments] for name, run in result.policies.items()}
  assert factors["recycle"] == [1.0, pytest.approx(reweighted / fault_free), 1.0]
  assert factors["restart"][0] == factors["restart"][2] == 1.0
  assert factors["restart"][1] > factors["recycle"][1] > 1.0
  losses = {name: run.breakdown.losses["stragglers"] for name, run in result.policies.items()}
  assert 0 < losses["recycle"] < losses["restart"]
