"""Training through worker failures: same samples per step, same losses and parameters."""

import json

import numpy as np
import pytest

from resilient_jax.observe.events import Failure
from resilient_jax.schedule.core import AR, B, F, Op
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.loop import Trainer
from tests.helpers import (
  assert_matches_reference,
  events_jsonl,
  expected_digests,
  quick_only,
  run_launcher,
  tiny_config,
)
from tests.test_tensorboard import assert_losses_match, texts

# Per grid: failures between steps ("STEP:DP.STAGE") and one in the middle of a step.
SCENARIOS = {
  (2, 2): ("2:1.0", FaultEvent(3, (0, 1), after_op=Op(F, 1))),
  # Different stages, one of them in the middle of a backward.
  (2, 4): ("2:1.1,3:0.3", FaultEvent(3, (1, 2), after_op=Op(B, 5))),
  # Three of the four workers of stage 0, one of them during the all-reduce.
  (4, 2): ("2:1.0,2:2.0", FaultEvent(3, (3, 0), after_op=Op(AR))),
}


def run_with_failures(tmp_path, dp, pp, schedule, policy="recycle"):
  # The mid-step failures happen after a failure between steps, so the schedule running then
  # is a replanned one, which always splits B and W.
  between, mid = SCENARIOS[(dp, pp)]
  cfg = tiny_config(
    mesh__dp=dp,
    mesh__pp=pp,
    pipeline__schedule=schedule,
    faults__schedule=between,
    resilience__policy=policy,
  )
  lines = []
  trainer = Trainer(cfg, tmp_path, log=lines.append, faults=[mid])
  return cfg, trainer.run(), lines


@pytest.mark.parametrize("dp,pp,schedule", quick_only(
  [(dp, pp, s) for dp, pp in sorted(SCENARIOS) for s in ("gpipe", "1f1b", "zb-h1")],
  [(2, 2, "1f1b"), (2, 4, "zb-h1"), (4, 2, "gpipe")]))
def test_failures_keep_samples_losses_and_parameters(tmp_path, dp, pp, schedule):
  cfg, result, lines = run_with_failures(tmp_path, dp, pp, schedule)
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  dead = 1 + cfg.faults.schedule.__len__()
  assert result.metrics[-1]["live_workers"] == dp * pp - dead
  assert result.metrics[-1]["schedule"] == "adaptive"
  failures = [e for e in result.events if isinstance(e, Failure)]
  assert len(failures) == dead and len(events_jsonl(tmp_path, "failure")) == dead
  assert any(e.step == 3 and e.mid_step for e in failures)
  assert any("re-routed" in line and "takes micro-batches" in line for line in lines)
  # The failed workers hold nothing any more; the survivors of each stage agree.
  assert len(result.interpreter.params) == dp * pp - dead


def test_naive_policy_matches_too(tmp_path):
  cfg, result, _ = run_with_failures(tmp_path, 2, 4, "zb-h1", policy="naive")
  assert result.metrics[-1]["schedule"] == "naive"
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  # TensorBoard: every step's loss, each failure and the recovery from the one mid-step.
  assert_losses_match(tmp_path, result.metrics)
  failures = texts(tmp_path / "tb", "failure")
  assert [s for s, _ in failures] == [2, 3, 3]
  assert "failed during step 3" in failures[2][1]
  assert "now naive on 5 live workers" in failures[2][1]
  [(step, recovery)] = texts(tmp_path / "tb", "recovery")
  assert step == 3 and "after the loss of node 6 was detected" in recovery


def test_rerouted_work_runs_on_the_peer(rerouted_run):
  cfg, trainer, tmp_path = rerouted_run.cfg, rerouted_run.trainer, rerouted_run.workdir
  sched = trainer.coordinator.plan.schedule
  m = cfg.pipeline.microbatches
  for mb in range(m, 2 * m):  # pipeline 1's micro-batches
    assert sched.route[mb] == (1, 0)  # stage 0 at home, stage 1 on the peer
  assert (1, 1) not in sched.ops
  peer_ops = [op for op in sched.ops[(0, 1)] if op.kind == F]
  assert len(peer_ops) == 2 * m
  # The last step ran after the failure: its timeline is of the replanned schedule.
  trace = json.loads((tmp_path / "timeline.json").read_text())
  assert trace["otherData"]["schedule"] == "adaptive"
  on_peer = {
    e["name"]
    for e in trace["traceEvents"]
    if e.get("ph") == "X" and e["pid"] == 0 and e["tid"] == 1
  }
  assert {f"F{mb}" for mb in range(2 * m)} <= on_peer


@pytest.mark.slow  # a launcher process; test_multiprocess.py checks exit 3 on a job too
def test_launcher_exits_3_naming_a_lost_stage_without_restore(tmp_path):
  proc = run_launcher(
    "--config=configs/gpt_tiny.py:runlocal",
    f"--workdir={tmp_path}",
    "--config.mesh.dp=2",
    "--config.mesh.pp=2",
    "--config.faults.schedule=2:0.1,2:1.1",
    "--config.resilience.restore_on_stage_loss=false",
  )
  assert proc.returncode == 3, proc.stderr[-2000:]
  err = proc.stderr.strip().splitlines()
  assert len(err) == 1 and "every worker of stage 1 has failed" in err[0]
  rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(rows) == 1  # step 1 completed and is kept


def test_launcher_exits_3_when_no_device_is_left(tmp_path):
  """With a whole stage lost the run restores onto the survivors; with none left it exits 3."""
  proc = run_launcher(
    "--config=configs/gpt_tiny.py:runlocal",
    f"--workdir={tmp_path}",
    "--config.mesh.dp=1",
    "--config.mesh.pp=2",
    "--config.faults.schedule=2:0.1,3:0.0",
  )
  assert proc.returncode == 3, proc.stderr[-2000:]
  assert "no device" in proc.stderr.strip().splitlines()[-1]
  assert "Traceback" not in proc.stderr
  assert ("there is no checkpoint to restore (checkpoint.every_steps=0): starting again from "
          "step 1 on dp=1 pp=1") in proc.stdout


def test_failure_outside_the_grid_is_a_config_error(tmp_path):
  proc = run_launcher(
    "--config=configs/gpt_tiny.py:runlocal",
    f"--workdir={tmp_path}",
    "--config.faults.schedule=2:5.0",
  )
  assert proc.returncode == 2 and "faults.schedule" in proc.stderr


def test_digest_changes_if_a_microbatch_is_lost():
  """The metric is computed from what ran, so a dropped micro-batch cannot go unnoticed."""
  from resilient_jax.observe.records import StepResult
  from resilient_jax.recipe import processed_ids

  mb_ids = np.arange(8).reshape(4, 2)
  ok = StepResult(0.0, {}, 0.0, [], processed=[2, 0, 1, 3])
  assert sorted(processed_ids(mb_ids, ok)) == list(range(8))
  with pytest.raises(RuntimeError, match="processed micro-batches"):
    processed_ids(mb_ids, StepResult(0.0, {}, 0.0, [], processed=[0, 1, 3]))
