"""The runtime's coordinator and the simulator, fed the same failures, decide the same way.

Both call the policy objects of `resilient_jax.policy`; here the simulator's side drives them
as its engine does (a fresh set of policies, `step_time` of the fault-free start, then
`recovery` of each transition) with the runtime's costs, and every decision must match what the
coordinator runs: the same re-routed schedules, the same Oobleck instances, the same Bamboo
failovers and step times, the same restore layouts and the same `auto` choices.
"""

import pytest

from resilient_jax.observe.events import Failure
from resilient_jax.policy import Grid, RunCoordinator, Transition, build_policies
from resilient_jax.policy import coordinator as coordinator_module
from resilient_jax.policy import rerouting as rerouting_module
from resilient_jax.policy.costs import recovery_params
from resilient_jax.schedule import adaptive as adaptive_module
from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.plan import step_program
from resilient_jax.schedule.price import replay_program
from resilient_jax.schedule.validate import validate
from tests.helpers import tiny_config

# Failure sequences as nodes of the initial grid (worker (d, s) is node d * pp + s).
SEQUENCES = {
  (4, 2): [5, 2, 6],
  (2, 4): [5, 2],
}


def _pair(policy, dp, pp, **overrides):
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, resilience__policy=policy, **overrides)
  coord = RunCoordinator(cfg, range(dp * pp), log=lambda _: None)
  sim = build_policies(
    params=recovery_params(cfg, coord.fault_free_makespan),
    tolerate=cfg.resilience.tolerate,
    min_pipeline_nodes=cfg.resilience.min_pipeline_nodes,
  )
  grid = Grid(dp, pp, cfg.pipeline.microbatches, cfg.pipeline.schedule,
              global_batch=cfg.train.global_batch)
  return cfg, coord, sim, grid


def _events(dp, pp):
  failed = set()
  for step, node in enumerate(SEQUENCES[(dp, pp)], start=2):
    before = frozenset(failed)
    failed.add(divmod(node, pp))
    yield step, node, before, frozenset(failed)


@pytest.mark.parametrize("policy", ["recycle", "naive"])
@pytest.mark.parametrize("dp,pp", sorted(SEQUENCES))
def test_rerouting_plans_are_the_same_in_runtime_and_simulator(policy, dp, pp):
  _, coord, sim, grid = _pair(policy, dp, pp)
  for step, node, _, failed in _events(dp, pp):
    decision = coord.fail({node}, step)
    assert not decision.restore
    assert decision.plan.schedule == sim[policy].plan(grid, failed, coord.costs)
    runtime_t = simulate(decision.plan.schedule, coord.costs.op).makespan
    sim_t = sim[policy].step_time(grid, failed, coord.costs, reduce=False)
    assert sim_t == pytest.approx(runtime_t)


@pytest.mark.parametrize("dp,pp", [(2, 4), (4, 2)])
def test_bamboo_prices_the_plan_the_coordinator_runs(dp, pp):
  """Bamboo's plan is the runtime's pipeline set on grid positions, and its step time, priced on
  one pipeline per distinct damage, is the replay of the whole set the coordinator hands to the
  interpreter (`tests/test_policies.py` replays it again from a profiled step)."""
  _, coord, sim, grid = _pair("bamboo", dp, pp)
  bamboo, op = sim["bamboo"], coord.costs.op

  def replayed():
    return replay_program(step_program(coord.plan), op.duration, comm=op.comm).makespan

  assert bamboo.step_time(grid, frozenset(), coord.costs) == pytest.approx(replayed())
  node = pp + 1  # worker (1, 1): its predecessor takes over
  decision = coord.fail({node}, 2)
  assert not decision.restore
  failed = frozenset({divmod(node, pp)})
  partition = coord.plan.pipelines[0].stages
  assert decision.plan == bamboo.plan(grid, failed, coord.costs).with_partition(partition)
  assert decision.plan.pipelines[1].nodes == (pp, pp, *range(pp + 2, 2 * pp))
  assert bamboo.step_time(grid, failed, coord.costs) == pytest.approx(replayed())
  assert coord.predicted_makespan() == pytest.approx(replayed())
  # Its predecessor too: a stage and its replica are gone, both sides restore.
  assert coord.fail({pp}, 3).restore
  assert bamboo.plan(grid, failed | {(1, 0)}, coord.costs) is None


