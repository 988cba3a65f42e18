"""The runtime runs sample-split plans (issue 50): pieces of micro-batches on the stage peers.

With `resilience.pieces` the coordinator's grid counts a micro-batch's samples, so after a
failure the re-routing planner may cut the failed worker's micro-batches into pieces over more
of its stage's peers. The interpreter runs each piece on its rows with the stage's programs
built for that many samples, sends a split stage's input to each piece as its rows and gathers
the pieces in row order for the stage after (gradients the same way back), and sums a split
last stage's piece losses. The losses, the samples of every step and the final parameters stay
those of one device.

The run: 4 x 2 grid, one micro-batch of 4 samples per pipeline and step, worker (1, 1) fails at
the start of step 2 (its micro-batch's last stage runs in two pieces on (2, 1) and (3, 1)), and
worker (3, 0) in the middle of step 3 (re-run with its micro-batch's first stage in two pieces
on (0, 0) and (1, 0) as well): a split last stage and a split first stage, each scattered to and
gathered from a whole neighbour.
"""

from __future__ import annotations

from collections import Counter

import pytest

from resilient_jax.config import ConfigError
from resilient_jax.schedule.core import F, Op, Piece
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.loop import Trainer
from tests.helpers import assert_matches_reference, expected_digests, tiny_config


def _config(pieces=True):
  return tiny_config(mesh__dp=4, mesh__pp=2, pipeline__microbatches=1, train__steps=4,
                     faults__schedule="2:1.1", resilience__pieces=pieces)


def test_a_sample_split_plan_trains_as_one_device(tmp_path):
  cfg = _config()
  assert cfg.microbatch_size == 4
  records = {}
  trainer = Trainer(cfg, tmp_path, log=lambda _: None,
                    faults=[FaultEvent(3, (3, 0), after_op=Op(F, 3))])
  trainer.add_hook(lambda info: records.update({info.step: info.result.records}))
  result = trainer.run()

  # The plan in force splits micro-batch 1's last stage and micro-batch 3's first stage.
  sched = trainer.coordinator.plan.schedule
  assert sched.samples == 4
  assert sched.pieces == {(1, 1): ((2, 0, 2), (3, 2, 4)), (3, 0): ((0, 0, 2), (1, 2, 4))}
  # What ran is the plan's pieces, each on its own peer: the profiled last step recorded every
  # op of the plan, a piece's F, B and W on its rows (a whole op where the plan split one, or a
  # piece missing, would show here).
  ran = Counter((r.worker, r.op) for r in records[cfg.train.steps])
  assert ran == Counter((w, op) for w, ops in sched.ops.items() for op in ops)
  pieces = {(w, str(op)) for w, op in ran if isinstance(op, Piece)}
  assert pieces == {((d, s), f"{k}{mb}[{lo}:{hi}]") for (mb, s), split in sched.pieces.items()
                    for d, lo, hi in split for k in ("F", "B", "W")}
  # And on the pieces' rows only: a piece run on its whole micro-batch would count those
  # samples twice, which moves the loss and gradients far off the one-device run's.
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  assert result.metrics[-1]["live_workers"] == 6


def test_pieces_are_refused_in_a_job_and_checked_as_a_boolean():
  from resilient_jax.training.run import start_run

  with pytest.raises(ConfigError, match="one process only"):
    start_run(_config(), "/nonexistent", devices=None, log=lambda _: None, cluster=object(),
              model=None)
  with pytest.raises(ConfigError, match="resilience.pieces"):
    _config(pieces="yes")


def test_a_plan_with_pieces_encodes_and_decodes_op_for_op():
  """Every process digests the plan's encoding (`schedule/codec.py`): it must carry the pieces'
  rows, or two processes with different splits would agree."""
  from resilient_jax.policy import RunCoordinator
  from resilient_jax.schedule.codec import decode_plan, digest, encode_plan

  coord = RunCoordinator(_config(), list(range(8)), log=lambda _: None)
  coord.fail({3}, 2)
  plan = coord.plan
  assert plan.schedule.pieces
  back = decode_plan(encode_plan(plan))
  assert back.schedule.pieces == plan.schedule.pieces
  assert back.schedule.samples == plan.schedule.samples == 4
  assert back.schedule.ops == plan.schedule.ops and back.nodes == plan.nodes
  assert any(isinstance(op, Piece) for ops in back.schedule.ops.values() for op in ops)
  other = encode_plan(plan)
  other["grid"]["schedule"]["whole"]["pieces"][0][2][0][2] -= 1  # another split of the rows
  assert digest(other) != digest(encode_plan(plan))
