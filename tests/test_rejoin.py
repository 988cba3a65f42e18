"""Rejoins: a failed worker comes back and every policy takes the capacity back.

Pure policy-layer checks first (microseconds to a second), then in-process runs on the 2 x 4
grid (worker (1, 1) fails at the start of step 3 and comes back at step 6) whose every step's
samples and loss, and final parameters, must equal the fault-free run's.
"""

import json
import math

import pytest

from resilient_jax.config import ConfigError, parse_faults
from resilient_jax.observe.events import Decided, Rejoined
from resilient_jax.policy import (
  Grid,
  Recovery,
  RecoveryParams,
  RunCoordinator,
  Transition,
  build_policies,
  rejoin_choice,
)
from resilient_jax.schedule.core import F, Op
from resilient_jax.sim import engine
from resilient_jax.sim.cost_model import CostModel
from resilient_jax.sim.layout import Layout
from resilient_jax.sim.traces import Event, Trace
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.loop import Trainer
from tests.helpers import (
  assert_matches_reference,
  expected_digests,
  loaded_checkpoints,
  tiny_config,
)
from tests.test_tensorboard import texts

FAULTS = "3:1.1,6:+1.1"
PROFILE = {"f": [1.0] * 4, "b": [1.1] * 4, "w": [0.9] * 4, "ar": 0.3, "opt": 0.05, "comm": 0.02}
NODE = 5  # worker (1, 1) of the 2 x 4 grid


def _coordinator(policy, **overrides):
  lines = []
  cfg = tiny_config(mesh__dp=2, mesh__pp=4, resilience__policy=policy, **overrides)
  return RunCoordinator(cfg, range(8), log=lines.append), lines


# --- the policy layer --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["recycle", "naive", "bamboo", "oobleck", "auto"])
def test_every_in_place_policy_returns_to_the_fault_free_plan(policy):
  coord, lines = _coordinator(policy)
  fault_free = coord.plan_text()
  assert not coord.fail({NODE}, 3).restore
  assert coord.plan_text() != fault_free
  decision = coord.rejoin({NODE}, 6)
  assert not decision.restore
  assert coord.plan_text() == fault_free
  assert coord.live == set(range(8)) and not coord.down_nodes
  rejoined, decided = coord.events.events[-2:]
  assert (type(rejoined), rejoined.step, rejoined.worker) == (Rejoined, 6, (1, 1))
  assert isinstance(decided, Decided) and decided.relative_to_fault_free == 1.0
  assert coord.phases[-1].event == "rejoin" and coord.phases[-1].failure_step == 6
  # A worker already live, again: nothing changes, nothing is logged.
  logged = len(lines)
  assert not coord.rejoin({NODE}, 7).restore
  assert coord.plan_text() == fault_free and len(lines) == logged
  with pytest.raises(ValueError, match="not nodes of this run"):
    coord.rejoin({8}, 7)
  # It can fail again: the same plan as at its first failure.
  again, _ = _coordinator(policy)
  again.fail({NODE}, 3)
  coord.fail({NODE}, 8)
  assert coord.plan_text() == again.plan_text()


@pytest.mark.parametrize("policy", ["recycle", "bamboo", "oobleck"])
def test_a_partial_rejoin_plans_for_the_failures_that_remain(policy):
  coord, _ = _coordinator(policy)
  coord.fail({NODE}, 2)
  coord.fail({2}, 3)  # worker (0, 2)
  coord.rejoin({NODE}, 5)
  only, _ = _coordinator(policy)
  only.fail({2}, 3)
  assert coord.plan_text() == only.plan_text()
  assert coord.down_nodes == {2}


def test_oobleck_takes_every_live_node_back():
  coord, _ = _coordinator("oobleck")
  coord.fail({NODE}, 3)
  assert len(coord.plan.nodes) < 7  # its templates cannot cover the 7 survivors
  coord.rejoin({NODE}, 6)
  assert sorted(coord.plan.nodes) == list(range(8))


def test_restart_grows_back_when_that_pays_back():
  coord, lines = _coordinator("restart")
  fault_free = coord.plan_text()
  assert coord.fail({NODE}, 3).restore
  assert (coord.grid.dp, coord.grid.pp) == (1, 4)
  decision = coord.rejoin({NODE}, 6)
  assert decision.restore and "growing the layout to dp=2 pp=4" in decision.reason
  assert coord.plan_text() == fault_free
  assert any("taken back with a planned restart" in line for line in lines)