@pytest.mark.parametrize("dp,pp", sorted(SEQUENCES))
def test_oobleck_instances_are_the_same_in_runtime_and_simulator(dp, pp):
  _, coord, sim, grid = _pair("oobleck", dp, pp, resilience__min_pipeline_nodes=1)
  oobleck = sim["oobleck"]
  start = oobleck.plan(grid, frozenset(), coord.costs)
  assert coord.planned == start
  current = start
  for step, node, _, failed in _events(dp, pp):
    decision = coord.fail({node}, step)
    current = oobleck.next_instance(grid, coord.costs, current, failed)
    assert decision.restore == (current is None)
    if current is None:
      break
    assert coord.planned == current
    assert coord.predicted_makespan() == pytest.approx(
      oobleck.instance_step_time(grid, coord.costs, current))
  # A single failure re-instantiated from the fault-free instance is what the simulator prices.
  first = frozenset({divmod(SEQUENCES[(dp, pp)][0], pp)})
  fresh = RunCoordinator(coord.cfg, range(dp * pp), log=lambda _: None)
  fresh.fail({SEQUENCES[(dp, pp)][0]}, 2)
  assert fresh.predicted_makespan() == pytest.approx(oobleck.step_time(grid, first, coord.costs))


@pytest.mark.parametrize("dp,pp", sorted(SEQUENCES))
def test_restart_restores_onto_the_same_layout(dp, pp):
  cfg, _, sim, grid = _pair("restart", dp, pp)
  for step, _, _, failed in _events(dp, pp):
    coord = RunCoordinator(cfg, range(dp * pp), log=lambda _: None)
    decision = coord.fail({d * pp + s for d, s in failed}, step)
    assert decision.restore
    plan = decision.plan.schedule
    assert (plan.dp, plan.pp) == sim["restart"].plan(grid, failed, coord.costs)
    # The stage count is kept; the runtime needs equal micro-batches, so the pipelines are as
    # many as the survivors fill and the global batch divides into.
    most = (dp * pp - len(failed)) // pp
    assert plan.pp == pp
    assert plan.dp == max(d for d in range(1, most + 1)
                          if cfg.train.global_batch % (d * cfg.pipeline.microbatches) == 0)


@pytest.mark.parametrize("horizon", [2.0, 500.0])
@pytest.mark.parametrize("dp,pp", sorted(SEQUENCES))
def test_auto_chooses_the_same_in_runtime_and_simulator(dp, pp, horizon):
  cfg, coord, sim, grid = _pair(
    "auto", dp, pp, resilience__mean_steps_between_failures=horizon)
  auto = sim["auto"]
  auto.reset(horizon * coord.fault_free_makespan)
  step_time = auto.step_time(grid, frozenset(), coord.costs)
  assert coord.policy == auto.current.name
  for step, node, before, failed in _events(dp, pp):
    decision = coord.fail({node}, step)
    auto.recovery(Transition(grid, before, failed, coord.costs, step_time))
    step_time = auto.step_time(grid, failed, coord.costs)
    if decision.restore:
      assert auto.current.name == "restart" or auto.current.plan(grid, failed, coord.costs) is None
      break
    assert coord.policy == auto.current.name
    assert coord.predicted_makespan() == pytest.approx(step_time)


def test_auto_switches_only_when_the_switch_pays_back():
  """On 4 x 2, three failures leave stage 0 one worker that carries 4x its work: Bamboo's
  failover to each pipeline's own last stage is predicted faster than re-routing (55.4 against
  96.0 block units). Over a long horizon auto takes it; when the next failure is expected
  sooner than the switch's pause (a regroup step plus half the step in flight) it keeps what
  it runs."""
  chosen = {}
  for horizon in (1.0, 500.0):
    _, coord, _, _ = _pair("auto", 4, 2, resilience__mean_steps_between_failures=horizon)
    for step, node in enumerate([0, 2, 4], start=2):
      coord.fail({node}, step)
    chosen[horizon] = coord.policy
  assert chosen == {1.0: "recycle", 500.0: "bamboo"}


