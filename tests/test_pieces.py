"""Sample-granular re-routing: pieces of micro-batches, planned by the adaptive planner,
validated by the validator and priced by the cost model with a per-op fixed cost (no JAX)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from resilient_jax.schedule import F, Op, OpCosts, ScheduleError, generate, simulate, validate
from resilient_jax.schedule.adaptive import plan_adaptive_timed
from resilient_jax.schedule.core import B, Piece, W
from resilient_jax.schedule.routing import FailureState, split_route

COSTS = OpCosts(f=1.0, b=1.0, w=0.8, ar=0.5, opt=0.2, comm=0.05, fixed=0.1)


def _samples_at(schedule, stage: int, kind: str) -> Counter:
  """How many times each (micro-batch, sample) runs `kind` at `stage`."""
  runs: Counter = Counter()
  for (_, s), ops in schedule.ops.items():
    if s != stage:
      continue
    for op in ops:
      if op.kind == kind:
        lo, hi = (op.lo, op.hi) if isinstance(op, Piece) else (0, schedule.samples)
        runs.update((op.mb, i) for i in range(lo, hi))
  return runs


def test_a_failed_workers_samples_spread_over_its_stage():
  """8 x 4, m=4, 8 samples a micro-batch, the last stage's worker of pipeline 3 down: its 4
  micro-batches are cut into pieces over more than 4 peers, every sample runs each stage's
  F, B and W once, the plan is valid, its replay is the planner's makespan, and it is faster
  than the plan that moves whole micro-batches."""
  failed = frozenset({(3, 3)})
  whole, t_whole = plan_adaptive_timed(FailureState(8, 4, 4, failed), COSTS)
  split, t_split = plan_adaptive_timed(FailureState(8, 4, 4, failed, samples=8), COSTS)
  assert not whole.pieces and split.pieces and split.samples == 8
  takers = {d for (mb, s), parts in split.pieces.items() for d, _, _ in parts}
  assert len(takers) > 4 and all(s == 3 and mb // 4 == 3 for mb, s in split.pieces)
  for kind in (F, B, W):
    assert set(_samples_at(split, 3, kind).values()) == {1}
    assert len(_samples_at(split, 3, kind)) == 8 * 4 * 8
  validate(split)
  assert simulate(split, COSTS).makespan == pytest.approx(t_split)
  assert t_split < t_whole - 0.3
  # The stage after a split one gathers: nothing at stage 3 is split on the whole grid but the
  # failed pipeline's, whose backward at stage 2 waits for every piece's B.
  spans = {(sp.worker, sp.op): sp for sp in simulate(split, COSTS).spans}
  for (mb, _), parts in split.pieces.items():
    b2 = spans[((split.route[mb][2], 2), Op(B, mb))]
    for d, lo, hi in parts:
      assert b2.start >= spans[((d, 3), Piece(B, mb, lo, hi, 8))].end + COSTS.comm - 1e-9


def test_a_large_fixed_cost_keeps_micro_batches_whole():
  """Pieces are not free: when almost all of an op's time is fixed, splitting buys nothing and
  the planner keeps the faster plan, never slower than the whole-micro-batch one."""
  failed = frozenset({(3, 3)})
  costly = dataclasses.replace(COSTS, fixed=0.95)
  _, t_whole = plan_adaptive_timed(FailureState(8, 4, 4, failed), costly)
  split, t = plan_adaptive_timed(FailureState(8, 4, 4, failed, samples=8), costly)
  assert t <= t_whole + 1e-9
  cheap_split, _ = plan_adaptive_timed(FailureState(8, 4, 4, failed, samples=8), COSTS)
  pieces = lambda sch: sum(len(p) for p in sch.pieces.values())  # noqa: E731
  assert pieces(split) < pieces(cheap_split)


def test_a_piece_costs_its_fixed_part_plus_its_samples():
  op = Piece(F, 3, 2, 5, 8)
  assert op.fraction == 3 / 8 and str(op) == "F3[2:5]"
  assert COSTS.duration((0, 1), op) == pytest.approx(1.0 * (0.1 + 0.9 * 3 / 8))
  assert COSTS.duration((0, 1), Op(F, 3)) == 1.0
  assert Piece(F, 3, 0, 4, 8) != Op(F, 3)
  with pytest.raises(ValueError):
    Piece(F, 3, 0, 8, 8)  # the whole micro-batch is not a piece
  with pytest.raises(ValueError):
    OpCosts(fixed=1.0)


def test_split_route_gives_a_slow_worker_its_share_of_samples():
  """A worker at half speed keeps about half the samples of its peers (at sample grain), the
  rest go as pieces to its stage's peers; the totals are the stage's."""
  route, pieces = split_route(4, 2, 4, 4, (), (((1, 0), 0.5),))
  loads = Counter()
  for mb in range(16):
    if (mb, 0) in pieces:
      for d, lo, hi in pieces[(mb, 0)]:
        loads[d] += hi - lo
    else:
      loads[route[mb][0]] += 4
  assert sum(loads.values()) == 64
  assert loads[1] == round(64 * 0.5 / 3.5)  # 9 of 64 samples
  assert all(loads[d] in (18, 19) for d in (0, 2, 3))
  assert all(route[mb][1] == mb // 4 for mb in range(16))  # stage 1 untouched


def test_the_validator_refuses_whole_ops_where_the_plan_split_them():
  split, _ = plan_adaptive_timed(FailureState(4, 2, 2, frozenset({(1, 1)}), samples=4), COSTS)
  validate(split)
  (mb, s), parts = next(iter(split.pieces.items()))
  d = parts[0][0]
  # The runtime running the whole micro-batch on a piece's worker: refused.
  whole = {w: tuple(Op(op.kind, op.mb) if isinstance(op, Piece) and w == (d, s) else op
                    for op in ops) for w, ops in split.ops.items()}
  with pytest.raises(ScheduleError, match="share of"):
    validate(dataclasses.replace(split, ops=whole))
  # Pieces that overlap (or leave samples out) are refused.
  bad = dict(split.pieces)
  bad[(mb, s)] = ((parts[0][0], 0, 3), *parts[1:])
  with pytest.raises(ScheduleError, match="tile"):
    validate(dataclasses.replace(split, pieces=bad))
  # A fault-free grid has nothing to split.
  assert not plan_adaptive_timed(FailureState(4, 2, 2, samples=4), COSTS)[0].pieces
  assert simulate(generate("zb-h1", 4, 2, 2), COSTS).makespan > 0


def test_a_slow_worker_sheds_samples_and_the_step_gets_faster():
  """4 x 4, m=8, one worker at half speed: with 4 samples a micro-batch the planner moves
  pieces, and the step is faster than with whole micro-batches."""
  from resilient_jax.schedule.routing import speed_scaled

  speeds = (((1, 3), 0.5),)
  costs = dataclasses.replace(COSTS, comm=0.0)
  whole, t_whole = plan_adaptive_timed(FailureState(4, 4, 8, speeds=speeds), costs)
  split, t_split = plan_adaptive_timed(FailureState(4, 4, 8, speeds=speeds, samples=4), costs)
  assert split.pieces and t_split < t_whole
  assert simulate(split, speed_scaled(costs, speeds)).makespan == pytest.approx(t_split)
