"""Oobleck planning: templates by DP (against brute force), f+1 instantiation, re-instantiation."""

from __future__ import annotations

import random

import pytest

from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.generators import generate, one_f_one_b
from resilient_jax.schedule.oobleck import (
  InstantiationError,
  LayerProfile,
  LayersLostError,
  OobleckInstance,
  PipelineInstance,
  brute_force_partition,
  distribute_microbatches,
  fault_tolerance_gaps,
  instantiate,
  oobleck_recovery_cost,
  oobleck_step_time,
  pipeline_schedules,
  plan_templates,
  reinstantiate,
  stage_costs,
)


def _random_profile(rng: random.Random, n: int, overhead: bool = True) -> LayerProfile:
  return LayerProfile(
    forward=[rng.uniform(0.1, 3.0) for _ in range(n)],
    backward_input=[rng.uniform(0.1, 3.0) for _ in range(n)],
    backward_weight=[rng.uniform(0.0, 3.0) for _ in range(n)],
    param_bytes=[rng.uniform(1, 10) for _ in range(n)],
    state_bytes=[rng.uniform(1, 10) for _ in range(n)],
    activation_bytes=[rng.uniform(0, 4) for _ in range(n)],
    stage_overhead=rng.uniform(0, 0.5) if overhead else 0.0,
    stage_bytes=rng.uniform(0, 2),
  )


def _covers(stages, n: int) -> bool:
  return (
    stages[0][0] == 0
    and stages[-1][1] == n
    and all(
      a[1] == b[0] and a[0] < a[1] for a, b in zip(stages, stages[1:] + ((n, n + 1),), strict=True)
    )
  )


