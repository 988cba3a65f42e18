"""A recorded executor run against the simulator's prediction from that run's own profile.

`tests/data/recorded_run.json` was written by `python benchmarks/failures.py --record ...`: a
tiny GPT on 2 x 4 simulated devices, worker (1, 1) failing, with each op's median measured
duration over 5 profiled steps before and after the failure, and the schedules that ran. The
executor's relative throughput is those schedules replayed with those durations; the
simulator only gets the fault-free step's per-stage mean op times (its profile format) and
plans the failure itself.
"""

import json
from pathlib import Path

import pytest

from resilient_jax.schedule.core import Op, make_schedule
from resilient_jax.schedule.cost import replay
from resilient_jax.sim import predict_relative_throughput

DATA = json.loads((Path(__file__).parent / "data" / "recorded_run.json").read_text())


def _replayed(phase: dict, dp: int, pp: int, m: int) -> float:
  ops = {
    tuple(int(x) for x in w.split(",")): [Op(k, mb) for k, mb in lst]
    for w, lst in phase["ops"].items()
  }
  sched = make_schedule("recorded", dp, pp, m, ops, tuple(tuple(r) for r in phase["route"]))
  durations = {((d, s), Op(k, mb)): t for d, s, k, mb, t in phase["durations"]}
  return replay(sched, durations).makespan


@pytest.mark.parametrize("policy", ["recycle", "naive"])
def test_simulator_predicts_recorded_relative_throughput(policy):
  dp, pp, m = DATA["dp"], DATA["pp"], DATA["m"]
  run = DATA["policies"][policy]
  recorded = _replayed(run["before"], dp, pp, m) / _replayed(run["after"], dp, pp, m)
  failed = [tuple(w) for w in DATA["failed"]]
  predicted = predict_relative_throughput(
    run["profile"], dp, pp, m, failed, policy=policy, base=DATA["base"]
  )
  assert 0 < recorded < 1 and 0 < predicted < 1
  assert abs(predicted / recorded - 1) <= 0.10, (policy, recorded, predicted)
