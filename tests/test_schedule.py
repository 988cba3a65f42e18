"""Tests of the schedule package: generators, validator and cost model (pure Python, no JAX)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from resilient_jax.schedule import (
  AR,
  BW,
  OPT,
  B,
  F,
  Op,
  OpCosts,
  Schedule,
  ScheduleError,
  W,
  generate,
  gpipe,
  lower_bound,
  make_schedule,
  one_f_one_b,
  replay,
  simulate,
  validate,
  zb_h1,
)

NAMES = ("gpipe", "1f1b", "zb-h1")
SHAPES = [  # (dp, pp, m): pp=1, dp=1 and m < pp included
  (1, 1, 1),
  (1, 1, 4),
  (3, 1, 2),
  (1, 4, 2),
  (1, 4, 8),
  (2, 3, 5),
  (3, 2, 1),
  (4, 4, 4),
  (2, 8, 3),
  (2, 5, 11),
]
# (pp, m) with m >= pp, and (T_F, T_B, T_W) with T_W <= min(T_F, T_B): where the ZB paper's
# ZB-H1 bubble (pp-1)(T_F+T_B-T_W) is attainable within 1F1B's peak memory.
FORMULA_SHAPES = [(1, 3), (2, 2), (2, 7), (3, 3), (4, 4), (4, 8), (5, 9), (8, 16), (6, 20)]
FORMULA_COSTS = [
  (1.0, 1.0, 1.0),
  (1.0, 2.0, 1.0),
  (2.0, 1.0, 0.5),
  (1.5, 2.5, 0.75),
  (3.0, 3.0, 0.1),
]


def _replace_ops(schedule: Schedule, worker, ops) -> Schedule:
  new = dict(schedule.ops)
  new[worker] = tuple(ops)
  return dataclasses.replace(schedule, ops=new)


def _expected_ops(schedule: Schedule, worker) -> Counter:
  backward = (B, W) if schedule.name == "zb-h1" else (BW,)
  want = Counter({Op(AR): 1, Op(OPT): 1})
  for mb in schedule.microbatches_of(worker):
    want.update(Op(k, mb) for k in (F, *backward))
  return want


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dp,pp,m", SHAPES)
def test_generators_are_valid_and_complete(name, dp, pp, m):
  s = generate(name, dp, pp, m)
  assert (s.name, s.dp, s.pp, s.microbatches) == (name, dp, pp, m)
  assert s.workers == [(d, st) for d in range(dp) for st in range(pp)]
  report = validate(s)
  assert set(report.peak_inflight) == set(s.workers)
  for w in s.workers:
    ops = s.ops[w]
    assert Counter(ops) == _expected_ops(s, w), w  # every op exactly once
    assert ops[-2:] == (Op(AR), Op(OPT))
    assert s.microbatches_of(w) == list(range(w[0] * m, (w[0] + 1) * m))
    # Every pipeline runs the same pattern on its own micro-batch ids.
    shifted = tuple(Op(op.kind, op.mb - w[0] * m) if op.mb >= 0 else op for op in ops)
    assert shifted == s.ops[(0, w[1])]


def test_gpipe_and_1f1b_orders():
  g = gpipe(1, 2, 3)
  assert [str(op) for op in g.ops[(0, 0)]] == "F0 F1 F2 BW0 BW1 BW2 AR OPT".split()
  o = one_f_one_b(1, 3, 4)
  assert [str(op) for op in o.ops[(0, 0)]] == "F0 F1 F2 BW0 F3 BW1 BW2 BW3 AR OPT".split()
  assert [str(op) for op in o.ops[(0, 1)]] == "F0 F1 BW0 F2 BW1 F3 BW2 BW3 AR OPT".split()
  assert [str(op) for op in o.ops[(0, 2)]] == "F0 BW0 F1 BW1 F2 BW2 F3 BW3 AR OPT".split()


def test_generate_rejects_unknown_name_and_bad_shape():
  with pytest.raises(ValueError, match=r"unknown schedule 'zb-h2'.*'1f1b'.*'gpipe'.*'zb-h1'"):
    generate("zb-h2", 1, 2, 2)
  with pytest.raises(ValueError, match="pp must be a positive int"):
    gpipe(1, 0, 2)


@pytest.mark.parametrize("pp,m", FORMULA_SHAPES)
@pytest.mark.parametrize("tf,tb,tw", FORMULA_COSTS)
def test_bubble_formulas(pp, m, tf, tb, tw):
  costs = OpCosts(f=tf, b=tb, w=tw)
  work = m * (tf + tb + tw)
  ob = simulate(one_f_one_b(1, pp, m), costs)
  zb = simulate(zb_h1(1, pp, m), costs)
  assert ob.makespan == pytest.approx(work + (pp - 1) * (tf + tb + tw), abs=1e-9)
  assert zb.makespan == pytest.approx(work + (pp - 1) * (tf + tb - tw), abs=1e-9)
  # Every worker does the same work, so the idle share is bubble / makespan.
  assert ob.bubble_fraction == pytest.approx(1 - work / ob.makespan, abs=1e-9)
  # The grid does not change a fault-free step when AR and OPT are free.
  assert simulate(zb_h1(3, pp, m), costs).makespan == pytest.approx(zb.makespan, abs=1e-9)


@pytest.mark.parametrize("pp,m", [(4, 4), (4, 8), (6, 9)])
@pytest.mark.parametrize("tf,tb,tw", [(1.0, 1.0, 2.0), (1.0, 3.0, 2.0), (2.0, 0.5, 1.0)])
def test_zb_h1_makespan_when_w_is_slow(pp, m, tf, tb, tw):
  # Past T_W <= min(T_F, T_B) the paper's bubble is unattainable: the last stage idles
  # (pp-1)*T_F before its first F, and stage 0 (pp in flight) idles (pp-1)*T_B before its first
  # B. The schedule then meets the larger of those bounds.
  zb = simulate(zb_h1(1, pp, m), OpCosts(f=tf, b=tb, w=tw))
  want = m * (tf + tb + tw) + (pp - 1) * max(tf + tb - tw, tf, tb)
  assert zb.makespan == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (4, 2), (4, 4), (4, 8), (8, 12)])
def test_memory_peaks(pp, m):
  g, o, z = (validate(gen(2, pp, m)) for gen in (gpipe, one_f_one_b, zb_h1))
  assert set(g.peak_inflight.values()) == {m}
  for d, s in o.peak_inflight:
    assert o.peak_inflight[(d, s)] == min(pp - s, m)
  assert o.peak_inflight[(0, 0)] == min(pp, m)
  for w in o.peak_inflight:
    # ZB-H1 holds exactly 1F1B's pending activations (F done, B not) on every worker ...
    assert z.peak_activations[w] == o.peak_activations[w] == o.peak_inflight[w]
    # ... plus up to `stage` deferred Ws, which never takes a worker past 1F1B's stage-0 peak.
    assert z.peak_inflight[w] <= o.max_peak_inflight
  assert z.max_peak_inflight == o.max_peak_inflight == min(pp, m)
  validate(zb_h1(2, pp, m), memory_cap=min(pp, m))


# --- validator rejections -------------------------------------------------------------------


def test_rejects_backward_before_forward():
  s = one_f_one_b(1, 2, 2)
  ops = list(s.ops[(0, 1)])  # F0 BW0 F1 BW1 AR OPT
  ops[2], ops[3] = ops[3], ops[2]
  with pytest.raises(ScheduleError, match=r"worker \(0, 1\): BW1 runs before F1"):
    validate(_replace_ops(s, (0, 1), ops))


def test_rejects_w_before_b():
  s = zb_h1(1, 2, 2)
  ops = [op for op in s.ops[(0, 1)] if op != Op(W, 0)]
  ops.insert(ops.index(Op(B, 0)), Op(W, 0))
  with pytest.raises(ScheduleError, match=r"worker \(0, 1\): W0 runs before B0"):
    validate(_replace_ops(s, (0, 1), ops))


def test_rejects_dropped_op():
  s = zb_h1(2, 3, 3)
  ops = [op for op in s.ops[(1, 2)] if op != Op(W, 4)]
  with pytest.raises(ScheduleError, match=r"worker \(1, 2\): W4 is missing"):
    validate(_replace_ops(s, (1, 2), ops))
  ops = [op for op in s.ops[(1, 2)] if op != Op(F, 4)]
  with pytest.raises(ScheduleError, match=r"worker \(1, 2\): F4 is missing"):
    validate(_replace_ops(s, (1, 2), ops))
  ops = [op for op in s.ops[(0, 0)] if op != Op(OPT)]
  with pytest.raises(ScheduleError, match=r"worker \(0, 0\): OPT is missing"):
    validate(_replace_ops(s, (0, 0), ops))


def test_rejects_duplicate_op():
  s = one_f_one_b(1, 3, 4)
  ops = list(s.ops[(0, 1)])
  ops.insert(5, Op(F, 2))
  with pytest.raises(ScheduleError, match=r"worker \(0, 1\): F2 appears twice"):
    validate(_replace_ops(s, (0, 1), ops))
  with pytest.raises(ScheduleError, match=r"worker \(0, 1\) runs F2 twice"):
    simulate(_replace_ops(s, (0, 1), ops), OpCosts())


def test_rejects_mixed_backward_and_misplaced_ar_opt():
  s = zb_h1(1, 2, 2)
  ops = [Op(BW, 0) if op == Op(B, 0) else op for op in s.ops[(0, 0)]]
  with pytest.raises(ScheduleError, match="mb0 mixes BW0 with a split B/W backward"):
    validate(_replace_ops(s, (0, 0), ops))
  ops = list(s.ops[(0, 0)])
  ops.remove(Op(AR))
  ops.insert(0, Op(AR))
  with pytest.raises(ScheduleError, match=r"worker \(0, 0\): AR runs before W1"):
    validate(_replace_ops(s, (0, 0), ops))
  ops = list(s.ops[(0, 0)][:-2]) + [Op(OPT), Op(AR)]
  with pytest.raises(ScheduleError, match=r"worker \(0, 0\): OPT runs before AR"):
    validate(_replace_ops(s, (0, 0), ops))


def test_rejects_op_for_unrouted_microbatch():
  s = gpipe(2, 2, 2)
  ops = list(s.ops[(0, 1)])
  ops[:0] = [Op(F, 2)]  # mb2 belongs to pipeline 1
  with pytest.raises(ScheduleError, match=r"worker \(0, 1\): runs F2 but stage 1 of mb2 is not"):
    validate(_replace_ops(s, (0, 1), ops))


def test_rejects_cycle_between_two_workers():
  # Each list is locally fine, but stage 0 waits for BW0 from stage 1, which first wants F1,
  # which stage 0 only produces after BW0.
  s = one_f_one_b(1, 2, 2)
  s = _replace_ops(s, (0, 0), [Op(F, 0), Op(BW, 0), Op(F, 1), Op(BW, 1), Op(AR), Op(OPT)])
  s = _replace_ops(s, (0, 1), [Op(F, 1), Op(BW, 1), Op(F, 0), Op(BW, 0), Op(AR), Op(OPT)])
  msg = r"deadlock.*stuck at each worker's head: \(0, 0\):BW0, \(0, 1\):F1"
  with pytest.raises(ScheduleError, match=msg):
    validate(s)
  with pytest.raises(ScheduleError, match=msg):
    simulate(s, OpCosts())


def test_rejects_bad_routes():
  s = one_f_one_b(2, 2, 2)
  dead = dict(s.ops)
  del dead[(1, 1)]  # worker (1, 1) failed, but the route still sends mbs 2 and 3 there
  with pytest.raises(ScheduleError, match=r"stage 1 of mb2 to worker \(1, 1\), not a live worker"):
    validate(dataclasses.replace(s, ops=dead))
  with pytest.raises(ScheduleError, match=r"route has 3 entries, dp\*m = 4"):
    validate(dataclasses.replace(s, route=s.route[:3]))
  short = ((0,), *s.route[1:])
  with pytest.raises(ScheduleError, match="route of mb0 has 1 stages, pp=2"):
    validate(dataclasses.replace(s, route=short))


def test_rejects_memory_cap():
  validate(one_f_one_b(1, 4, 8), memory_cap=4)
  with pytest.raises(ScheduleError, match=r"worker \(0, 0\) holds 4 micro-batches.*cap of 3"):
    validate(one_f_one_b(1, 4, 8), memory_cap=3)
  with pytest.raises(ScheduleError, match=r"worker \(0, 0\) holds 8 micro-batches.*cap of 4"):
    validate(gpipe(1, 4, 8), memory_cap=4)


# --- re-routed schedules and text -----------------------------------------------------------


def _rerouted() -> Schedule:
  # Worker (0, 1) has failed: stage 1 of mb0 runs on (1, 1), next to that pipeline's own mb1.
  ops = {
    (0, 0): [Op(F, 0), Op(BW, 0), Op(AR), Op(OPT)],
    (1, 0): [Op(F, 1), Op(BW, 1), Op(AR), Op(OPT)],
    (1, 1): [Op(F, 0), Op(BW, 0), Op(F, 1), Op(BW, 1), Op(AR), Op(OPT)],
  }
  return make_schedule("adaptive", 2, 2, 1, ops, route=((0, 1), (1, 1)))


def test_rerouted_schedule_validates_and_costs_transfers():
  s = _rerouted()
  validate(s)
  tl = simulate(s, OpCosts(f=1.0, b=1.0, w=1.0, ar=0.5, comm=0.25))
  spans = {(sp.worker, sp.op): sp for sp in tl.spans}
  assert spans[((1, 1), Op(F, 0))].start == pytest.approx(1.25)  # F0 on (0, 0) + transfer
  assert spans[((0, 0), Op(BW, 0))].start == pytest.approx(4.5)  # BW0 on (1, 1) + transfer
  # Stage 1's all-reduce has one live participant; stage 0's waits for the later of the two.
  ar0 = [spans[((d, 0), Op(AR))] for d in (0, 1)]
  assert ar0[0].start == ar0[1].start == pytest.approx(9.5)  # BW1 back on (1, 0) at 9.5
  assert ar0[0].end == ar0[1].end == pytest.approx(ar0[0].start + 0.5)
  assert tl.makespan >= lower_bound(s, OpCosts(f=1.0, b=1.0, w=1.0, ar=0.5, comm=0.25))


def test_to_text():
  text = zb_h1(2, 3, 4).to_text().splitlines()
  assert text[0] == "schedule zb-h1: dp=2 pp=3 m=4"
  assert len(text) == 1 + 2 * 3
  assert text[1] == "  d0 s0 | F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3 AR OPT"
  assert text[3] == "  d0 s2 | F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 AR OPT"
  assert all(line.endswith("AR OPT") for line in text[1:])
  assert text[4].startswith("  d1 s0 | F4 F5 F6 B4 W4")
  rerouted = _rerouted().to_text().splitlines()
  assert rerouted[-2:] == ["re-routed micro-batches:", "  mb0: (0,0) -> (1,1)"]


# --- cost model -----------------------------------------------------------------------------


def test_op_costs_per_stage_and_checks():
  c = OpCosts(f=(1, 2), b=[3, 4], w=0.5, ar=(0.1, 0.2))
  got = (c.f_at(1), c.b_at(0), c.w_at(1), c.bw_at(1), c.ar_at(0), c.opt_at(1))
  assert got == (2.0, 3.0, 0.5, 4.5, 0.1, 0.0)
  assert OpCosts(b=1, w=2, bw=2.5).bw_at(0) == 2.5
  with pytest.raises(ValueError, match="OpCosts.w"):
    OpCosts(w=-1)
  with pytest.raises(ValueError, match="OpCosts.f has 2 per-stage entries, pp=3"):
    simulate(gpipe(1, 3, 2), c)
  # Per-stage times: the slowest stage paces the pipeline.
  tl = simulate(gpipe(1, 2, 1), OpCosts(f=(1, 2), b=(1, 2), w=(1, 2)))
  assert tl.makespan == pytest.approx(1 + 2 + 4 + 2)
  assert tl.busy == {(0, 0): pytest.approx(3.0), (0, 1): pytest.approx(6.0)}


def test_replay_matches_simulate_and_rejects_missing_durations():
  s = zb_h1(2, 3, 4)
  costs = OpCosts(f=(1.0, 1.5, 2.0), b=1.25, w=0.5, ar=0.75, opt=0.1, comm=0.05)
  durations = {(w, op): costs.duration(w, op) for w in s.workers for op in s.ops[w]}
  assert replay(s, durations, comm=0.05) == simulate(s, costs)
  assert simulate(s, costs.duration, comm=0.05) == simulate(s, costs)
  del durations[((1, 2), Op(W, 5))]
  with pytest.raises(ScheduleError, match=r"no measured duration for W5 on worker \(1, 2\)"):
    replay(s, durations)


@pytest.mark.parametrize("name", NAMES)
def test_lower_bound_is_below_makespan(name):
  costs = OpCosts(f=1.0, b=2.0, w=1.0, ar=0.5, opt=0.25, comm=0.1)
  for dp, pp, m in [(1, 1, 4), (2, 4, 8), (1, 8, 3)]:
    s = generate(name, dp, pp, m)
    assert lower_bound(s, costs) <= simulate(s, costs).makespan + 1e-9
  # One stage: no dependencies across workers, so the bound is the busy time and is attained.
  s = generate(name, 1, 1, 4)
  assert lower_bound(s, costs) == pytest.approx(simulate(s, costs).makespan)


def test_pipelines_only_meet_in_the_all_reduce():
  # What the coordinator's fault-free step time (one pipeline) and the expanded plans' makespans
  # (the touched pipelines' plan) rest on: more healthy pipelines never change the makespan.
  costs = OpCosts(f=1.0, b=1.0, w=1.0, ar=2.0, opt=0.5, comm=0.05)
  for name in ("1f1b", "zb-h1"):
    tl = simulate(generate(name, 16, 8, 16), costs)
    assert len(tl.spans) == 16 * 8 * (3 * 16 + 2) - (16 * 8 * 16 if name == "1f1b" else 0)
    assert tl.makespan == simulate(generate(name, 1, 8, 16), costs).makespan
    assert lower_bound(generate(name, 16, 8, 16), costs) <= tl.makespan
