"""Tests of the failure planners: re-routing, the adaptive (ReCycle) and naive plans, the bounds
and the exact optimum of tiny grids (pure Python, no JAX)."""

from __future__ import annotations

import math
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
  ScheduleError,
  StageLostError,
  W,
  default_memory_cap,
  generate,
  lower_bound,
  make_schedule,
  plan_adaptive,
  plan_naive,
  relative_throughput_bound,
  reroute,
  route_lower_bound,
  simulate,
  validate,
)
from resilient_jax.schedule.adaptive import _VARIANTS, _list_schedule, _to_ops, plan, plan_on_route
from resilient_jax.schedule.analysis.exact import optimal_makespan, solve_exact
from resilient_jax.schedule.analysis.report import (
  GPT_COSTS,
  failure_sets,
  format_table,
  planner_table,
)
from resilient_jax.schedule.expand import expand, footprint
from resilient_jax.schedule.routing import FailureState, _live_workers

COSTS = GPT_COSTS  # f=1, b=1, w=0.8, ar=opt=0.1
UNEVEN = OpCosts(f=(1.0, 1.5, 1.0, 0.5), b=(1.0, 2.0, 1.5, 1.0), w=0.7, ar=0.3, opt=0.1, comm=0.05)


def _cases(dp: int, pp: int) -> list[frozenset]:
  """Single failures, several in one stage, and failures spread over stages."""
  cases = [frozenset({(dp - 1, pp - 1)}), frozenset({(0, 0)}), frozenset({(dp // 2, pp // 2)})]
  if dp > 2:
    cases.append(frozenset((d, pp // 2) for d in range(dp - 1)))
    cases.append(frozenset((d, 0) for d in range(1, dp - 1)))
  if pp > 1:
    cases.append(frozenset({(0, 0), (dp - 1, pp - 1)}))
    cases.append(frozenset((d % dp, d % pp) for d in range(min(dp, pp))))  # the diagonal
  cases.append(frozenset((0, s) for s in range(pp)))  # one whole pipeline
  return list(dict.fromkeys(cases))


GRID_CASES = [
  (dp, pp, m, failed)
  for dp, pp, m in [(2, 2, 4), (2, 4, 4), (4, 2, 4), (8, 8, 8)]
  for failed in _cases(dp, pp)
]


def _case_id(case) -> str:
  dp, pp, m, failed = case
  return f"{dp}x{pp}x{m}-" + "_".join(f"{d}.{s}" for d, s in sorted(failed))


# --- reroute -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GRID_CASES, ids=_case_id)
def test_reroute_balances_and_covers_every_stage_once(case):
  dp, pp, m, failed = case
  route = reroute(dp, pp, m, failed)
  assert route == reroute(dp, pp, m, set(failed))  # deterministic, whatever the container
  assert len(route) == dp * m and all(len(r) == pp for r in route)
  for mb, r in enumerate(route):
    for s, d in enumerate(r):
      assert (d, s) not in failed  # every (mb, stage) runs once, on a live worker
      if (mb // m, s) not in failed:
        assert d == mb // m  # a live owner keeps its own work
  for s in range(pp):
    dead = sum((d, s) in failed for d in range(dp))
    counts = Counter(r[s] for r in route)
    if dead == 0:
      assert set(counts.values()) == {m}
      continue
    lo, hi = math.floor(dp * m / (dp - dead)), math.ceil(dp * m / (dp - dead))
    assert set(counts) == {d for d in range(dp) if (d, s) not in failed}
    assert set(counts.values()) <= {lo, hi}, (s, counts)


def test_reroute_deals_orphans_round_robin():
  route = reroute(4, 2, 3, {(1, 1)})
  # Pipeline 1's stage-1 work (mbs 3, 4, 5) goes to survivors 0, 2, 3 one each.
  assert [route[mb][1] for mb in (3, 4, 5)] == [0, 2, 3]
  assert [r[0] for r in route] == [mb // 3 for mb in range(12)]


def test_stage_lost_error_names_the_stage():
  failed = {(0, 2), (1, 2), (2, 2)}
  for call in (
    lambda: reroute(3, 4, 2, failed),
    lambda: plan_adaptive(FailureState(3, 4, 2, failed), COSTS),
    lambda: plan_naive(FailureState(3, 4, 2, failed)),
    lambda: plan("adaptive", FailureState(3, 4, 2, failed), COSTS),
  ):
    with pytest.raises(StageLostError, match=r"stage 2 is lost: all 3 of its") as info:
      call()
    assert info.value.stage == 2
    assert isinstance(info.value, ScheduleError)


def test_bad_arguments():
  with pytest.raises(ValueError, match="outside the 2x2 grid"):
    reroute(2, 2, 2, {(2, 0)})
  with pytest.raises(ValueError, match="m must be a positive int"):
    reroute(2, 2, 0, set())
  with pytest.raises(ValueError, match="unknown policy 'fast'"):
    plan("fast", FailureState(2, 2, 2, {(0, 0)}), COSTS)
  with pytest.raises(ValueError, match="unknown base schedule 'zb-h2'"):
    plan_naive(FailureState(2, 2, 2, {(0, 0)}), base="zb-h2")
  with pytest.raises(ScheduleError, match="memory_cap=0 leaves no room"):
    plan_adaptive(FailureState(2, 2, 2, {(0, 0)}), COSTS, memory_cap=0)
  with pytest.raises(ValueError, match=r"k must be in \[0, dp=4\)"):
    relative_throughput_bound(4, 4, 8, 4)


# --- the plans -----------------------------------------------------------------------------------


PLAN_CASES = [(case, COSTS) for case in GRID_CASES] + [
  (case, UNEVEN)
  for case in GRID_CASES
  if case[1] == 4  # the uneven profile has 4 stages
]


@pytest.mark.parametrize(
  "case,costs",
  PLAN_CASES,
  ids=[_case_id(c) + ("-uneven" if k is UNEVEN else "") for c, k in PLAN_CASES],
)
def test_adaptive_and_naive_plans(case, costs):
  dp, pp, m, failed = case
  route = reroute(dp, pp, m, failed)
  live = sorted((d, s) for d in range(dp) for s in range(pp) if (d, s) not in failed)
  adaptive = plan_adaptive(FailureState(dp, pp, m, failed), costs)
  naive = plan_naive(FailureState(dp, pp, m, failed))
  for sched in (adaptive, naive):
    validate(sched)
    assert sched.route == route and sched.workers == live
    for w in live:
      assert sched.ops[w][-2:] == (Op(AR), Op(OPT))
  cap = default_memory_cap(dp, pp, m, failed, "zb-h1")
  report = validate(adaptive, memory_cap=cap)
  assert report.max_peak_inflight <= cap
  for w, ops in adaptive.ops.items():
    kinds = Counter(op.kind for op in ops)
    n = len(adaptive.microbatches_of(w))
    assert kinds == Counter({F: n, B: n, W: n, AR: 1, OPT: 1})  # split backward everywhere
    assert ops[-3].kind == W  # staggered optimizer: AR right after the worker's own last W
  # Naive keeps its base's fused backward and each list's order.
  assert all(op.kind != B for ops in naive.ops.values() for op in ops)
  assert any(op.kind == BW for ops in naive.ops.values() for op in ops)
  span = simulate(adaptive, costs).makespan
  assert span >= lower_bound(adaptive, costs) - 1e-9
  assert span >= route_lower_bound(FailureState(dp, pp, m, failed), costs, memory_cap=cap) - 1e-9
  assert span <= simulate(naive, costs).makespan + 1e-9


@pytest.mark.parametrize("dp,pp,m,failed", [(4, 4, 8, {(0, 1)}), (8, 8, 8, {(0, 0), (3, 5)})])
@pytest.mark.parametrize("cap", [1, 2, 3, 5, 8])
def test_adaptive_respects_memory_cap(dp, pp, m, failed, cap):
  sched = plan_adaptive(FailureState(dp, pp, m, failed), COSTS, memory_cap=cap)
  assert validate(sched, memory_cap=cap).max_peak_inflight <= cap
  span = simulate(sched, COSTS).makespan
  assert span >= route_lower_bound(FailureState(dp, pp, m, failed), COSTS, memory_cap=cap) - 1e-9
  # More memory never makes the plan slower than the tightest cap's.
  state = FailureState(dp, pp, m, failed)
  assert span <= simulate(plan_adaptive(state, COSTS, memory_cap=1), COSTS).makespan


def test_default_memory_cap():
  assert default_memory_cap(8, 8, 16, set(), "zb-h1") == 8  # the base's own peak
  assert default_memory_cap(8, 8, 16, {(0, 3)}, "zb-h1") == math.ceil(8 * 19 / 16)
  assert default_memory_cap(4, 4, 8, {(0, 1), (1, 1), (2, 1)}, "zb-h1") == 16  # one survivor
  assert default_memory_cap(2, 2, 4, {(0, 0)}, "1f1b") == 4


@pytest.mark.parametrize("base", ["gpipe", "1f1b", "zb-h1"])
def test_plan_without_failures_is_the_base_schedule(base):
  want = generate(base, 4, 4, 8)
  for policy in ("adaptive", "naive"):
    got = plan(policy, FailureState(4, 4, 8, set()), COSTS, base=base)
    assert got.name == base and got.ops == want.ops and got.route == want.route
  # The adaptive planner itself, asked for a healthy grid, is never slower than its base.
  healthy = plan_adaptive(FailureState(4, 4, 8, set()), COSTS, base=base)
  assert simulate(healthy, COSTS).makespan <= simulate(_split_base(want), COSTS).makespan + 1e-9


def _split_base(schedule):
  ops = {}
  for w, lst in schedule.ops.items():
    ops[w] = [x for op in lst for x in ((Op(B, op.mb), Op(W, op.mb)) if op.kind == BW else (op,))]
  return make_schedule("split", schedule.dp, schedule.pp, schedule.microbatches, ops)


def test_plan_dispatches():
  failed = {(1, 2)}
  assert plan("adaptive", FailureState(4, 4, 8, failed), COSTS).name == "adaptive"
  naive = plan("naive", FailureState(4, 4, 8, failed), COSTS, base="zb-h1")
  assert naive.name == "naive" and any(op.kind == W for op in naive.ops[(0, 2)])
  state = FailureState(4, 4, 8, failed)
  assert plan("naive", state, COSTS).ops == plan_naive(state).ops


def test_adaptive_is_deterministic():
  a = plan_adaptive(FailureState(8, 8, 16, {(2, 3), (5, 3), (1, 6)}), COSTS)
  b = plan_adaptive(FailureState(8, 8, 16, [(1, 6), (5, 3), (2, 3)]), COSTS)
  assert a == b


def test_list_scheduler_makespan_is_the_replays():
  # plan_adaptive picks its variant by the list scheduler's own makespan: it must be simulate's.
  for dp, pp, m, failed, costs in [
    (8, 8, 16, {(0, 0), (1, 0)}, COSTS),
    (4, 4, 8, {(1, 1), (2, 3)}, UNEVEN),
    (3, 2, 2, {(0, 0), (1, 1)}, COSTS),
  ]:
    route = reroute(dp, pp, m, failed)
    live = _live_workers(dp, pp, failed)
    for order, f_key, limit in _VARIANTS:
      act = [pp - s + 1 for _, s in live] if limit else None
      raw, _, span, peak, *_ = _list_schedule(pp, m, route, live, costs, 4, order, f_key, act)
      compute = _to_ops(live, raw)
      ops = {w: [*lst, Op(AR), Op(OPT)] for w, lst in compute.items()}
      sched = make_schedule("x", dp, pp, m, ops, route=route)
      assert simulate(sched, costs).makespan == pytest.approx(span, abs=1e-9)
      assert validate(sched, memory_cap=4).max_peak_inflight == peak


def test_a_variant_stopped_when_it_cannot_win_changes_no_plan(monkeypatch):
  # The planner stops a variant once some worker's remaining ops, back to back, end after the
  # best makespan so far (or at it, holding as many in flight as the best: a tie it would lose).
  # The plans it makes must be those it makes trying every variant whole.
  from resilient_jax.schedule import adaptive

  cases = [(8, 8, 16, f, COSTS) for f in _cases(8, 8)]
  cases += [(4, 4, 8, f, UNEVEN) for f in _cases(4, 4)]
  cases += [(6, 4, 8, f, COSTS) for f in _cases(6, 4)]
  stopped, whole = [], adaptive._list_schedule

  def counting(*args, **kwargs):
    listed = whole(*args, **kwargs)
    if listed.makespan == math.inf:
      stopped.append(args[7])
      # and a stopped pass would indeed have lost: a longer makespan, or a tie at a peak as high
      full = whole(*args)
      assert (round(full.makespan, 9), full.peak) >= (kwargs["beat"], kwargs["beat_peak"])
    return listed

  def never_stopped(*args, **_):
    return whole(*args)

  for dp, pp, m, failed, costs in cases:
    state = FailureState(dp, pp, m, failed)
    monkeypatch.setattr(adaptive, "_list_schedule", counting)
    fast = plan_adaptive(state, costs)
    monkeypatch.setattr(adaptive, "_list_schedule", never_stopped)
    assert plan_adaptive(state, costs) == fast
  assert len(stopped) >= 5  # the stop is taken, not only allowed


def test_a_tie_stops_only_a_pass_that_would_lose_it():
  # Makespans are compared rounded to 1e-9 s, and a tie goes to the lower in-flight peak. A pass
  # held against its own makespan stops when its peak would lose the tie, runs whole when the
  # best it ties has a higher peak, and runs whole against a best it beats by 2e-9 s.
  dp, pp, m, failed = 8, 8, 16, {(5, 0), (5, 1), (5, 2), (5, 3), (5, 4), (5, 5), (5, 6), (5, 7)}
  route, live = reroute(dp, pp, m, failed), _live_workers(dp, pp, failed)
  order, f_key, _ = _VARIANTS[0]
  whole = _list_schedule(pp, m, route, live, COSTS, 4, order, f_key)
  beat = round(whole.makespan, 9)
  assert _list_schedule(pp, m, route, live, COSTS, 4, order, f_key, beat=beat,
                        beat_peak=whole.peak).makespan == math.inf
  for against in ((beat, whole.peak + 1), (beat + 2e-9, whole.peak)):
    again = _list_schedule(pp, m, route, live, COSTS, 4, order, f_key, beat=against[0],
                           beat_peak=against[1])
    assert (again.makespan, again.out) == (whole.makespan, whole.out), against


def test_naive_does_not_deadlock_when_damaged_pipelines_swap_work():
  # Pipeline 0 lost stage 1 (its stage-1 work goes to pipeline 1) and pipeline 1 lost stage 2
  # (its stage-2 work goes to pipeline 0): "own list, then the orphans" deadlocks here.
  dp, pp, m, failed = 2, 3, 2, {(0, 1), (1, 2)}
  route = reroute(dp, pp, m, failed)
  base = generate("1f1b", dp, pp, m)
  plain = {}
  for w in _live_workers(dp, pp, failed):
    own = [op for op in base.ops[w] if op.mb >= 0 and route[op.mb][w[1]] == w[0]]
    other = [op for op in base.ops[(1 - w[0], w[1])] if op.mb >= 0 and route[op.mb][w[1]] == w[0]]
    plain[w] = own + (other if (1 - w[0], w[1]) in failed else []) + [Op(AR), Op(OPT)]
  with pytest.raises(ScheduleError, match="deadlock"):
    validate(make_schedule("plain", dp, pp, m, plain, route=route))
  validate(plan_naive(FailureState(dp, pp, m, failed)))
  validate(plan_adaptive(FailureState(dp, pp, m, failed), COSTS))


# --- planning the touched pipelines and expanding (the runtime's path on large grids) -------------

EXPAND_CASES = [
  (24, 4, 8, {(20, 1)}, "zb-h1"),  # one failure behind the pipelines that take its work
  (24, 4, 8, {(2, 1)}, "zb-h1"),  # one among them
  (24, 4, 8, {(20, 1), (3, 2), (15, 0)}, "zb-h1"),  # spread over pipelines and stages
  (24, 4, 8, {(20, 1), (20, 2)}, "1f1b"),  # two in one pipeline
  (12, 4, 8, {(11, s) for s in range(4)}, "zb-h1"),  # a whole pipeline (a host)
  (16, 4, 4, {(0, 0)}, "1f1b"),  # the plan is faster than the fault-free 1F1B lists
  (16, 4, 8, {(d, 2) for d in range(0, 16, 2)}, "zb-h1"),  # half a stage: every pipeline
]


def _expanded(policy, dp, pp, m, failed, base, costs=COSTS):
  fp = footprint(dp, pp, m, failed)
  sub, span = plan_on_route(policy, len(fp.pipelines), pp, m, fp.failed, fp.route, costs, base=base)
  return fp, expand(sub, fp, base), span


@pytest.mark.parametrize("policy", ["adaptive", "naive"])
@pytest.mark.parametrize("dp,pp,m,failed,base", EXPAND_CASES, ids=lambda x: str(x))
def test_expanded_plan_is_the_full_grids_plan(policy, dp, pp, m, failed, base):
  fp, expanded, span = _expanded(policy, dp, pp, m, failed, base)
  full = plan(policy, FailureState(dp, pp, m, failed), COSTS, base=base)
  validate(expanded, memory_cap=default_memory_cap(dp, pp, m, failed, base))
  # Op for op, route for route: the runtime runs what planning the whole grid would give.
  assert expanded == full
  assert expanded.route == reroute(dp, pp, m, failed)
  makespan = simulate(full, COSTS).makespan
  assert simulate(expanded, COSTS).makespan == pytest.approx(makespan, abs=1e-9)
  if policy == "adaptive":  # the list scheduler's makespan of the sub-grid is the full grid's
    assert span == pytest.approx(makespan, abs=1e-9)
  touched = {d for d, _ in failed} | {d for r in full.route for d in r if r.count(d) < pp}
  assert set(fp.pipelines[: len(fp.pipelines) - fp.spare]) >= touched


def test_footprint_does_not_depend_on_where_the_failure_is():
  # Behind the takers, one failure of stage 2 touches the grid the same way wherever it is, so
  # the runtime plans it once; in front of them it does not.
  deep = [footprint(48, 4, 8, {(d, 2)}) for d in (20, 33, 47)]
  assert len({fp.key for fp in deep}) == 1
  assert [fp.pipelines[-1] for fp in deep] == [0, 0, 0]  # the spare: the first healthy one
  assert footprint(48, 4, 8, {(3, 2)}).key != deep[0].key
  assert footprint(48, 4, 8, {(20, 1)}).key != deep[0].key
  # Nothing failed: nothing touched, no spare.
  empty = footprint(48, 4, 8, set())
  assert empty.pipelines == () and not empty.spare


def test_expanded_schedule_builds_lists_on_use():
  fp, expanded, _ = _expanded("adaptive", 48, 4, 8, {(30, 1)}, "zb-h1")
  ops = expanded.ops
  assert len(ops) == 48 * 4 - 1 and (30, 1) not in ops and (47, 3) in ops and (48, 0) not in ops
  assert list(ops) == expanded.workers
  assert not ops._lists  # nothing built by asking which workers there are
  ops[(40, 0)]
  expanded.backward_op(40 * 8 + 3, 0)  # one worker's index, not every worker's
  assert set(ops._lists) == {(40, 0)}
  with pytest.raises(KeyError):
    ops[(30, 1)]
  # A healthy pipeline runs the spare's lists on its own micro-batches.
  shift = 40 - fp.pipelines[-1]
  spare = expanded.ops[(fp.pipelines[-1], 2)]
  assert ops[(40, 2)] == tuple(Op(o.kind, o.mb + shift * 8) if o.mb >= 0 else o for o in spare)
  assert expanded.route[-1] == (47,) * 4 and expanded.route[30 * 8][1] != 30
  with pytest.raises(IndexError):
    expanded.route[48 * 8]


def test_expanded_text_shows_what_the_failure_changed():
  fp, expanded, _ = _expanded("adaptive", 48, 4, 8, {(30, 1)}, "zb-h1")
  text = expanded.to_text()
  assert text is expanded.to_text()  # built once
  shown = {int(line.split()[0][1:]) for line in text.splitlines() if line.startswith("  d")}
  assert shown == set(fp.pipelines)  # the touched ones and the spare, its template
  spare = fp.pipelines[-1]
  assert f"the other {48 - len(shown)} pipelines run pipeline {spare}'s lists on their" in text
  assert text.count("  mb") == 8  # pipeline 30's micro-batches leave it at stage 1
  healthy = expand(None, footprint(48, 4, 8, set()), "zb-h1")
  assert healthy.to_text().endswith("the other 48 pipelines run zb-h1's fault-free lists")


# --- bounds and the benchmark rows ---------------------------------------------------------------


def test_relative_throughput_bound():
  assert relative_throughput_bound(8, 8, 16, 0) == 1.0
  assert relative_throughput_bound(8, 8, 16, 1) == 1.0  # 23*7/128 > 1
  assert relative_throughput_bound(8, 8, 16, 3) == pytest.approx(23 * 5 / 128)
  assert relative_throughput_bound(4, 4, 8, 3) == pytest.approx(11 / 32)


def test_failure_sets():
  sets = failure_sets(4, 4)
  assert [layout for layout, _ in sets].count("stage 3") == 3
  assert ("stage 2", frozenset({(0, 2), (1, 2)})) in sets
  spread = [f for layout, f in sets if layout == "spread"]
  assert spread == [frozenset({(0, 0), (1, 2)}), frozenset({(0, 0), (1, 1), (2, 2)})]


@pytest.fixture(scope="module")
def table():
  return planner_table([(4, 4, 8), (8, 8, 16)], COSTS)


def test_target_of_bound_on_single_stage_rows(table):
  """Adaptive keeps >= 95% of ReCycle's bound wherever any schedule can.

  Throughput is relative to fault-free 1F1B, whose bubble the bound counts. Rows below 95% are
  those whose survivors, deep in the pipeline, cannot start before the fill and carry
  ceil(D*m/(D-k)) micro-batches: `route_lower_bound` proves that no order reaches 95% there,
  and the plan must then be within 2% of that proof.
  """
  print("\n" + format_table(table))
  for r in table:
    assert r.adaptive >= r.naive
    assert r.adaptive <= r.ceiling + 1e-9  # the route bound holds
    if r.layout == "spread":
      continue
    if r.of_bound < 0.95:
      assert r.ceiling < 0.95 * r.bound, r
      assert r.adaptive >= 0.98 * r.ceiling, r
  misses = [(r.dp, r.layout, r.k) for r in table if r.layout != "spread" and r.of_bound < 0.95]
  # At least the early stages meet the target at every k.
  assert not [x for x in misses if x[1] == "stage 0"]


def test_planner_meets_lower_bound_when_work_bound(table):
  for r in table:
    assert r.adaptive_makespan >= max(r.lower_bound, r.route_bound) - 1e-9
    assert r.peak_inflight <= r.memory_cap
    if r.layout != "spread" and r.k >= r.dp // 2:
      # Heavily loaded survivors: the plan is optimal for its routes.
      assert r.over_best_bound == pytest.approx(1.0, abs=1e-9), r


# --- the exact optimum ---------------------------------------------------------------------------

EXACT_CASES = [
  (2, 2, 2, {(1, 1)}, None),
  (2, 2, 2, {(1, 1)}, 1),
  (2, 2, 2, {(0, 0)}, 2),
  (2, 2, 2, {(1, 0)}, None),
  (2, 3, 2, {(0, 1)}, None),
  (3, 2, 2, {(0, 1)}, None),
  (3, 2, 2, {(0, 0), (1, 1)}, None),
  (3, 2, 2, {(0, 0), (1, 1)}, 2),
  (2, 2, 3, {(1, 0)}, None),
]


@pytest.mark.parametrize("dp,pp,m,failed,cap", EXACT_CASES)
def test_exact_vs_heuristic(dp, pp, m, failed, cap):
  result = solve_exact(FailureState(dp, pp, m, failed), COSTS, cap)
  # The optimum is a real, valid schedule within the cap that replays to the same makespan.
  assert validate(result.schedule, memory_cap=cap).max_peak_inflight <= (cap or dp * m)
  assert simulate(result.schedule, COSTS).makespan == pytest.approx(result.makespan, abs=1e-6)
  state = FailureState(dp, pp, m, failed)
  assert result.makespan >= route_lower_bound(state, COSTS, memory_cap=cap) - 1e-6
  heuristic = simulate(plan_adaptive(state, COSTS, memory_cap=cap or dp * m), COSTS)
  assert result.makespan <= heuristic.makespan + 1e-6
  assert heuristic.makespan <= 1.15 * result.makespan
  print(f"\nexact {result.makespan:.2f} heuristic {heuristic.makespan:.2f}")


def test_optimal_makespan_without_failures():
  # A healthy 1x2 pipeline with 2 micro-batches: the heuristic finds the optimum.
  assert optimal_makespan(FailureState(1, 2, 2, set()), COSTS) == pytest.approx(
    simulate(plan_adaptive(FailureState(1, 2, 2), COSTS, memory_cap=2), COSTS).makespan, abs=1e-6
  )


def test_the_planners_times_certify_its_plan_and_catch_a_broken_one(monkeypatch):
  """`validate` with the list scheduler's start times (`Timing`) accepts its plan without a
  replay; the same times with two ops swapped on one worker, or with one backward started before
  the gradient from the stage above arrives, are refused by name."""
  import importlib

  from resilient_jax.schedule.adaptive import _adaptive_on_route
  from resilient_jax.schedule.core import B, make_schedule

  dp, pp, m = 4, 4, 8
  failed = frozenset({(1, 2)})
  route = reroute(dp, pp, m, failed)
  sched, _, timing = _adaptive_on_route(dp, pp, m, failed, route, COSTS, 8, "zb-h1")
  validate_module = importlib.import_module("resilient_jax.schedule.validate")
  replays = []
  monkeypatch.setattr(validate_module, "simulate", lambda *a, **k: replays.append(a))
  validate(sched, timing=timing)
  assert replays == []
  monkeypatch.undo()
  validate(sched)  # the replay agrees

  w = (0, 2)
  ops = list(sched.ops[w])
  i = next(k for k in range(len(ops) - 3) if ops[k].kind != ops[k + 1].kind)
  ops[i], ops[i + 1] = ops[i + 1], ops[i]
  swapped = make_schedule("x", dp, pp, m, {**sched.ops, w: ops}, route=sched.route)
  with pytest.raises(ScheduleError, match=r"worker \(0, 2\): .* starts at .*, before"):
    validate(swapped, timing=timing)

  # Worker (0, 1)'s first B that waited (a gap before it: the gradient from stage 2 was not
  # there yet) started as soon as the op before it ended: the list is the same, the time a lie.
  w = (0, 1)
  ops, starts = sched.ops[w], list(timing.starts[w])
  k = next(j for j, op in enumerate(ops) if op.kind == B
           and starts[j] > starts[j - 1] + timing.duration(w, ops[j - 1]) + 1e-9)
  starts[k] = starts[k - 1] + timing.duration(w, ops[k - 1])
  bad = type(timing)({**timing.starts, w: starts}, timing.duration, timing.comm)
  with pytest.raises(ScheduleError, match=rf"worker \(0, 1\): {ops[k]} .*before the gradient"):
    validate(sched, timing=bad)
