"""Nothing lost on the way out: preemption, torn outputs, saves in flight, and saying what is lost.

The multi-process side (stalled processes, SIGTERM to a whole job) is in test_multiprocess.py.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from launch.checkpoint import main as checkpoint_cli
from resilient_jax import checkpoint as ckpt
from resilient_jax.checkpoint import store
from resilient_jax.checkpoint.store import CheckpointWriter
from resilient_jax.exit_codes import EXIT_PREEMPTED, exit_code_for
from resilient_jax.files import UnusableFile, check_run_files
from resilient_jax.observe.events import Restored
from resilient_jax.policy import StageLost
from resilient_jax.training.failures import kill_times
from resilient_jax.training.hooks import MetricsFile
from resilient_jax.training.loop import Preempted, Trainer
from resilient_jax.training.preemption import stop_on_signals
from tests.helpers import (
  ROOT,
  assert_matches_reference,
  expected_digests,
  loaded_checkpoints,
  tiny_config,
)


def _rows(workdir):
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_checkpoints_the_step_and_the_resume_continues_exactly(tmp_path):
  """SIGTERM while step 3 runs: the run finishes step 3, checkpoints it (checkpointing is off
  otherwise) and stops with `Preempted`; the resume, after its metrics file was torn by a kill
  mid-write, drops the torn line and trains what one device would."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, train__steps=5)
  lines = []

  def log(line):
    lines.append(line)
    if line.startswith("step    2/"):
      os.kill(os.getpid(), signal.SIGTERM)  # handled on this thread before step 3 commits

  trainer = Trainer(cfg, tmp_path, log=log)
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the library installs nothing
  with pytest.raises(Preempted) as stopped, stop_on_signals(trainer):  # the launcher's
    trainer.run()
  assert exit_code_for(stopped.value) == EXIT_PREEMPTED
  assert any("stopping after step 3: this process received SIGTERM" in x for x in lines)
  assert ckpt.committed_steps(tmp_path / "checkpoints") == [3]
  assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back

  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 4, "loss": 5.1')  # a writer killed mid-line
  lines.clear()
  result = Trainer(cfg, tmp_path, log=lines.append).run()
  assert any("dropped line 4" in x for x in lines)
  assert [s for s, _, _ in loaded_checkpoints(result)] == [3]
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  assert [r["sample_digest"] for r in rows] == expected_digests(cfg)
  assert_matches_reference(rows, result.interpreter.all_params(), cfg)


def test_sigterm_while_the_trainer_is_built_exits_9_at_once(tmp_path):
  """`launch.train` installs its handlers before it builds anything: a SIGTERM then (after the
  start's log line, before the first step) ends it with exit 9 and one line, nothing written
  (it was the default action: 143)."""
  proc = subprocess.Popen(
    [sys.executable, "-m", "launch.train", "--config=configs/gpt_tiny.py:runlocal",
     f"--workdir={tmp_path}", "--config.mesh.dp=1", "--config.mesh.pp=1"],
    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if "] training " in line:  # logged before the trainer is built
      proc.send_signal(signal.SIGTERM)
      break
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == EXIT_PREEMPTED, err
  assert err.splitlines() == ["preempted: SIGTERM before the first step; nothing to checkpoint "
                              "(the workdir is as it was): run the same command to resume"]
  assert os.listdir(tmp_path) == []


def test_damaged_observability_lines_are_set_aside_never_a_stop(tmp_path):
  """One non-UTF-8 byte, a stray `[]`, a row whose step is a string: each once made every
  resume exit 1 with a traceback. They are set aside in `metrics.jsonl.damaged` with one log
  line and the rows that read are kept (the file is rewritten to them); a damaged
  `kills.jsonl` is skipped; a directory in place of `metrics.jsonl` is a bad workdir (exit 2)."""
  good = [{"step": s, "loss": 2.0 - s / 10, "step_time_s": 0.1} for s in (1, 2, 3)]
  damaged = [b'{"step": 2, "loss": 1.9, "schedule": "zb\xff"}', b"[]",
             b'{"step": "3", "loss": 1.7}']
  text = [json.dumps(good[0]).encode(), damaged[0], json.dumps(good[1]).encode(), *damaged[1:],
          json.dumps(good[2]).encode(), b'{"step": 4, "lo']  # the last one torn by a kill
  (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(text))
  lines = []
  rows = MetricsFile(tmp_path / "metrics.jsonl", True).resume(4, lines.append, lambda: "")
  assert rows == good and _rows(tmp_path) == good
  assert len(lines) == 1, lines
  assert "dropped 4 unreadable line(s) (line 2: not UTF-8; line 4: not a row" in lines[0]
  assert f"kept in {tmp_path / 'metrics.jsonl.damaged'}" in lines[0]
  assert (tmp_path / "metrics.jsonl.damaged").read_bytes() == b"\n".join(damaged) + b"\n"

  (tmp_path / "kills.jsonl").write_bytes(b'[]\n{"process": 1, "time": 5.0, "signal": "SIGKILL"}'
                                         b'\n\xff\xfe\n{"process": "2"}\n')
  assert kill_times(tmp_path) == {1: 5.0}

  (tmp_path / "w" / "metrics.jsonl").mkdir(parents=True)
  with pytest.raises(UnusableFile, match="metrics.jsonl is a directory") as refused:
    check_run_files(tmp_path / "w")
  assert exit_code_for(refused.value) == 2
  with pytest.raises(UnusableFile):
    MetricsFile(tmp_path / "w" / "metrics.jsonl", True).resume(1, lines.append, lambda: "")


def test_an_exit_waits_for_the_save_in_flight(tmp_path, monkeypatch):
  """A whole stage lost (exit 3, no restore) while step 3's checkpoint is still being written:
  the run ends only after that checkpoint committed; a folder left by an earlier crashed save
  is removed at start."""
  real_write = CheckpointWriter._write

  def slow_write(self, *args):
    time.sleep(0.5)
    real_write(self, *args)

  monkeypatch.setattr(CheckpointWriter, "_write", slow_write)
  stale = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
  stale.mkdir(parents=True)
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=5, checkpoint__every_steps=3,
                    faults__schedule="4:0.1,4:1.1", resilience__restore_on_stage_loss=False)
  lines = []
  with pytest.raises(StageLost):
    Trainer(cfg, tmp_path, log=lines.append).run()
  assert any("removed" in x and stale.name in x for x in lines)
  assert ckpt.committed_steps(tmp_path / "checkpoints") == [3]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
  assert ckpt.load(ckpt.step_dir(tmp_path / "checkpoints", 3)).step == 3


