"""Local copies (`checkpoint/local.py`): what survivors write when process 0 is lost, and the
choice of the step a relaunch resumes from, on small fake folders (no JAX, no processes; the
job that writes and resumes them: `test_multiprocess.py::
test_killing_process_0_ends_every_process_with_exit_5_then_resumes`)."""

import dataclasses
import json

import numpy as np

from resilient_jax.checkpoint import local
from tests.helpers import tiny_config

CFG = tiny_config()


def stage_state(stage, step):
  """A stage's state: its parameters and optimizer entries, values a function of the step;
  the step counter `0/count` is shared by every stage."""
  rng = np.random.default_rng(100 * stage + step)
  params = {f"blocks.{stage}.w": rng.normal(size=(4, 3)).astype(np.float32),
            f"blocks.{stage}.b": rng.normal(size=(3,)).astype(np.float32)}
  opt = {f"0/mu/blocks.{stage}.w": rng.normal(size=(4, 3)).astype(np.float32),
         "0/count": np.asarray(step, np.int32)}
  return {"params": params, "opt_state": opt}


def needs_of(stage):
  state = stage_state(stage, 0)
  return {(g, n) for g in state for n in state[g]}


def identity(token="job-1", cfg=CFG):
  return {"token": token,
          "data": {"kind": cfg.train.data, "seed": cfg.train.seed, "global_batch": cfg.step_batch},
          "model": json.loads(json.dumps(dataclasses.asdict(cfg.model)))}


def write(tmp_path, process, stage, step, **meta):
  return local.write_copy(tmp_path, process, step, stage_state(stage, step),
                          identity(**meta))


def copies_of(tmp_path, token="job-1"):
  lines = []
  return local.scan(tmp_path, lambda m: local.refusal(m, token, CFG), lines.append), lines


def test_a_damaged_copy_is_never_loaded_and_a_replica_stands_in(tmp_path):
  # Processes 1 and 3 hold replicas of stage 1 (dp=2); each writes its own copy of step 6.
  for p in (1, 3):
    write(tmp_path, p, stage=1, step=5)
    path = write(tmp_path, p, stage=1, step=6)
  assert sorted(x.name for x in (tmp_path / "process_3").iterdir()) == ["6"]  # one a process
  (tmp_path / "process_2" / ".tmp-6-abcd").mkdir(parents=True)  # a copy cut short: no name
  want = stage_state(1, 6)
  copies, lines = copies_of(tmp_path)
  assert [c.path.parent.name for c in copies] == ["process_1", "process_3"] and lines == []
  got = local.read_step(copies, needs_of(1), 6)
  assert all(np.array_equal(got[0][k], v) for k, v in want["params"].items())
  assert all(np.array_equal(got[1][k], v) for k, v in want["opt_state"].items())
  # A flipped bit in process 1's copy of one entry: that entry comes from process 3's.
  meta = json.loads((tmp_path / "process_1" / "6" / local.META_FILE).read_text())
  offset = meta["entries"]["params"]["blocks.1.w"]["offset"]
  with (tmp_path / "process_1" / "6" / local.STATE_FILE).open("r+b") as f:
    f.seek(offset + 5)
    byte = f.read(1)
    f.seek(offset + 5)
    f.write(bytes([byte[0] ^ 0x10]))
  bad = local.read_entries(copies[0], sorted(needs_of(1)))
  assert ("params", "blocks.1.w") not in bad and len(bad) == len(needs_of(1)) - 1
  got = local.read_step(copies, needs_of(1), 6, lines.append)
  assert np.array_equal(got[0]["blocks.1.w"], want["params"]["blocks.1.w"])
  assert lines == [f"local copy {copies[0].path}: 1 entry (blocks.1.w) failed its CRC32 "
                   "check or read short: not loaded from it"]
  # Damaged in both replicas: step 6 cannot be read; a truncated file reads as damaged.
  (path / local.STATE_FILE).write_bytes((path / local.STATE_FILE).read_bytes()[:offset + 8])
  assert local.read_step(copies, needs_of(1), 6) is None
  # A copy whose metadata was edited (here, to pass for another job's) is named and skipped.
  text = (path / local.META_FILE).read_text()
  (path / local.META_FILE).write_text(text.replace("job-1", "job-2"))
  copies, lines = copies_of(tmp_path)
  assert [c.path.parent.name for c in copies] == ["process_1"]
  assert len(lines) == 1 and "process_3/6: meta.json fails its checksum" in lines[0]


def test_a_copy_from_another_job_or_model_is_refused(tmp_path):
  write(tmp_path, 1, stage=1, step=6, token="an-older-job")
  other = tiny_config(model__num_layers=CFG.model.num_layers + 2)
  write(tmp_path, 2, stage=0, step=6, cfg=other)
  write(tmp_path, 3, stage=1, step=6, cfg=tiny_config(train__seed=CFG.train.seed + 1))
  write(tmp_path, 4, stage=0, step=6, token="an-older-job")
  copies, lines = copies_of(tmp_path)
  assert copies == [] and len(lines) == 3  # one line a reason
  assert "process_1/6 and 1 more refused: written by another job" in lines[0]
  assert "process_2/6 refused: model.* differs" in lines[1]
  assert "process_3/6 refused: train.seed=" in lines[2]


