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

from resilient_jax.config import ConfigError, ResilienceConfig
from resilient_jax.schedule.core import F, Op, Piece
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.loop import Trainer
from tests.helpers import assert_matches_reference, expected_digests, tiny_config


def _config():
  return tiny_config(mesh__dp=4, mesh__pp=2, pipeline__microbatches=1, train__steps=4,
                     faults__schedule="2:1.1", resilience__pieces=True)


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


def test_pieces_in_a_job_need_small_micro_batches_and_the_option_is_a_boolean():
  """Transfers between processes name a piece's first row in 6 bits
  (`multiprocess.PIECE_ROWS`): a job with larger micro-batches is refused before it starts."""
  from resilient_jax.training.run import start_run

  cfg = tiny_config(mesh__dp=4, mesh__pp=2, pipeline__microbatches=1, train__global_batch=512,
                    resilience__pieces=True)
  with pytest.raises(ConfigError, match="at most 64 samples"):
    start_run(cfg, "/nonexistent", devices=None, log=lambda _: None, cluster=object(),
              model=None)
  with pytest.raises(ConfigError, match="resilience.pieces"):
    ResilienceConfig(pieces="yes")


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


@pytest.mark.slow  # four processes: about 25 s of wall time, 40 of CPU
def test_a_sample_split_plan_across_processes(tmp_path):
  """The same grid as a job of four processes, a pipeline each (`mesh.placement=pipeline`),
  both failures at the start of their steps: micro-batch 1's last stage runs in pieces on
  processes 2 and 3, which take their activations' rows from process 1, send it their gradient
  rows and each report a share of its loss (summed in process order); micro-batch 3's first
  stage in pieces on processes 0 and 1, gathered by process 3. Losses and samples are one
  device's; the log names the pieces every process ran (process 0 publishes its plan's
  digest, which covers the pieces, and the others check theirs against it)."""
  import json
  import subprocess
  import sys

  from tests.helpers import LOSS_RTOL, ROOT, reference_for

  workdir = tmp_path / "job"
  cmd = [sys.executable, "-m", "launch.local", "--num_processes=4", "--devices_per_process=2",
         "--", "--config=configs/gpt_tiny.py:runlocal", f"--workdir={workdir}",
         "--config.mesh.dp=4", "--config.mesh.pp=2", "--config.pipeline.microbatches=1",
         "--config.train.steps=4", "--config.faults.schedule=2:1.1,3:3.0",
         "--config.resilience.pieces=true", "--config.distributed.heartbeat_timeout_s=10"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  assert "(dp=2, stage=1) takes samples 0:2 of micro-batch 1" in out, out[-3000:]
  assert "(dp=0, stage=0) takes samples 0:2 of micro-batch 3" in out, out[-3000:]
  checked = {x[:4] for x in out.splitlines() if "checks its plan against process 0's digest" in x}
  assert checked == {"[p1]", "[p2]", "[p3]"}, out[-3000:]
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x]
  cfg = tiny_config(mesh__dp=4, mesh__pp=2, pipeline__microbatches=1, train__steps=4,
                    faults__schedule="2:1.1,3:3.0", resilience__pieces=True)
  assert [r["sample_digest"] for r in rows] == expected_digests(cfg)
  ref_losses, _ = reference_for(cfg)
  assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=LOSS_RTOL)
  assert [r["live_workers"] for r in rows] == [8, 7, 6, 6]


def test_piece_transfer_ids_are_unique_and_apart_from_the_others():
  """Across processes a piece's rows travel under an id naming its first row (6 bits, from
  2**62 on): distinct per row and from every whole transfer's, reduction's and connection's."""
  import types

  from resilient_jax.runtime.multiprocess import PIECE_ROWS, ProcessTransport

  tp = types.SimpleNamespace(step=4_000_000, attempt=63)
  ids = {ProcessTransport._tid(tp, (mb, st, k, row)) for mb in (0, 65535) for st in (0, 1023)
         for k in (0, 1) for row in range(PIECE_ROWS)}
  assert len(ids) == 2 * 2 * 2 * PIECE_ROWS
  whole = {i for i in ids if i < 1 << 60}
  assert len(whole) == 8 and all(1 << 62 <= i < 1 << 63 for i in ids - whole)
  with pytest.raises(ValueError, match="below row 64"):
    ProcessTransport._tid(tp, (0, 0, 0, PIECE_ROWS))