def test_restart_keeps_a_rejoined_node_idle_when_growing_would_not_pay_back():
  # A restore costs 20 fault-free steps; with a failure expected every 10 steps, waiting wins.
  coord, lines = _coordinator("restart", resilience__mean_steps_between_failures=10.0)
  coord.fail({NODE}, 3)
  plan = coord.plan_text()
  decision = coord.rejoin({NODE}, 6)
  assert not decision.restore and coord.plan_text() == plan
  assert NODE in coord.live and NODE not in coord.plan.nodes.values()
  assert "stay idle outside the dp=1 pp=4 layout" in lines[-1] and "not taken back" in lines[-1]
  # The next failure's restore lays the job out on the live nodes, the idle one included.
  assert coord.fail({0, 1, 2}, 8).restore
  assert sorted(coord.plan.nodes.values()) == [3, 4, NODE, 6]


def test_rejoin_rule_prices_a_planned_restart_against_waiting():
  params = RecoveryParams(detect_s=0.0, regroup_s=1.0, restart_s=20.0,
                          checkpoint_interval_s=100.0)
  policies = build_policies(["recycle", "restart"], params=params)
  grid = Grid(2, 4, 4)
  costs = CostModel.from_profile(PROFILE)
  restart = policies["restart"]
  failed = frozenset({(1, 1)})
  now = restart.step_time(grid, failed, costs)
  t = Transition(grid, failed, frozenset(), costs, now)
  assert rejoin_choice(restart, t, horizon_s=1e4).take
  slow = rejoin_choice(restart, t, horizon_s=25.0)
  assert not slow.take and slow.recovery == Recovery(0.0)
  # In place: always taken, for a regroup.
  recycle = policies["recycle"]
  t = Transition(grid, failed, frozenset(), costs, recycle.step_time(grid, failed, costs))
  choice = rejoin_choice(recycle, t, horizon_s=1.0)
  assert choice.take and choice.recovery == Recovery(1.0)
  with pytest.raises(ValueError, match="prices rejoins"):
    rejoin_choice(recycle, Transition(grid, frozenset(), failed, costs, 1.0), 1.0)


def test_simulator_rejoins_go_through_the_rejoin_rule(monkeypatch):
  calls = []

  def counting(policy, t, horizon_s):
    calls.append((policy.name, t.before, t.after))
    return rejoin_choice(policy, t, horizon_s)

  monkeypatch.setattr(engine, "rejoin_choice", counting)
  lay = Layout(dp=4, pp=4, microbatches=4, devices_per_node=4)
  costs = CostModel.from_profile(PROFILE)
  # A restart (3000 s) that the 5000 s to the next event cannot pay back: restart declines the
  # rejoin and trains on 3 pipelines to the end; recycle takes it back in place.
  params = RecoveryParams(detect_s=30.0, regroup_s=10.0, restart_s=3000.0,
                          checkpoint_interval_s=1000.0)
  trace = Trace(10_000.0, (Event(2500.0, "fail", 1, 2), Event(6000.0, "rejoin", 1, 2)),
                lay.nodes, 4)
  policies = build_policies(["recycle", "restart"], params=params)
  result = engine.run_trace(lay, costs, policies, trace, checkpoint_interval_s=1000.0)
  assert [(name, after) for name, _, after in calls] == [
    ("recycle", frozenset()), ("restart", frozenset())]
  grid = Grid(4, 4, 4)
  t0 = policies["restart"].step_time(grid, frozenset(), costs)
  r1 = policies["restart"].step_time(grid, frozenset({(1, 2)}), costs)
  run = result.policies["restart"]
  expect = lay.global_batch * (2000 / t0 + (6000 - 5530 + 4000) / r1)
  assert run.samples == pytest.approx(expect)
  assert run.paused_s == pytest.approx(3030.0)


# --- the faults API ----------------------------------------------------------------------------