def test_the_resume_step_is_the_newest_every_stage_has(tmp_path):
  # Survivors' copies: stage 0 at step 6 (process 2, process 0's replica), stage 1 at 6
  # (processes 1 and 3); the shared checkpoint is step 5's: step 6 for every process.
  write(tmp_path, 2, stage=0, step=6)
  write(tmp_path, 1, stage=1, step=6)
  copies, _ = copies_of(tmp_path)
  shared = [5]

  def covered(stage, copies=copies, shared=shared):
    everything = needs_of(0) | needs_of(1)
    held = [(c.step, c.names) for c in copies] + [(s, everything) for s in shared]
    return local.covered_steps(needs_of(stage), held)

  by_process = {0: covered(0), 1: covered(1), 2: covered(0), 3: covered(1)}
  assert by_process[0] == {5, 6}
  assert local.pick_resume(by_process, newest_shared=5, rows=6) == (6, "")
  # Copies of step 6 that failed their CRC32 in some process: the next older common step is
  # the shared checkpoint's, which the ordinary restore reads.
  tried = {p: s - {6} for p, s in by_process.items()}
  assert local.pick_resume(tried, newest_shared=5, rows=6) == (
    None, "they hold no step newer than it of every stage")
  # metrics.jsonl lacks step 6's row (process 0 died between the commit and the row).
  assert local.pick_resume(by_process, newest_shared=5, rows=5) == (
    None, "metrics.jsonl ends at step 5, before them")
  # Mixed: stage 1's copy is of step 7 only (its process read step 7's outcome, the others
  # not); no common step newer than the shared one: the shared checkpoint.
  write(tmp_path, 1, stage=1, step=7)
  copies, _ = copies_of(tmp_path)
  mixed = {0: covered(0, copies), 1: covered(1, copies)}
  assert mixed == {0: {5, 6}, 1: {5, 7}}
  assert local.pick_resume(mixed, newest_shared=5, rows=7)[0] is None
  # No shared checkpoint and no common step: from scratch (the ordinary start).
  alone = {0: covered(0, copies, []), 1: covered(1, copies, [])}
  assert local.newest_common_step(alone) is None
  assert local.pick_resume(alone, newest_shared=0, rows=7)[0] is None


def test_a_step_with_a_stage_nobody_copied_is_not_covered(tmp_path):
  """A whole stage lost with process 0 (it held every replica of stage 0): no copy holds it."""
  write(tmp_path, 1, stage=1, step=6)
  copies, _ = copies_of(tmp_path)
  held = [(c.step, c.names) for c in copies]
  assert local.covered_steps(needs_of(0), held) == set()
  assert local.covered_steps(needs_of(1), held) == {6}


def test_the_exit_line_says_what_was_lost_and_where_the_copy_went(monkeypatch):
  """A process that loses the coordination service cannot tell process 0's loss from its own
  host being cut off (then the job goes on without it): its last line names both, and where
  its local copy went; not that the job will be restarted. The watchdog and the runtime's
  abort may both end the process: the copy is written once and both say the same."""
  import threading
  import types

  from resilient_jax.runtime import cluster as cluster_module

  ended = []
  monkeypatch.setattr(cluster_module, "end_process", lambda code, line: ended.append((code, line)))

  def process(last_words, wait_timeout_s=5):
    c = object.__new__(cluster_module.Cluster)
    c.process_id, c.coordinator = 1, "127.0.0.1:4321"
    c.cfg = types.SimpleNamespace(wait_timeout_s=wait_timeout_s)
    c.last_words, c._words_lock, c._words_said = last_words, threading.Lock(), None
    return c

  writes = []
  c = process(lambda: writes.append(1) or "its stages' state of step 6 is in /w/local/process_1/6")
  c.coordinator_lost()
  c.coordinator_lost()  # the second of the two that noticed
  line = ("process 1: lost the coordination service at 127.0.0.1:4321 (process 0 lost, or this "
          "host cut off); its stages' state of step 6 is in /w/local/process_1/6; exiting with "
          "code 5")
  assert ended == [(5, line)] * 2 and writes == [1]
  assert "restart" not in line and "\n" not in line

  ended.clear()
  process(None).coordinator_lost()  # lost before the trainer noted a step
  assert ended[0][1].endswith("cut off); no local copy: no step was committed yet; exiting "
                              "with code 5")
  stuck = threading.Event()
  ended.clear()
  process(stuck.wait, wait_timeout_s=0.05).coordinator_lost()
  stuck.set()
  assert ended[0][1].endswith("cut off); its local copy did not finish within 0.05s "
                              "(distributed.wait_timeout_s); exiting with code 5")
  # The runtime's own abort says the same, naming what noticed.
  assert cluster_module.lost_coordinator_line(2, "10.0.0.5:8476", "x", "its distributed runtime "
                                              ) == ("process 2: its distributed runtime lost the "
                                                    "coordination service at 10.0.0.5:8476 "
                                                    "(process 0 lost, or this host cut off); x")
