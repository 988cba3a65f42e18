"""The cluster simulator against the library's own cost model and against closed forms."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

from resilient_jax.policy import Transition
from resilient_jax.schedule import adaptive
from resilient_jax.schedule.bamboo import bamboo_step_time
from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.oobleck import oobleck_step_time
from resilient_jax.schedule.routing import FailureState
from resilient_jax.sim import (
  CostModel,
  Event,
  FailureTracker,
  Grid,
  Layout,
  PolicyUnavailableError,
  RecoveryParams,
  SimConfigError,
  TraceError,
  build_policies,
  failure_pattern,
  from_config_dict,
  load_profile,
  max_load,
  poisson_trace,
  predict_relative_throughput,
  read_csv_trace,
  reduce_pattern,
  ring_allreduce_seconds,
  run_simulation,
  run_trace,
  save_profile,
  sweep,
  write_csv_trace,
)
from resilient_jax.sim.config import load_config_file
from resilient_jax.sim.specs import DeviceSpec, ModelSpec, NetworkSpec
from resilient_jax.sim.traces import Trace
from tests.test_tensorboard import scalars, texts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Stage 3 is heavier (it runs the head), as in a real GPT split; transfers and collectives cost.
PROFILE = {
  "f": [1.0, 1.0, 1.0, 1.3],
  "b": [1.1, 1.1, 1.1, 1.4],
  "w": [0.9, 0.9, 0.9, 1.2],
  "ar": 0.3,
  "opt": 0.05,
  "comm": 0.02,
}


@pytest.fixture(scope="module")
def costs() -> CostModel:
  return CostModel.from_profile(PROFILE)


# --- the engine is the cost model -----------------------------------------------------------


@pytest.mark.parametrize(
  "failed",
  [
    set(),
    {(1, 2)},
    {(0, 0), (3, 3)},
    {(2, 1), (2, 2)},
    {(0, 1), (1, 1), (3, 1)},
  ],
)
def test_step_time_is_the_cost_models_makespan_of_the_same_schedule(costs, failed):
  grid = Grid(4, 4, 4, base="zb-h1")
  failed = frozenset(failed)
  op = costs.op_costs(grid.live_per_stage(failed))
  policies = build_policies(["recycle", "naive"])
  for name, planner in (("recycle", "adaptive"), ("naive", "naive")):
    sched = adaptive.plan(planner, FailureState(4, 4, 4, failed), op, base="zb-h1")
    assert policies[name].step_time(grid, failed, costs) == simulate(sched, op).makespan


def test_restart_step_time_is_the_full_grid_of_survivors(costs):
  grid = Grid(4, 4, 4, base="1f1b")
  failed = frozenset({(1, 2)})  # 15 live workers: 3 pipelines of 4 stages, ceil(16/3) = 6 each
  op = costs.op_costs((3,) * 4)
  full = simulate(generate("1f1b", 3, 4, 6), op).makespan
  assert build_policies(["restart"])["restart"].step_time(grid, failed, costs) == full


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16), (4, 3)])
def test_fault_free_1f1b_row_reproduces_the_bubble(pp, m):
  costs = CostModel.from_profile(
    {"f": [1.0] * pp, "b": [1.0] * pp, "w": [1.0] * pp, "ar": 0.0, "opt": 0.0, "comm": 0.0}
  )
  grid = Grid(3, pp, m, base="1f1b")
  for name in ("recycle", "naive", "restart"):
    (row,) = sweep(grid, costs, build_policies([name]), [0], samples_per_step=3 * m)
    per_sample = 3.0  # F + B + W of one micro-batch on one stage
    bubble = 1 - m * per_sample / row.step_time_s
    assert bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert row.relative == 1.0 and row.bound == 1.0


# --- the reduced grid -----------------------------------------------------------------------


def test_reduced_grid_keeps_the_largest_survivor_load():
  rng = random.Random(0)
  for _ in range(300):
    dp, pp, m = rng.randint(2, 3000), rng.randint(1, 8), rng.randint(1, 32)
    counts = tuple(rng.choice([0, 0, 1, 2, rng.randint(0, dp - 1)]) for _ in range(pp))
    pattern = failure_pattern(dp, pp, [(d, s) for s, k in enumerate(counts) for d in range(k)])
    dr, failed = reduce_pattern(dp, pp, m, pattern)
    assert 1 <= dr <= dp
    small = failure_pattern(dr, pp, failed).counts
    for k, kr in zip(counts, small, strict=True):
      assert (k == 0) == (kr == 0)
      assert max_load(dr, m, kr) == max_load(dp, m, k)


def _plans(costs, grid, failed):
  out = []
  for name in ("recycle", "naive"):
    policy = build_policies([name])[name]
    full = policy.step_time(grid, failed, costs, reduce=False)
    out.append((name, full, policy.step_time(grid, failed, costs, reduce=True)))
  return out


@pytest.mark.parametrize(
  "failed,sparse",
  [
    ({(15, 0)}, True),
    ({(15, 3)}, True),
    ({(14, 1), (15, 2)}, True),
    ({(15, 0), (15, 1), (15, 2), (15, 3)}, True),  # a whole pipeline (a node)
    ({(12, 3), (13, 3), (14, 3), (15, 3)}, False),  # dense: 11 micro-batches per survivor
    ({(8 + i, 0) for i in range(8)}, False),  # dense: 16 per survivor
  ],
)
def test_reduced_plan_matches_the_full_plan(costs, failed, sparse):
  # Failed pipelines at the back of the grid, as they are in a large grid: away from the front
  # pipelines that `reroute` hands the orphans to. The naive planner's chains between damaged
  # pipelines survive the reduction only in the sparse regime (see reduce.py).
  grid = Grid(16, 4, 8)
  for name, full, reduced in _plans(costs, grid, frozenset(failed)):
    if name == "recycle" or sparse:
      assert reduced == pytest.approx(full, rel=0.03), name


def test_reduced_adaptive_plan_tracks_random_placements(costs):
  rng = random.Random(1)
  grid = Grid(16, 4, 8)
  recycle = build_policies(["recycle"])["recycle"]
  errors = []
  for _ in range(12):
    stage = rng.randrange(4)
    failed = frozenset((d, stage) for d in rng.sample(range(16), rng.randint(1, 5)))
    full = recycle.step_time(grid, failed, costs, reduce=False)
    errors.append(abs(recycle.step_time(grid, failed, costs, reduce=True) / full - 1))
  assert max(errors) <= 0.03, errors


# --- cost model -----------------------------------------------------------------------------


def test_spec_cost_model_is_the_roofline_and_the_ring():
  model = ModelSpec("gpt", num_layers=8, d_model=1024, num_heads=8, seq_len=512, vocab_size=1000)
  device = DeviceSpec("d", peak_tflops=100.0, hbm_gbps=1000.0, memory_gb=40.0, efficiency=0.5)
  net = NetworkSpec(100.0, 10.0, 1.0, 5.0)
  lay = Layout(dp=8, pp=2, microbatches=4, devices_per_node=8)  # two nodes of 4 pipelines
  costs = CostModel.from_specs(model, device, net, lay)
  tokens, h = 512, 1024
  layer_f = 24 * tokens * h * h + 4 * 512 * h * tokens
  assert costs.f[0] == pytest.approx(4 * layer_f / 50e12)
  assert costs.w[1] > costs.w[0]  # the head
  # A node holds a whole pipeline (2 stages of 1 device): the transfer stays on NVLink.
  assert costs.comm == pytest.approx(tokens * h * 2 / 100e9 + 1e-6)
  grad = model.layers_per_stage(2)[0] * model.layer_params + (1000 + 512) * h
  # The all-reduce is the runtime's (`schedule.ring.two_level`), of a float32 buffer: each node
  # holds 4 of a stage's 8 workers, which sum a quarter each over NVLink (3 pieces in and out
  # per device a phase), run that quarter's ring with the other node on InfiniBand (2 hops of
  # half a piece), and gather the sums.
  assert costs.ar_bytes[0] == 4 * grad and costs.ar_groups == ((4, 4), (4, 4))
  piece = -(-grad // 4) * 4
  chunk = -(-piece // 8) * 4
  ar = costs.op_costs((8, 7)).ar
  assert ar[0] == pytest.approx(2 * (3 * piece / 100e9 + 1e-6) + 2 * (chunk / 10e9 + 5e-6))
  # One worker lost (4 and 3 a node): cut into 8 pieces (`ring.pieces_for`: 4 would leave 2 on
  # one of the 3 devices), two of the 3 devices sum 3 pieces each from 2 peers (6 a phase, as
  # many as the 4-worker node's devices move) and run their 3 rings on one link: the pace.
  piece = -(-int(costs.ar_bytes[1]) // 32) * 4
  chunk = -(-piece // 8) * 4
  assert ar[1] == pytest.approx(2 * (6 * piece / 100e9 + 1e-6) + 2 * (3 * chunk / 10e9 + 5e-6))
  assert costs.op_costs((4, 1)).ar == (pytest.approx(2 * (3 * -(-grad // 4) * 4 / 100e9 + 1e-6)),
                                       0.0)  # one node left: its links only; one worker: none
  # A node per pipeline (8 stages of one device): one worker of a stage a node, the ring alone.
  costs = CostModel.from_specs(model, device, net, Layout(dp=4, pp=8, microbatches=8))
  elements = int(costs.ar_bytes[0]) // 4
  assert costs.op_costs((3,) * 8).ar[0] == pytest.approx(
    2 * 2 * (-(-elements // 3) * 4 / 10e9 + 5e-6))
  assert ring_allreduce_seconds(1e9, 1, 1.0, 1.0) == 0.0


def test_the_cost_model_prices_the_ring_the_runtime_runs():
  """The simulator's all-reduce is the runtime's (`schedule.ring`, whose hops
  `ProcessTransport._ring` walks): replayed on numbers at P = 2..8 processes, the ring sums
  every chunk once and leaves every member bitwise the same sums, each member sending the bytes
  the cost model counts (2 (P - 1) / P of the buffer); the runtime's own cut
  (`transport.pieces`) makes pieces of the size priced. With several members a process
  (`two_level`: a local reduce-scatter, a ring per piece, a local all-gather) the replay's
  busiest device moves exactly the bytes priced, on the node's links and on the network."""
  import jax
  import numpy as np

  from resilient_jax.runtime.transport import pieces as cut_and_join
  from resilient_jax.schedule import ring

  elements, bw, lat = 1001, 1e9, 1e-5
  flat = jax.device_put(np.arange(elements, dtype=np.float32), jax.devices()[0])
  rng = np.random.default_rng(0)
  for n in range(2, 9):
    cut = cut_and_join(elements, n)[0](flat)
    assert [c.shape[0] for c in cut] == [ring.piece_elements(elements, n)] * n
    np.testing.assert_array_equal(np.concatenate(cut)[:elements], np.asarray(flat))
    own = rng.normal(size=(n, n)).astype(np.float32)  # each member's chunks
    chunks, sent = own.copy(), [0] * n
    for hop in range(2 * (n - 1)):
      msgs = [chunks[r][ring.hops(r, n)[hop][0]] for r in range(n)]
      for r in range(n):
        _, recv, gather = ring.hops(r, n)[hop]
        got = msgs[(r - 1) % n]  # the predecessor's send, which is r's receive
        chunks[r][recv] = got if gather else got + own[r][recv]
        sent[(r - 1) % n] += 1
    np.testing.assert_allclose(chunks[0], own.sum(0), rtol=1e-5)
    assert all(np.array_equal(chunks[r], chunks[0]) for r in range(n))
    size = ring.piece_elements(elements, n) * 4
    assert [s * size for s in sent] == [ring.bytes_sent(elements, n)] * n
    assert ring.bytes_sent(n * 8, n) == 2 * (n - 1) / n * n * 8 * 4
    assert ring.seconds(elements, n, bw, lat) == pytest.approx(
      2 * (n - 1) * (size / bw + lat))
  for per_process in [(2, 2), (4, 4, 4), (4, 3), (3, 1, 2), (1, 1, 1), (5,), (8, 7, 8)]:
    _replay_two_level(elements, per_process, rng)
  # Pieces: the most members a process holds where that splits evenly; after a loss a multiple
  # of it that keeps every device within `BALANCE` of its share (8 a host, one lost: 24 pieces,
  # at most 4 on one of the 7 devices, where 8 pieces put 2 on one: 1.75x its share).
  assert ring.pieces_for((8, 8, 8)) == 8 and ring.pieces_for((5,)) == 5
  assert ring.pieces_for((8, 7, 8)) == 24 and ring.two_level(elements, (8, 7, 8)).rings == 4
  for per_process in [(8, 7), (8, 6), (8, 7, 6, 5), (4, 3), (3, 1, 2), (16, 15), (6, 4)]:
    k = ring.pieces_for(per_process)
    assert k % max(per_process) == 0 and k <= ring.MAX_PIECES, per_process
    worst = max(-(-k // m) * m / k for m in per_process)
    assert worst <= ring.BALANCE or k + max(per_process) > ring.MAX_PIECES, per_process


def _replay_two_level(elements, per_process, rng):
  """Replays `ring.two_level` on numbers, counting every device's bytes as the runtime moves
  them (`Transport.scatter_sum`, `ProcessTransport._ring`, `Transport.all_gather`)."""
  import numpy as np

  from resilient_jax.schedule import ring

  plan = ring.two_level(elements, per_process)
  k, p = plan.pieces, len(per_process)
  grads = [rng.normal(size=(m, k)).astype(np.float32) for m in per_process]  # pieces a member
  local = [[0] * m for m in per_process]  # bytes each device sends to its process's others
  network = [[0] * m for m in per_process]
  sums = []
  for i, m in enumerate(per_process):  # piece c summed on member c mod m
    for c in range(k):
      for d in range(m):
        local[i][d] += plan.piece_bytes * (d != c % m)
    sums.append(grads[i].sum(0))
  for c in range(k):  # piece c's ring over the processes, from each one's owner of it
    for i, m in enumerate(per_process):
      network[i][c % m] += ring.bytes_sent(plan.piece_bytes // 4, p)
  for i, m in enumerate(per_process):  # each owner copies its sums to the others
    for c in range(k):
      local[i][c % m] += plan.piece_bytes * (m - 1)
  total = sum(sums)
  np.testing.assert_allclose(total, np.concatenate(grads).sum(0), rtol=1e-5)
  assert max(max(x) for x in local) == plan.device_bytes, per_process
  assert max(max(x) for x in network) == plan.network_bytes, per_process
  assert all(sum(x) == plan.process_network_bytes for x in network), per_process
  assert plan.piece_bytes == ring.piece_elements(elements, k) * 4


def test_profile_round_trip_and_errors(tmp_path, costs):
  path = tmp_path / "profile.json"
  save_profile(costs, path)
  again = load_profile(path)
  assert again.op_costs((4,) * 4) == costs.op_costs((4,) * 4)
  bad = dict(PROFILE, b=[1.0, 2.0])
  (tmp_path / "bad.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match="profile.b has 2 entries"):
    load_profile(tmp_path / "bad.json")
  (tmp_path / "neg.json").write_text(json.dumps(dict(PROFILE, comm=-1)))
  with pytest.raises(ValueError, match="profile.comm"):
    load_profile(tmp_path / "neg.json")
  with pytest.raises(ValueError, match="missing ar"):
    CostModel.from_profile({k: v for k, v in PROFILE.items() if k != "ar"})


def test_predict_relative_throughput_from_a_measured_profile(costs):
  assert predict_relative_throughput(PROFILE, 4, 4, 4, []) == 1.0
  failed = [(1, 2)]
  grid = Grid(4, 4, 4)
  op = costs.op_costs(grid.live_per_stage(failed))
  sched = adaptive.plan("adaptive", FailureState(4, 4, 4, failed), op, base="zb-h1")
  t1 = simulate(sched, op).makespan
  t0 = simulate(generate("zb-h1", 4, 4, 4), costs.op_costs((4,) * 4)).makespan
  assert predict_relative_throughput(PROFILE, 4, 4, 4, failed) == pytest.approx(t0 / t1)
  big = predict_relative_throughput(PROFILE, 512, 4, 8, [(7, 3)])
  assert 0.5 < big <= 1.0
  with pytest.raises(ValueError, match="unknown policy"):
    predict_relative_throughput(PROFILE, 4, 4, 4, failed, policy="nope")


# --- traces ---------------------------------------------------------------------------------


def test_poisson_trace_rate_and_repairs():
  nodes, dpn, hours = 64, 8, 1000.0
  trace = poisson_trace(
    nodes=nodes,
    devices_per_node=dpn,
    duration_s=hours * 3600,
    device_mtbf_s=50_000 * 3600,
    node_mtbf_s=400_000 * 3600,
    repair_s=3600.0,
    seed=3,
  )
  expected = hours * (nodes * dpn / 50_000 + nodes / 400_000)
  assert abs(trace.failures - expected) < 4 * math.sqrt(expected)
  down: dict[tuple[int, int], float] = {}
  for e in trace.events:
    key = (e.node, e.device)
    if e.kind == "fail":
      assert key not in down
      down[key] = e.time_s
    else:
      assert e.time_s == pytest.approx(down.pop(key) + 3600.0)
  assert [e.time_s for e in trace.events] == sorted(e.time_s for e in trace.events)


def test_csv_trace_round_trip_and_errors(tmp_path):
  trace = poisson_trace(
    nodes=4, devices_per_node=8, duration_s=3600 * 10, device_mtbf_s=3600 * 20, repair_s=1800
  )
  path = tmp_path / "t.csv"
  write_csv_trace(trace, path)
  again = read_csv_trace(path, nodes=4, devices_per_node=8, duration_s=trace.duration_s)
  assert [(round(e.time_s, 3), e.kind, e.node, e.device) for e in trace.events] == [
    (round(e.time_s, 3), e.kind, e.node, e.device) for e in again.events
  ]
  (tmp_path / "bad.csv").write_text("time,event,node\n10,fail,1\n20,explode,1\n")
  with pytest.raises(TraceError, match=r"bad.csv:3: event 'explode'"):
    read_csv_trace(tmp_path / "bad.csv", nodes=4, devices_per_node=8)
  (tmp_path / "node.csv").write_text("10,fail,9\n")
  with pytest.raises(TraceError, match="node 9 is outside"):
    read_csv_trace(tmp_path / "node.csv", nodes=4, devices_per_node=8)


def test_failure_tracker_maps_devices_and_nodes_to_workers():
  # Pipeline placement, 8 stages x 1 device: node n is pipeline n.
  lay = Layout(dp=4, pp=8, devices_per_node=8)
  tracker = FailureTracker(lay)
  assert tracker.apply(Event(1.0, "fail", 2)) == {(2, s) for s in range(8)}
  assert tracker.apply(Event(2.0, "fail", 2, 5)) == {(2, s) for s in range(8)}
  assert tracker.apply(Event(3.0, "rejoin", 2)) == {(2, 5)}  # its own device is still down
  assert tracker.apply(Event(4.0, "rejoin", 2, 5)) == set()
  # Stage placement, tp=4: a node is two workers of one stage.
  lay = Layout(dp=4, pp=2, tp=4, devices_per_node=8, placement="stage")
  tracker = FailureTracker(lay)
  assert tracker.apply(Event(1.0, "fail", 3)) == {(2, 1), (3, 1)}
  assert tracker.apply(Event(2.0, "fail", 0, 6)) == {(2, 1), (3, 1), (1, 0)}


def test_trace_accounting_pauses_and_rollbacks(costs):
  lay = Layout(dp=4, pp=4, microbatches=4, devices_per_node=4)  # node d = pipeline d
  params = RecoveryParams(
    detect_s=30.0, regroup_s=10.0, restart_s=600.0, checkpoint_interval_s=1000.0
  )
  trace = Trace(
    10_000.0, (Event(2500.0, "fail", 1, 2), Event(6000.0, "rejoin", 1, 2)), lay.nodes, 4
  )
  policies = build_policies(["recycle", "restart"], params=params)
  result = run_trace(lay, costs, policies, trace, checkpoint_interval_s=1000.0)
  grid = Grid(4, 4, 4)
  batch = lay.global_batch
  t0 = policies["recycle"].step_time(grid, frozenset(), costs)
  assert policies["restart"].step_time(grid, frozenset(), costs) == t0
  t1 = policies["recycle"].step_time(grid, frozenset({(1, 2)}), costs)
  pause = 30 + 10 + t0 / 2
  expect = batch * (2500 / t0 + (3500 - pause) / t1 + (4000 - 10) / t0)
  assert result.policies["recycle"].samples == pytest.approx(expect)
  # Restart: loses 2000..2500 (checkpoint at 2000), restarts for 630 s on 3 pipelines, then a
  # planned restart of 600 s when the device is back.
  r1 = policies["restart"].step_time(grid, frozenset({(1, 2)}), costs)
  run = result.policies["restart"]
  expect = batch * (2000 / t0 + (3500 - 630) / r1 + (4000 - 600) / t0)
  assert run.samples == pytest.approx(expect)
  assert run.lost_s == pytest.approx(500.0) and run.paused_s == pytest.approx(1230.0)


# --- policies -------------------------------------------------------------------------------


def test_policy_registry(costs):
  everything = build_policies()
  assert set(everything) == {"recycle", "naive", "oobleck", "bamboo", "restart", "auto"}
  everything.pop("oobleck")  # needs the spec cost model
  with pytest.raises(ValueError, match="unknown policy"):
    build_policies(["fast"])
  with pytest.raises(PolicyUnavailableError, match="needs per-layer memory"):
    build_policies(["oobleck"])["oobleck"].check(Grid(2, 2, 2), costs)
  grid = Grid(8, 4, 4)
  failed = frozenset({(0, 3), (1, 3), (2, 3), (3, 3), (4, 3)})
  auto = everything["auto"]
  times = {n: p.step_time(grid, failed, costs) for n, p in everything.items() if n != "auto"}
  assert auto.step_time(grid, failed, costs) <= min(times.values()) * 1.01
  assert auto.step_time(grid, failed, costs) in times.values()


@pytest.mark.parametrize("duration_s", [3_000.0, 200_000.0])
def test_auto_switches_only_when_the_switch_pays_back(costs, duration_s):
  """Five workers of the last stage fail in a row. Restarting on fewer, fuller pipelines is the
  fastest steady state, but a restart costs 630 s and a rollback: with events every 600 s on
  average it never pays back and `auto` keeps going in place; with events 40000 s apart it does,
  and `auto` restarts. Either way no single policy trains more."""
  lay = Layout(dp=8, pp=4, microbatches=4, devices_per_node=4)
  params = RecoveryParams(
    detect_s=30.0, regroup_s=10.0, restart_s=600.0, checkpoint_interval_s=1000.0
  )
  trace = Trace(duration_s, tuple(Event(100.0 + d, "fail", d, 3) for d in range(5)), lay.nodes, 4)
  policies = build_policies(["recycle", "naive", "bamboo", "restart", "auto"], params=params)
  result = run_trace(lay, costs, policies, trace, checkpoint_interval_s=1000.0)
  runs = result.policies
  best_single = max(run.samples for name, run in runs.items() if name != "auto")
  assert runs["auto"].samples >= best_single * (1 - 1e-9)
  restarted = runs["auto"].paused_s >= params.restart_s
  assert restarted == (duration_s > 100_000)
  if not restarted:
    assert runs["auto"].samples > runs["restart"].samples


@pytest.mark.parametrize(
  "failed",
  [set(), {(1, 2)}, {(0, 0), (3, 2)}, {(1, 1), (1, 3), (2, 0)}, {(0, 1), (2, 1), (3, 1)}],
)
def test_bamboo_reduction_is_exact(costs, failed):
  grid = Grid(4, 4, 4, base="1f1b")
  failed = frozenset(failed)
  op = costs.op_costs(grid.live_per_stage(failed))
  bamboo = build_policies(["bamboo"])["bamboo"]
  assert bamboo.step_time(grid, failed, costs) == pytest.approx(
    bamboo_step_time(4, 4, 4, op, failed, base="1f1b"), rel=1e-12
  )


def test_bamboo_adjacent_failures_restart(costs):
  grid = Grid(4, 4, 4)
  policies = build_policies(["bamboo", "restart"])
  failed = frozenset({(2, 1), (2, 2)})
  assert policies["bamboo"].step_time(grid, failed, costs) == policies["restart"].step_time(
    grid, failed, costs
  )
  move = Transition(grid, frozenset({(2, 1)}), failed, costs, 1.0)
  assert policies["bamboo"].recovery(move).rollback


def test_oobleck_adapter_uses_the_oobleck_planner():
  model = ModelSpec("gpt", num_layers=8, d_model=1024, num_heads=8, seq_len=512, vocab_size=1000)
  device = DeviceSpec("d", peak_tflops=100.0, hbm_gbps=1000.0, memory_gb=2.0, efficiency=0.5)
  lay = Layout(dp=4, pp=4, microbatches=4, devices_per_node=4)
  spec = CostModel.from_specs(model, device, NetworkSpec(100.0, 10.0, 1.0, 5.0), lay)
  grid = Grid(4, 4, 4, base="1f1b")
  oob = build_policies(["oobleck"])["oobleck"]
  failed = frozenset({(1, 2)})
  inst = oob.plan(grid, failed, spec)
  assert sum(len(p.nodes) for p in inst.pipelines) == 15
  assert sum(p.microbatches for p in inst.pipelines) == 16  # the global batch is kept
  expect = oobleck_step_time(
    inst, base="1f1b", comm=spec.comm, allreduce_bandwidth=spec.ar_bandwidth
  )
  assert oob.step_time(grid, failed, spec) == expect
  with pytest.raises(PolicyUnavailableError, match="per-layer memory"):
    oob.check(grid, CostModel.from_profile(PROFILE))


def test_stage_lost_falls_back_to_restart(costs):
  grid = Grid(2, 4, 4)
  failed = frozenset({(0, 1), (1, 1)})
  policies = build_policies(["recycle", "restart"])
  assert policies["recycle"].step_time(grid, failed, costs) == policies["restart"].step_time(
    grid, failed, costs
  )
  rec = policies["recycle"].recovery(Transition(grid, frozenset({(0, 1)}), failed, costs, 1.0))
  assert rec.rollback


# --- configs and the launcher ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt3_1_3b", "gpt3_2_7b", "gpt3_6_7b", "gpt3_175b"])
def test_configs_load_at_every_size(name):
  for variant in ("", ":runlocal", ":1024", ":16384"):
    cfg = from_config_dict(load_config_file(f"{ROOT}/configs/sim/{name}.py{variant}"))
    assert cfg.layout.dp >= 2
  small = ":64" if name != "gpt3_175b" else ":256"
  assert from_config_dict(load_config_file(f"{ROOT}/configs/sim/{name}.py{small}"))
  with pytest.raises(SimConfigError, match="devices must be"):
    load_config_file(f"{ROOT}/configs/sim/{name}.py:100")


def test_run_simulation_writes_results(tmp_path):
  cfg = from_config_dict(load_config_file(f"{ROOT}/configs/sim/gpt3_6_7b.py:runlocal"))
  results = run_simulation(cfg, tmp_path, log=lambda _: None)
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["rows"] and set(saved["rows"][0]) >= {
    "policy",
    "failures",
    "throughput",
    "fault_free_throughput",
    "bound",
  }
  for row in saved["rows"]:
    assert row["bound"] == pytest.approx(
      min(1, (4 + 4 - 1) * (2 - row["failures"]) / (4 * 2)) if row["failures"] < 2 else 0
    )
  assert set(results["trace"]["policies"]) == set(build_policies())
  assert (tmp_path / "sim_trace.png").stat().st_size > 10_000
  assert (tmp_path / "sim_failures.png").stat().st_size > 10_000
  # TensorBoard: the sweep per policy against the failure count, and the trace's summary.
  for name in results["trace"]["policies"]:
    rows = [r for r in saved["rows"] if r["policy"] == name]
    assert scalars(tmp_path / "tb", f"sweep/{name}/relative") == [
      (r["failures"], pytest.approx(r["relative"], rel=1e-6)) for r in rows]
  [(_, summary)] = texts(tmp_path / "tb", "trace")
  assert summary.startswith(results["trace"]["summary"])


def _launch(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "launch.simulate", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_launcher_end_to_end(tmp_path):
  proc = _launch("--config=configs/sim/gpt3_1_3b.py:runlocal", f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "relative throughput" in proc.stdout and "recycle" in proc.stdout
  assert (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
  "args,needle",
  [
    (["--config.parallel.pp=0"], "parallel.pp"),
    (["--config.sim.policies=recycle,fast"], "sim.policies"),
    (["--config.trace.csv=/nonexistent.csv"], "/nonexistent.csv"),
    (["--config.profile.path=/nonexistent.json"], "/nonexistent.json"),
    (["--config.sweep.failures=0,9"], "sweep.failures"),
    (["--config.cluster.placement=diagonal"], "cluster.placement"),
    (["--config.nope=1"], "nope"),
  ],
)
def test_launcher_bad_input_is_one_line_exit_2(tmp_path, args, needle):
  proc = _launch("--config=configs/sim/gpt3_6_7b.py:runlocal", f"--out={tmp_path}", *args)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  err = proc.stderr.strip().splitlines()
  assert len(err) == 1 and needle in err[0], proc.stderr
  assert "Traceback" not in proc.stderr


def test_simulator_does_not_import_jax():
  code = (
    "import sys; import resilient_jax.sim, launch.simulate, resilient_jax.schedule.adaptive; "
    "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; "
    "assert not bad, bad"
  )
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr


def test_the_docs_simulator_tables_are_a_fresh_run():
  """The simulator tables of docs/ are `benchmarks/readme_tables.py`'s. A full run costs too much
  CPU for the suite, so each block's mark carries a canary, the digest of its configs'
  `:runlocal` results (every policy's sweep, trace and goodput on a tiny grid): a change of the
  simulator's output changes a fresh canary and fails here until the tables are regenerated.
  The fault-free row of GPT-3 6.7B's table is checked against its full config outright."""
  from benchmarks import readme_tables as tables

  blocks = {name: m for name, (_, m) in tables.document_blocks().items()}
  assert sorted(blocks) == sorted(tables.BLOCKS)
  rerun = "the simulator's output changed: python benchmarks/readme_tables.py --write"
  for name, (configs, _) in tables.BLOCKS.items():
    assert blocks[name]["canary"] == tables.canary(configs), f"{name}: {rerun}"
  row = tables.fault_free_row(tables.fault_free_rows("gpt3_6_7b"))
  assert row in blocks["sim-gpt3_6_7b"]["body"].splitlines(), rerun