@pytest.mark.parametrize("seed", range(12))
def test_dp_partition_matches_brute_force(seed):
  rng = random.Random(seed)
  profile = _random_profile(rng, rng.randint(1, 8), overhead=seed % 2 == 0)
  n = profile.num_layers
  for m in (1, 2, 3, 8):
    # Unbounded memory, then a cap that makes some (or all) splits infeasible.
    all_mem = [
      profile.stage_memory(lo, hi, j)
      for lo in range(n)
      for hi in range(lo + 1, n + 1)
      for j in range(1, 5)
    ]
    for cap in (None, sorted(all_mem)[len(all_mem) // 3], sorted(all_mem)[len(all_mem) // 10]):
      try:
        templates = plan_templates(profile, 1, 4, cap, microbatches=m)
      except InstantiationError:
        templates = None
      for k in range(1, min(4, n) + 1):
        brute = brute_force_partition(profile, k, m, cap)
        if brute is None:
          assert templates is None or k not in templates
          continue
        assert templates is not None and k in templates, (seed, m, cap, k)
        t = templates[k]
        assert t.num_nodes == k and _covers(t.stages, n)
        assert t.iteration_time(m) == pytest.approx(brute[0], rel=1e-9, abs=1e-9)
        if cap is not None:
          assert max(t.stage_memory) <= cap


def test_templates_skip_node_counts_above_layers_and_that_do_not_fit():
  profile = LayerProfile.uniform(6, state_bytes=10.0, activation_bytes=1.0)
  ts = plan_templates(profile, 1, 100)
  assert ts.sizes == [1, 2, 3, 4, 5, 6]
  assert ts[3].stages == ((0, 2), (2, 4), (4, 6))
  assert ts[3].bottleneck == pytest.approx(6.0) and ts[3].latency == pytest.approx(18.0)
  # Three stages need two layers on stage 0: 20 bytes of state plus 3 stashed micro-batches of
  # 2 bytes, so they fit in 26 bytes but not in 25.
  assert min(plan_templates(profile, 1, 100, node_memory=26.0).sizes) == 3
  assert min(plan_templates(profile, 1, 100, node_memory=25.0).sizes) == 4
  with pytest.raises(InstantiationError, match="fits"):
    plan_templates(profile, 1, 100, node_memory=5.0)
  with pytest.raises(ValueError):
    plan_templates(profile, 3, 2)


def test_templates_1024_nodes_96_layers():
  # A GPT-3 175B-like block: 805M parameters (16 bytes each resident), 0.57 GB of stashed
  # activations per micro-batch, on 80 GB nodes.
  profile = LayerProfile.uniform(96, state_bytes=12.9e9, activation_bytes=0.57e9)
  ts = plan_templates(profile, 1, 1024, node_memory=80e9)
  inst = instantiate(ts, 1024, 2, 512)
  assert oobleck_step_time(inst) > 0
  new = reinstantiate(inst, [0, 500, 1000], ts)
  assert ts.sizes[-1] == 96 and all(max(ts[k].stage_memory) <= 80e9 for k in ts)
  assert ts.sizes[0] > 1  # a whole model does not fit on one node
  assert len(inst.nodes) == 1024 and inst.num_pipelines >= 3
  assert len(new.nodes) == 1021 and set(new.nodes).isdisjoint({0, 500, 1000})


def _coverable(sizes, n, min_count):
  # Independent check: sets of reachable pipeline counts per node count.
  reach = [set() for _ in range(n + 1)]
  reach[0].add(0)
  for x in range(1, n + 1):
    for s in sizes:
      if s <= x:
        reach[x] |= {c + 1 for c in reach[x - s]}
  return any(c >= min_count for c in reach[n])


@pytest.mark.parametrize("seed", range(25))
def test_f_plus_one_guarantee_randomized(seed):
  rng = random.Random(1000 + seed)
  profile = _random_profile(rng, rng.randint(3, 14))
  n = profile.num_layers
  lo = rng.randint(0, n - 1)
  cap = None if seed % 5 == 0 else max(profile.stage_memory(lo, lo + 1, n) * 1.5, 1.0)
  try:
    ts = plan_templates(profile, 1, 64, cap)
  except InstantiationError:
    return
  f = rng.randint(0, 3)
  n0 = ts.sizes[0]
  num_nodes = rng.randint(n0, (f + 1) * n0 + 30)
  gaps = fault_tolerance_gaps(ts, num_nodes, f)
  expected = [] if _coverable(ts.sizes, num_nodes, f + 1) else [num_nodes]
  expected += [num_nodes - k for k in range(1, f + 1) if not _coverable(ts.sizes, num_nodes - k, 1)]
  assert gaps == expected
  consecutive = ts.sizes == list(range(n0, ts.sizes[-1] + 1))
  if consecutive and ts.sizes[-1] >= 2 * n0 - 1 and num_nodes >= (f + 1) * n0:
    assert gaps == []  # Oobleck's theorem, adapted to one node per stage
  if num_nodes in gaps:
    with pytest.raises(InstantiationError):
      instantiate(ts, num_nodes, f, 1000)
    return
  total = rng.randint(num_nodes, 4 * num_nodes)
  inst = instantiate(ts, num_nodes, f, total)
  assert inst.nodes == list(range(num_nodes))
  assert inst.num_pipelines >= f + 1
  assert sum(p.microbatches for p in inst.pipelines) == total
  assert [p.first_microbatch for p in inst.pipelines] == [
    sum(q.microbatches for q in inst.pipelines[:i]) for i in range(inst.num_pipelines)
  ]
  for p in inst.pipelines:
    assert ts[p.template.num_nodes] == p.template
  for _ in range(4):
    k = rng.randint(1, max(f, 1))
    failed = rng.sample(range(num_nodes), k)
    if k <= f:
      # Each failure hits at most one pipeline: one of the f + 1 stays whole.
      assert any(set(p.nodes).isdisjoint(failed) for p in inst.pipelines)
    survivors = sorted(set(range(num_nodes)) - set(failed))
    if num_nodes - k in gaps:
      continue
    try:
      new = reinstantiate(inst, failed, ts)
    except LayersLostError:
      assert k > f
      continue
    assert new.nodes == survivors
    assert sum(p.microbatches for p in new.pipelines) == total
    assert new.num_pipelines >= min(f + 1, 1 + new.tolerate)
    cost = oobleck_recovery_cost(inst, new)
    assert cost.total_bytes >= 0 and set(cost.per_node) <= set(survivors)


def test_fault_tolerance_gaps_when_templates_leave_holes():
  # Templates of 4..6 nodes only (n1 < 2 * n0 - 1): 7 nodes cannot be covered.
  profile = LayerProfile.uniform(6, state_bytes=10.0, activation_bytes=1.0)
  ts = plan_templates(profile, 1, 6, node_memory=25.0)
  assert ts.sizes == [4, 5, 6]
  assert fault_tolerance_gaps(ts, 8, 1) == [7]
  assert fault_tolerance_gaps(ts, 11, 2) == [11]  # three pipelines need at least 12 nodes
  assert fault_tolerance_gaps(ts, 12, 2) == []  # 4 + 4 + 4, then 5 + 6 and 4 + 6
  inst = instantiate(ts, 8, 1, 16)
  assert [p.template.num_nodes for p in inst.pipelines] == [4, 4]
  with pytest.raises(InstantiationError, match="cannot be covered"):
    reinstantiate(inst, [3], ts)
  # 9 survivors: one 4 + one 5, back to two pipelines.
  inst = instantiate(ts, 10, 1, 16)
  new = reinstantiate(inst, [0], ts)
  assert sorted(p.template.num_nodes for p in new.pipelines) == [4, 5] and new.tolerate == 1


def test_distribution_is_exact_integer_and_proportional():
  rng = random.Random(7)
  for _ in range(200):
    q = rng.randint(1, 12)
    bottlenecks = [rng.uniform(0.5, 5.0) for _ in range(q)]
    total = rng.randint(q, 500)
    counts = distribute_microbatches(bottlenecks, total)
    assert all(isinstance(c, int) and c >= 1 for c in counts)
    assert sum(counts) == total
    speed = [1 / b for b in bottlenecks]
    shares = [total * s / sum(speed) for s in speed]
    if min(shares) >= 1:
      assert all(abs(c - x) < 1 for c, x in zip(counts, shares, strict=True))
  with pytest.raises(ValueError):
    distribute_microbatches([1.0, 1.0, 1.0], 2)


def _partitions(n, sizes, largest=None):
  if n == 0:
    yield ()
    return
  for s in sizes:
    if s <= n and (largest is None or s <= largest):
      for rest in _partitions(n - s, sizes, s):
        yield (s, *rest)


@pytest.mark.parametrize("seed", range(40))
def test_instantiate_matches_brute_force_combination(seed):
  # The combination search is a knapsack on an estimate of the step; on small cases it finds
  # the combination whose step (with the same batch distribution) is the true minimum.
  rng = random.Random(seed)
  ts = plan_templates(_random_profile(rng, rng.randint(2, 10)), 1, 10)
  n, f = rng.randint(2, 16), rng.randint(0, 2)
  total = rng.randint(n, 4 * n)
  best = None
  for combo in _partitions(n, ts.sizes):
    if f + 1 <= len(combo) <= total:
      chosen = [ts[k] for k in combo]
      counts = distribute_microbatches([t.bottleneck for t in chosen], total)
      step = max(t.iteration_time(c) for t, c in zip(chosen, counts, strict=True))
      best = step if best is None else min(best, step)
  if best is None:
    with pytest.raises(InstantiationError):
      instantiate(ts, n, f, total)
  else:
    assert instantiate(ts, n, f, total).step_time == pytest.approx(best, rel=1e-12)


def test_instantiate_redistributes_by_speed():
  profile = LayerProfile.uniform(8)
  ts = plan_templates(profile, 2, 8)
  inst = instantiate(ts, 10, 1, 60)
  speeds = [1 / p.template.bottleneck for p in inst.pipelines]
  for p, s in zip(inst.pipelines, speeds, strict=True):
    assert abs(p.microbatches - 60 * s / sum(speeds)) < 1
  with pytest.raises(InstantiationError):
    instantiate(plan_templates(profile, 4, 4), 10, 1, 60)  # 10 is no multiple of 4
  with pytest.raises(ValueError):
    instantiate(ts, 10, 1, 1)  # fewer micro-batches than the f + 1 pipelines


def test_recovery_cost_counts_layers_new_to_each_node():
  profile = LayerProfile.uniform(4, state_bytes=10.0)
  ts = plan_templates(profile, 1, 4)
  t2, t4 = ts[2], ts[4]
  old = OobleckInstance(
    (PipelineInstance(t4, (0, 1, 2, 3), 4), PipelineInstance(t2, (4, 5), 2, 4)), 1, 6, profile
  )
  # Node 1 (layer 1 of the 4-stage pipeline) died; the survivors 0, 2, 3 form a 3-stage one.
  new = reinstantiate(old, [1], ts)
  assert new.nodes == [0, 2, 3, 4, 5]
  before, after = old.layers_of(), new.layers_of()
  expected = {}
  for node, (lo, hi) in after.items():
    have = set(range(*before[node]))
    extra = len(set(range(lo, hi)) - have) * 10.0
    if extra:
      expected[node] = extra
  cost = oobleck_recovery_cost(old, new)
  assert cost.per_node == expected
  assert cost.total_bytes == sum(expected.values())
  # Both holders of layer 0 gone: nothing to copy it from.
  with pytest.raises(LayersLostError):
    reinstantiate(old, [0, 4], ts)
  with pytest.raises(ValueError):
    reinstantiate(old, [99], ts)
  assert reinstantiate(old, [], ts) is old


def test_step_time_is_the_cost_model_on_per_pipeline_schedules():
  profile = LayerProfile.uniform(8, forward=1.0, backward_input=1.0, backward_weight=0.5)
  ts = plan_templates(profile, 1, 8)
  # Homogeneous: the same as the DP x PP grid that ReCycle plans on, priced by stage_costs.
  t4 = ts[4]
  inst = OobleckInstance(
    tuple(PipelineInstance(t4, tuple(range(4 * i, 4 * i + 4)), 6, 6 * i) for i in range(3)),
    2,
    18,
    profile,
  )
  grid_costs = stage_costs(profile, t4.stages, replicas=3, allreduce_bandwidth=4.0, comm=0.1)
  grid = simulate(one_f_one_b(3, 4, 6), grid_costs).makespan
  assert oobleck_step_time(inst, comm=0.1, allreduce_bandwidth=4.0) == pytest.approx(grid)
  # Heterogeneous: the slowest pipeline's own simulated makespan.
  het = instantiate(ts, 11, 1, 40)
  spans = [simulate(s, c).makespan for _, s, c in pipeline_schedules(het, base="zb-h1")]
  assert oobleck_step_time(het, base="zb-h1") == pytest.approx(max(spans))
  for p, sched, _ in pipeline_schedules(het):
    assert sched.dp == 1 and sched.pp == p.template.num_stages
    assert sched.microbatches == p.microbatches
    assert sched.ops == generate("1f1b", 1, sched.pp, p.microbatches).ops


def test_instantiation_weighs_the_all_reduce():
  """A short pipeline's stages hold more of the model's gradients, so with the all-reduce
  priced its stages reduce longer. Templates planned with the all-reduce's bandwidth carry that
  tail (`PipelineTemplate.allreduce`) and the instance chosen weighs it: by the cost model
  (`oobleck_step_time`, all-reduce included) it is faster than the instance chosen on fill and
  drain alone (the shortest pipelines), and losing a node never makes it faster."""
  layers, nodes, bw = 32, 64, 1.0
  profile = LayerProfile(forward=[1.0] * layers, backward_input=[1.0] * layers,
                         backward_weight=[1.0] * layers, param_bytes=[20.0] * layers,
                         state_bytes=[1.0] * layers, activation_bytes=[0.0] * layers,
                         stage_overhead=0.1)
  blind = plan_templates(profile, 2, layers, microbatches=8)
  aware = plan_templates(profile, 2, layers, microbatches=8, allreduce_bandwidth=bw)
  assert all(t.allreduce == 0.0 for t in blind.templates.values())
  assert aware[4].allreduce == 2 * 8 * 20.0 / bw  # 8 layers a stage, twice their gradients
  step = lambda inst: oobleck_step_time(inst, allreduce_bandwidth=bw)  # noqa: E731
  before = instantiate(blind, nodes, 1, 256)
  after = instantiate(aware, nodes, 1, 256)
  assert {p.template.num_nodes for p in before.pipelines} == {2}
  assert min(p.template.num_nodes for p in after.pipelines) > 2
  assert step(after) < step(before)
  lost = reinstantiate(after, [after.pipelines[0].nodes[0]], aware)
  assert step(lost) >= step(after)
