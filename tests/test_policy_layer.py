"""The runtime's coordinator and the simulator, fed the same failures, decide the same way.

The runtime prices plans with the analytic GPT costs (`policy/costs.py`, block-forward units);
the simulator with a `CostModel`. Given a cost model holding exactly those per-stage costs, the
re-routing planners must produce the same schedules and Bamboo the same step times in both, so
what the simulator predicts at scale is what the runtime would run. Oobleck's templates still
follow different rules in the two; see issue 12.)
"""

import pytest

from resilient_jax.policy import RunCoordinator
from resilient_jax.schedule.cost import simulate
from resilient_jax.sim import CostModel, Grid, build_policies
from tests.helpers import tiny_config

# Failure sequences as nodes of the initial grid (worker (d, s) is node d * pp + s).
SEQUENCES = {
  (4, 2): [5, 2, 6],
  (2, 4): [5, 2],
}


def _sim_costs(coord: RunCoordinator) -> CostModel:
  c = coord.costs
  return CostModel.from_profile(
    {"f": list(c.f), "b": list(c.b), "w": list(c.w), "ar": 0.0, "opt": 0.0, "comm": 0.0}
  )


@pytest.mark.parametrize("policy", ["recycle", "naive"])
@pytest.mark.parametrize("dp,pp", sorted(SEQUENCES))
def test_rerouting_plans_are_the_same_in_runtime_and_simulator(policy, dp, pp):
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, resilience__policy=policy)
  coord = RunCoordinator(cfg, range(dp * pp), log=lambda _: None)
  costs = _sim_costs(coord)
  sim = build_policies([policy])[policy]
  grid = Grid(dp, pp, cfg.pipeline.microbatches, cfg.pipeline.schedule)
  failed = set()
  for step, node in enumerate(SEQUENCES[(dp, pp)], start=2):
    decision = coord.fail({node}, step)
    assert not decision.restore
    failed.add(divmod(node, pp))
    planned, op_costs = sim.schedule(grid, frozenset(failed), costs, reduce=False)
    assert decision.plan.schedule == planned
    runtime_t = simulate(decision.plan.schedule, coord.costs).makespan
    assert sim.step_time(grid, frozenset(failed), costs, reduce=False) == pytest.approx(runtime_t)


@pytest.mark.parametrize("dp,pp", [(2, 4), (4, 2)])
def test_bamboo_step_times_are_the_same_in_runtime_and_simulator(dp, pp):
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, resilience__policy="bamboo")
  coord = RunCoordinator(cfg, range(dp * pp), log=lambda _: None)
  costs = _sim_costs(coord)
  sim = build_policies(["bamboo"])["bamboo"]
  grid = Grid(dp, pp, cfg.pipeline.microbatches, cfg.pipeline.schedule)
  assert sim.step_time(grid, frozenset(), costs) == pytest.approx(coord.predicted_makespan())
  node = pp + 1  # worker (1, 1): its predecessor takes over
  assert not coord.fail({node}, 2).restore
  failed = frozenset({divmod(node, pp)})
  assert sim.step_time(grid, failed, costs) == pytest.approx(coord.predicted_makespan())


def test_a_host_loss_fails_all_its_workers_at_once():
  cfg = tiny_config(mesh__dp=4, mesh__pp=2)
  lines = []
  coord = RunCoordinator(cfg, range(8), log=lines.append)
  decision = coord.fail({2, 3}, 4)  # both stages of pipeline 1: one host
  assert not decision.restore
  assert set(decision.plan.schedule.ops) == {(d, s) for d in (0, 2, 3) for s in (0, 1)}
  assert sum("FAILURE" in line for line in lines) == 2
  # The same loss under restart restores onto the survivors, keeping 2 stages: 3 pipelines
  # would not split the global batch of 16 into equal micro-batches, so 2 (on the first 4).
  restart = RunCoordinator(tiny_config(mesh__dp=4, mesh__pp=2, resilience__policy="restart"),
                           range(8), log=lambda _: None)
  decision = restart.fail({2, 3}, 4)
  assert decision.restore and (decision.plan.schedule.dp, decision.plan.schedule.pp) == (2, 2)
  assert sorted(decision.plan.nodes.values()) == [0, 1, 4, 5]


@pytest.mark.parametrize("dp,pp", sorted(SEQUENCES))
def test_restart_keeps_the_stage_count_in_runtime_and_simulator(dp, pp):
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, resilience__policy="restart")
  sim = build_policies(["restart"])["restart"]
  grid = Grid(dp, pp, cfg.pipeline.microbatches, cfg.pipeline.schedule)
  failed = set()
  for step, node in enumerate(SEQUENCES[(dp, pp)], start=2):
    coord = RunCoordinator(cfg, range(dp * pp), log=lambda _: None)
    failed.add(divmod(node, pp))
    decision = coord.fail({d * pp + s for d, s in failed}, step)
    assert decision.restore
    plan = decision.plan.schedule
    # Both keep the stage count and fill as many pipelines as the survivors allow; the runtime
    # also needs the global batch to split into equal micro-batches (the simulator deals them
    # unevenly), so it may run fewer.
    most = sim.pipelines(grid, frozenset(failed))
    assert plan.pp == pp
    assert plan.dp == max(d for d in range(1, most + 1)
                          if cfg.train.global_batch % (d * cfg.pipeline.microbatches) == 0)
