"""Hosts: where a grid's workers sit on processes (one placement for the runtime and the
simulator), and a whole host lost at once."""

import re

import pytest

from resilient_jax.config import ConfigError
from resilient_jax.observe.events import Failure
from resilient_jax.sim.layout import Layout
from resilient_jax.spec import placement
from resilient_jax.training.loop import Trainer
from tests.helpers import assert_matches_reference, expected_digests, tiny_config


def test_placements_of_a_2x4_grid_on_two_hosts():
  by_pipeline = placement.host_workers(2, 4, 2, "pipeline")
  assert by_pipeline == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(1, 0), (1, 1), (1, 2), (1, 3)]]
  by_stage = placement.host_workers(2, 4, 2, "stage")
  assert by_stage == [[(0, 0), (1, 0), (0, 1), (1, 1)], [(0, 2), (1, 2), (0, 3), (1, 3)]]
  # Nodes are the coordinator's (d * pp + s); each process's local indices count 0, 1, ...
  slots = placement.process_slots(2, 4, "stage", 2, 4)
  assert slots[1 * 4 + 0] == (0, 1) and slots[0 * 4 + 3] == (1, 2)
  assert sorted(i for p, i in slots.values() if p == 1) == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", placement.PLACEMENTS)
@pytest.mark.parametrize("dp, pp, hosts", [(2, 4, 2), (4, 2, 2), (8, 4, 4), (3, 4, 6)])
def test_simulator_and_runtime_place_alike(kind, dp, pp, hosts):
  """The simulator's node of a worker (tp=1) is the process the runtime runs it on."""
  per = dp * pp // hosts
  layout = Layout(dp=dp, pp=pp, devices_per_node=per, placement=kind)
  slots = placement.host_slots(dp, pp, hosts, kind)
  assert {w: layout.node_of_worker(w) for w in slots} == {w: h for w, (h, _) in slots.items()}
  assert sorted(slots.values()) == [(h, i) for h in range(hosts) for i in range(per)]


@pytest.mark.parametrize("args, needle", [
  ((2, 2, "pipeline", 2, 1), "= 4 workers (one device each) must fill the job's 2 processes x "
                             "1 devices = 2 exactly"),
  ((2, 2, "pipeline", 1, 8), "1 processes x 8 devices = 8"),  # idle devices are an error too
  ((3, 2, "pipeline", 4, 1), "6 workers"),  # 6 workers do not divide over 4 processes
  ((2, 2, "ring", 2, 2), "mesh.placement='ring'"),
])
def test_process_slots_enforce_the_rule(args, needle):
  with pytest.raises(ValueError, match=re.escape(needle)):
    placement.process_slots(*args)


def test_bad_placement_is_a_config_error():
  with pytest.raises(ConfigError, match="mesh.placement='ring' is not one of pipeline, stage"):
    tiny_config(mesh__placement="ring")


@pytest.mark.slow  # about 4.5 s: keeps the quick subset under 3 minutes
def test_a_whole_host_lost_in_process(tmp_path):
  """8 simulated devices as 2 hosts of 4 (pipeline placement: host 1 is pipeline 1): all 4 of
  host 1's workers fail at the start of step 2, in one failure (one replan, not four); the run
  keeps the fault-free samples and the single-device losses and parameters."""
  [_, host1] = placement.host_workers(2, 4, 2, placement.DEFAULT_PLACEMENT)
  faults = ",".join(f"2:{d}.{s}" for d, s in host1)
  cfg = tiny_config(mesh__dp=2, mesh__pp=4, faults__schedule=faults)
  lines = []
  result = Trainer(cfg, tmp_path, log=lines.append).run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  assert [m["live_workers"] for m in result.metrics] == [8, 4, 4]
  coord = result.coordinator
  assert sorted(coord.failed) == [(2, d * 4 + s) for d, s in host1]
  assert len(coord.phases) == 2  # fault-free, then one phase after the host's loss
  assert sorted((e.step, e.worker) for e in result.events if isinstance(e, Failure)) == \
      sorted((2, w) for w in host1)


def test_the_simulator_fails_whole_hosts_as_placed():
  """`configs/sim/hosts.py:runlocal` (2 hosts of 4 devices, dp 2 x pp 4): a host failure in the
  sweep removes exactly the workers the placement puts on it. Under `pipeline` that is one
  pipeline, and re-routing goes on; under `stage` it is two whole stages, which only a restart
  on the surviving host can recover from: slower."""
  from resilient_jax.policy.base import Grid
  from resilient_jax.policy.registry import build_policies
  from resilient_jax.sim import build_costs, from_config_dict
  from resilient_jax.sim.config import load_config_file
  from resilient_jax.sim.engine import sweep, sweep_failed_set
  from tests.helpers import ROOT

  one_host = {}
  for kind in placement.PLACEMENTS:
    cd = load_config_file(f"{ROOT}/configs/sim/hosts.py:runlocal")
    cd.cluster.placement = kind
    cfg = from_config_dict(cd)
    lay = cfg.layout
    grid = Grid(lay.dp, lay.pp, lay.microbatches, lay.schedule, lay.memory_cap)
    hosts = placement.host_workers(lay.dp, lay.pp, lay.nodes, kind)
    for seed in range(4):
      failed = sweep_failed_set(grid, 1, "hosts", seed=seed, layout=lay)
      assert sorted(failed) in [sorted(h) for h in hosts]
      assert min(grid.live_per_stage(failed)) == (1 if kind == "pipeline" else 0)
    policies = build_policies(("recycle",), params=cfg.recovery, exact_ops=cfg.exact_ops)
    [free, one] = sweep(grid, build_costs(cfg), policies, [0, 1],
                        samples_per_step=lay.global_batch, placement="hosts", layout=lay)
    assert 0 < one.throughput < free.throughput
    one_host[kind] = one.throughput
  assert one_host["pipeline"] > one_host["stage"]
