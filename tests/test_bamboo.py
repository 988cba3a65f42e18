"""Bamboo: redundant forwards (FR) in every step, and failover onto the predecessor stage."""

from __future__ import annotations

import itertools

import pytest

from resilient_jax.schedule.bamboo import (
  BambooUnrecoverableError,
  bamboo_schedule,
  bamboo_set,
  bamboo_step_time,
)
from resilient_jax.schedule.core import AR, BW, FR, B, F, Op, dependencies, make_schedule
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.plan import step_program
from resilient_jax.schedule.price import replay_program
from resilient_jax.schedule.validate import validate

COSTS = [
  OpCosts(f=1.0, b=1.0, w=1.0),
  OpCosts(f=1.0, b=1.5, w=0.5, ar=0.5, opt=0.2, comm=0.1),
  OpCosts(f=(1.0, 2.0, 1.0, 0.5), b=(1.0, 2.0, 1.5, 1.0), w=(0.5, 1.0, 1.0, 0.5)),
]


_SHAPES = [(1, 2, 1), (2, 4, 8), (1, 4, 3), (3, 3, 5)]
_CASES = [
  (dp, pp, m, ci)
  for dp, pp, m in _SHAPES
  for ci, c in enumerate(COSTS)
  if not isinstance(c.f, tuple) or len(c.f) == pp
]