@pytest.mark.slow  # a log message; restoring from a checkpoint is in the quick subset too
def test_a_restore_without_checkpoints_says_what_is_lost(tmp_path):
  """A whole stage lost with checkpointing off: the log says so and how many committed steps
  are lost (never "restoring the latest checkpoint"); the run starts over on the survivors."""
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=4, faults__schedule="3:0.1,3:1.1")
  lines = []
  result = Trainer(cfg, tmp_path, log=lines.append).run()
  assert [(e.step, e.from_step) for e in result.events if isinstance(e, Restored)] == [(3, 0)]
  assert not any("restoring the latest checkpoint" in x for x in lines)
  assert any("no checkpoint to restore (checkpoint.every_steps=0): starting again from step 1"
             in x and "losing 2 committed step(s)" in x for x in lines), lines
  assert [m["step"] for m in result.metrics] == [1, 2, 3, 4]

  # Run again on the finished workdir without checkpoints: the earlier rows are redone.
  lines.clear()
  Trainer(tiny_config(mesh__dp=1, mesh__pp=2, train__steps=1), tmp_path, log=lines.append).run()
  assert any("checkpointing is off" in x and "the 4 step(s) metrics.jsonl holds" in x
             for x in lines), lines


def test_non_finite_state_is_never_written_and_never_loaded(tmp_path, capsys, monkeypatch):
  params = {"w": np.ones((4, 4), np.float32), "step": np.zeros((), np.int32)}
  opt = {"0/mu/w": np.zeros((4, 4), np.float32)}
  writer = CheckpointWriter(tmp_path, keep=1)
  writer.save(1, params, opt, {"layout": {}})
  assert writer.wait()
  bad = dict(params, w=np.full((4, 4), np.nan, np.float32))
  writer.save(2, bad, opt, {"layout": {}})
  with pytest.raises(ckpt.CheckpointError, match="state of step 2 is not finite"):
    writer.wait()
  # Retention (keep=1) kept the finite checkpoint; nothing of step 2 is on disk.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]

  # One written without the check (an older version): refused on load and by `verify`.
  monkeypatch.setattr(store, "non_finite", lambda arrays: [])
  CheckpointWriter(tmp_path / "old", keep=0)._write(3, {"params": bad, "opt_state": opt},
                                                     {"layout": {}})
  monkeypatch.undo()
  path = ckpt.step_dir(tmp_path / "old", 3)
  with pytest.raises(ckpt.CheckpointError, match="'w' holds non-finite values"):
    ckpt.load(path)
  assert checkpoint_cli(["checkpoint", "verify", str(path)]) == 1
  assert "non-finite" in capsys.readouterr().err