def test_faults_schedule_parses_rejoins_and_checks_them():
  assert [(f.step, f.dp, f.stage, f.rejoin) for f in parse_faults(FAULTS)] == [
    (3, 1, 1, False), (6, 1, 1, True)]
  assert str(parse_faults("6:+1.1")[0]) == "6:+1.1"
  cfg = tiny_config(mesh__dp=2, mesh__pp=4, train__steps=7, faults__schedule=FAULTS)
  assert cfg.faults.schedule[1].rejoin
  for bad in ("3:+1.1", "3:1.1,3:+1.1", "3:1.1,5:+1.1,6:+1.1"):
    with pytest.raises(ConfigError, match="cannot rejoin"):
      tiny_config(mesh__dp=2, mesh__pp=4, train__steps=7, faults__schedule=bad)
  with pytest.raises(ConfigError, match=r"STEP:\+DP.STAGE"):
    parse_faults("3:-1.1")
  # The programmatic API: checked before anything is built.
  cfg = tiny_config(mesh__dp=2, mesh__pp=4, train__steps=7)
  with pytest.raises(ConfigError, match="cannot rejoin"):
    Trainer(cfg, "/nonexistent", faults=[FaultEvent(4, (1, 1), rejoin=True)])
  with pytest.raises(ConfigError, match="start of a step"):
    Trainer(cfg, "/nonexistent", faults=[FaultEvent(2, (1, 1)),
                                         FaultEvent(4, (1, 1), Op(F, 0), rejoin=True)])


# --- in-process runs ----------------------------------------------------------------------------


def _run_with_rejoin(tmp_path, policy, *, programmatic=False, **overrides):
  # `programmatic`: the rejoin comes as a `FaultEvent`, the failure from the config.
  schedule, faults = ("3:1.1", [FaultEvent(6, (1, 1), rejoin=True)]) if programmatic else (
    FAULTS, [])
  cfg = tiny_config(mesh__dp=2, mesh__pp=4, train__steps=7, faults__schedule=schedule,
                    resilience__policy=policy, **overrides)
  lines = []
  trainer = Trainer(cfg, tmp_path, log=lines.append, faults=faults)
  result = trainer.run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  assert [m["live_workers"] for m in result.metrics][-2:] == [8, 8]
  assert [(e.step, e.worker) for e in result.events if isinstance(e, Rejoined)] == [(6, (1, 1))]
  goodput = json.loads((tmp_path / "goodput.json").read_text())
  failure, rejoin = goodput["events"]
  assert (failure["kind"], failure["step"], failure["nodes"]) == ("failure", 3, [NODE])
  assert (rejoin["kind"], rejoin["step"], rejoin["nodes"]) == ("rejoin", 6, [NODE])
  assert rejoin["next_committed_step"] == 6 and rejoin["time_to_next_committed_step_s"] >= 0
  assert rejoin["samples_per_s_before"] > 0 and rejoin["samples_per_s_after"] > 0
  run = goodput["run"]
  assert (run["steps"], run["failures"], run["rejoins"]) == (7, 1, 1)
  assert 0 < run["effective_fraction"] <= 1
  fault_free = RunCoordinator(cfg, range(8), log=lambda _: None)
  return trainer, result, lines, rejoin, fault_free


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recycle", "oobleck", "bamboo"])
def test_rejoin_in_process_keeps_every_step_and_takes_the_capacity_back(tmp_path, policy):
  trainer, result, lines, rejoin, fault_free = _run_with_rejoin(
    tmp_path, policy, programmatic=policy == "bamboo")
  coord = trainer.coordinator
  if policy == "oobleck":
    assert sorted(coord.plan.nodes) == list(range(8))  # every live device
  else:
    assert coord.plan_text() == fault_free.plan_text()
  assert rejoin["steps_rerun"] == 0 and rejoin["bytes_copied"] > 0
  [source] = [line for line in lines if "its state came from" in line]
  assert f"(node {NODE})" in source and rejoin["state_from"][str(NODE)] in source
  assert any("copied" in line and "device to device" in line for line in lines)
  [(step, text)] = texts(tmp_path / "tb", "rejoin")
  assert step == 6 and f"node(s) [{NODE}] rejoined at the start of step 6" in text


@pytest.mark.slow
def test_restart_grows_back_through_a_checkpoint_without_redoing_a_step(tmp_path):
  trainer, result, lines, rejoin, fault_free = _run_with_rejoin(
    tmp_path, "restart", checkpoint__every_steps=2)
  assert trainer.coordinator.plan_text() == fault_free.plan_text()
  assert rejoin["state_from"] == "checkpoint" and rejoin["steps_rerun"] == 0
  assert any("checkpointing step 5 and restoring it onto the new layout" in line
             for line in lines)
  assert (5, "dp=1 pp=4 tp=1") in [(s, on) for s, on, _ in loaded_checkpoints(result)]
  assert math.isclose(result.metrics[-1]["step"], 7)