@pytest.mark.parametrize("base", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("dp,pp,m,ci", _CASES)
def test_fault_free_bamboo_is_valid_and_costs_show(base, dp, pp, m, ci):
  costs = COSTS[ci]
  s = bamboo_schedule(dp, pp, m, base, costs)
  report = validate(s)
  plain = generate(base, dp, pp, m)
  for w, ops in s.ops.items():
    # The base schedule with one FR per micro-batch, before that micro-batch's backward.
    assert [op for op in ops if op.kind != FR] == list(plain.ops[w])
    frs = [op.mb for op in ops if op.kind == FR]
    assert sorted(frs) == s.microbatches_of(w)
    pos = {op: i for i, op in enumerate(ops)}
    for mb in frs:
      back = pos.get(Op(B, mb), pos.get(Op(BW, mb)))
      assert pos[Op(FR, mb)] < back
      if w[1] < pp - 1:
        assert pos[Op(F, mb)] < pos[Op(FR, mb)]
  assert report.max_peak_redundant >= 1
  assert report.peak_inflight == validate(plain).peak_inflight
  # Redundancy costs compute in every step. Idle bubbles hide some of it; with m >= pp the
  # steady state has none left, and the makespan grows.
  tl, base_tl = simulate(s, costs), simulate(plain, costs)
  extra = sum(costs.fr_at(w[1]) * len(s.microbatches_of(w)) for w in s.workers)
  assert sum(tl.busy.values()) == pytest.approx(sum(base_tl.busy.values()) + extra)
  assert tl.makespan >= base_tl.makespan
  if m >= pp:
    assert tl.makespan > base_tl.makespan


def test_fr_placement_fills_bubbles_before_delaying():
  costs = OpCosts(f=1.0, b=1.0, w=1.0)
  s = bamboo_schedule(1, 4, 8, "1f1b", costs)
  # Stage 0 waits for its first backward after its warmup: its first FRs fit that gap; the last
  # stage's FRs (stage 0's forward on the data) fill its wait for the first forward.
  assert s.ops[(0, 0)][:8] == tuple(Op(F, i) for i in range(4)) + tuple(Op(FR, i) for i in range(4))
  assert s.ops[(0, 3)][:3] == (Op(FR, 0), Op(FR, 1), Op(FR, 2))
  plain = simulate(generate("1f1b", 1, 4, 8), costs).makespan
  assert plain < simulate(s, costs).makespan < plain + 8 * 1.0


def test_fr_op_kind_dependencies_and_costs():
  s = bamboo_schedule(1, 3, 2)
  assert list(dependencies(s, (0, 1), Op(FR, 1))) == [((0, 1), Op(F, 1))]
  assert list(dependencies(s, (0, 2), Op(FR, 1))) == []  # stage 0's forward reads the data
  c = OpCosts(f=(1.0, 2.0, 3.0))
  assert [c.fr_at(i) for i in range(3)] == [2.0, 3.0, 1.0]  # the successor's, on a ring
  assert c.duration((0, 2), Op(FR, 0)) == 1.0
  assert OpCosts(f=2.0).fr_at(5) == 2.0
  assert OpCosts(f=(1.0, 2.0), fr=(5.0, 6.0)).fr_at(1) == 6.0
  with pytest.raises(ValueError):
    Op(FR)  # a compute op needs its micro-batch
  with pytest.raises(ValueError):
    OpCosts(fr=(1.0, 2.0)).check_stages(3)


def _with_ops(s, worker, ops):
  per = {w: list(v) for w, v in s.ops.items()}
  per[worker] = ops
  return make_schedule(s.name, s.dp, s.pp, s.microbatches, per, s.route)


def test_validate_rejects_misplaced_fr():
  s = bamboo_schedule(1, 3, 2)
  ops = [op for op in s.ops[(0, 1)] if op != Op(FR, 0)]
  ops.insert(0, Op(FR, 0))
  with pytest.raises(ScheduleError, match="FR0 runs before F0"):
    validate(_with_ops(s, (0, 1), ops))
  ops = [op for op in s.ops[(0, 1)] if op != Op(FR, 1)] + [Op(FR, 1)]
  with pytest.raises(ScheduleError, match="AR runs before FR1"):
    validate(_with_ops(s, (0, 1), ops))
  ops = list(s.ops[(0, 1)])
  ops.insert(ops.index(Op(AR)), Op(FR, 5))
  with pytest.raises(ScheduleError, match="not routed here"):
    validate(_with_ops(s, (0, 1), ops))


def _replayed(plan, costs):
  return replay_program(step_program(plan), costs.duration, comm=costs.comm)


@pytest.mark.parametrize("base", ["1f1b", "zb-h1"])
def test_single_failures_fail_over_to_the_predecessor(base):
  dp, pp, m = 2, 4, 6
  costs = COSTS[1]
  healthy = bamboo_step_time(dp, pp, m, costs, base=base)
  # Fault-free, the set is `bamboo_schedule`'s grid: the same step time by either replay.
  assert healthy == pytest.approx(simulate(bamboo_schedule(dp, pp, m, base, costs), costs).makespan)
  for d, s in itertools.product(range(dp), range(pp)):
    plan = bamboo_set(dp, pp, m, [(d, s)], costs=costs, base=base)
    pipe, host = plan.pipelines[d], (s - 1) % pp
    assert pipe.nodes[s] == pipe.nodes[host] == d * pp + host
    assert len(set(pipe.nodes)) == pp - 1
    # Neither the host nor the stage it took over keeps a replica; every other stage does.
    assert [pipe.replica_of(x) is None for x in range(pp)] == [x in (host, s) for x in range(pp)]
    validate(pipe.schedule)
    other = plan.pipelines[1 - d]
    assert other.nodes == tuple((1 - d) * pp + x for x in range(pp))
    assert all(other.replica_of(x) == (x + 1) % pp for x in range(pp))
    # The host does two stages' work: the step slows down.
    step = bamboo_step_time(dp, pp, m, costs, [(d, s)], base=base)
    assert step > healthy
    assert step == _replayed(plan, costs).makespan


def test_a_shared_node_runs_one_op_at_a_time_in_each_slots_order():
  costs = OpCosts(f=1.0, b=1.5, w=0.5, ar=0.5, opt=0.2, comm=0.1)
  plan = bamboo_set(1, 4, 8, [(0, 1)], costs=costs)
  sp = step_program(plan)
  tl = _replayed(plan, costs)
  by_node = {}
  for span in tl.spans:
    by_node.setdefault(sp.slots[span.worker].node, []).append(span)
  assert sorted(len({x.worker for x in spans}) for spans in by_node.values()) == [1, 1, 2]
  for spans in by_node.values():
    spans.sort(key=lambda x: x.start)
    assert all(a.end <= b.start + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
  end = {(x.worker, x.op): x.end for x in tl.spans}
  start = {(x.worker, x.op): x.start for x in tl.spans}
  for slot, prog in sp.slots.items():
    assert [x.op for x in tl.spans if x.worker == slot] == list(prog.ops)
    for op in prog.ops:
      for dep in sp.dependencies(slot, op):
        assert start[(slot, op)] >= end[dep] - 1e-12
  # The host's two stages cost at least their merged work, and the FR no longer hidden.
  host_busy = sum(tl.busy[slot] for slot in sp.slots if sp.slots[slot].node == 0)
  assert tl.makespan >= host_busy


def test_non_adjacent_failures_recover_adjacent_ones_raise():
  dp, pp, m = 3, 6, 4
  costs = OpCosts(f=1.0, b=2.0, w=0.0)
  times = [bamboo_step_time(dp, pp, m, costs)]
  failures = [(0, 1), (0, 3), (0, 5), (1, 0), (2, 2)]
  for k in range(1, len(failures) + 1):
    plan = bamboo_set(dp, pp, m, failures[:k], costs=costs)
    for p in plan.pipelines:
      validate(p.schedule)
    times.append(_replayed(plan, costs).makespan)
  print("\nbamboo step times, 3x6 m=4, 0..5 failures:", [round(t, 2) for t in times])
  assert times[1] > times[0]
  assert [len(set(p.nodes)) for p in plan.pipelines] == [3, 5, 5]
  for bad in ([(0, 1), (0, 2)], [(1, 0), (1, 5)], [(2, 3), (2, 4), (0, 0)]):
    with pytest.raises(BambooUnrecoverableError, match="cannot recover"):
      bamboo_set(dp, pp, m, bad)
  with pytest.raises(BambooUnrecoverableError):
    bamboo_set(1, 2, 2, [(0, 0), (0, 1)])
  # pp=2: the survivor runs both stages alone.
  plan = bamboo_set(1, 2, 2, [(0, 0)])
  assert plan.pipelines[0].nodes == (1, 1)
  validate(plan.pipelines[0].schedule)
  assert _replayed(plan, OpCosts()).makespan > bamboo_step_time(1, 2, 2, OpCosts())


def test_bad_shapes():
  with pytest.raises(ValueError, match="pp >= 2"):
    bamboo_schedule(1, 1, 4)
  with pytest.raises(ValueError, match="outside"):
    bamboo_set(2, 3, 2, [(2, 0)])
  with pytest.raises(ValueError):
    bamboo_schedule(1, 3, 2, costs=OpCosts(f=(1.0, 2.0)))