def test_a_host_loss_fails_all_its_workers_at_once():
  cfg = tiny_config(mesh__dp=4, mesh__pp=2)
  lines = []
  coord = RunCoordinator(cfg, range(8), log=lines.append)
  decision = coord.fail({2, 3}, 4)  # both stages of pipeline 1: one host
  assert not decision.restore
  assert set(decision.plan.schedule.ops) == {(d, s) for d in (0, 2, 3) for s in (0, 1)}
  assert [(e.step, e.node) for e in coord.events.of(Failure)] == [(4, 2), (4, 3)]
  # The same loss under restart restores onto the survivors, keeping 2 stages: 3 pipelines
  # would not split the global batch of 16 into equal micro-batches, so 2 (on the first 4).
  restart = RunCoordinator(tiny_config(mesh__dp=4, mesh__pp=2, resilience__policy="restart"),
                           range(8), log=lambda _: None)
  decision = restart.fail({2, 3}, 4)
  assert decision.restore and (decision.plan.schedule.dp, decision.plan.schedule.pp) == (2, 2)
  assert sorted(decision.plan.nodes.values()) == [0, 1, 4, 5]


# --- replanning at scale (the touched pipelines, expanded) ----------------------------------------


def _coordinator(dp, pp, m, policy="recycle"):
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, model__num_layers=pp, pipeline__microbatches=m,
                    pipeline__schedule="zb-h1", train__global_batch=dp * m,
                    resilience__policy=policy)
  return RunCoordinator(cfg, range(dp * pp), log=lambda _: None)


def test_large_grid_recovery_neither_validates_nor_replays_the_grid(monkeypatch):
  """64 x 8 x 16 (24.6k compute ops): past the exact planner's and the validator's thresholds.
  Recovering from a failure plans the pipelines it touches and validates that plan; nothing
  validates or replays the full grid, and no worker's op list is built until someone reads
  it."""
  dp, pp, m = 64, 8, 16
  calls = []

  def spy(real):
    def wrapped(schedule, *args, **kwargs):
      calls.append((real.__name__, schedule.dp))
      return real(schedule, *args, **kwargs)
    return wrapped

  for module in (coordinator_module, rerouting_module, adaptive_module):
    for name in ("validate", "simulate"):
      if hasattr(module, name):
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
  coord = _coordinator(dp, pp, m)
  recycle = coord.policies["recycle"]
  for step, node in enumerate([50 * pp + 3, 35 * pp + 5], start=1):
    decision = coord.fail({node}, step)
    assert not decision.restore
  sched = decision.plan.schedule
  assert not [c for c in calls if c[1] == dp], calls
  # What changed is validated: each failure's touched sub-grid plan (18, then 21 pipelines).
  assert [c for c in calls if c[0] == "validate"] == [("validate", 18), ("validate", 21)], calls
  assert not sched.ops._lists
  assert recycle.plans == 2
  # What the runtime reads is there: the failed workers' micro-batches at their stage elsewhere.
  assert {sched.route[50 * m + j][3] for j in range(m)}.isdisjoint({50})
  assert len(sched.ops[(40, 5)]) == 3 * m + 2 and (50, 3) not in sched.ops
  # The same failures elsewhere (one stage-3 failure, then one of stage 5, behind the takers)
  # touch the grid the same way: planned from the cache.
  again = _coordinator(dp, pp, m)
  again.policies = coord.policies
  again.active = recycle
  again.fail({45 * pp + 3}, 1)
  again.fail({30 * pp + 5}, 2)
  assert recycle.plans == 2
  assert again.predicted_makespan() == coord.predicted_makespan()


@pytest.mark.parametrize("policy", ["recycle", "naive"])
def test_expanded_plans_are_the_exact_ones(policy, monkeypatch):
  """With the thresholds at 0 a 12 x 4 grid goes the large-grid way: the same schedules as the
  whole grid's planner (the simulator's side, below its threshold), valid, with the predicted
  step time a replay of the schedule gives."""
  monkeypatch.setattr(rerouting_module, "VALIDATE_MAX_OPS", 0)
  coord = _coordinator(12, 4, 8, policy)
  coord.policies[policy].exact_ops = 0
  sim = build_policies(params=recovery_params(coord.cfg, coord.fault_free_makespan))
  for step, node in enumerate([41, 6, 45], start=1):  # (10, 1), (1, 2), (11, 1)
    decision = coord.fail({node}, step)
    want = sim[policy].plan(coord.grid, coord.dead, coord.costs)
    assert decision.plan.schedule == want
    validate(decision.plan.schedule)
    assert coord.predicted_makespan() == pytest.approx(simulate(want, coord.costs.op).makespan)
