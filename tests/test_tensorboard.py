"""TensorBoard event files (`resilient_jax.observe.tensorboard`), read back with TensorBoard's
own reader.

The runs these checks read are other tests' (tests/test_launcher.py, the restore in
tests/test_checkpoint.py, the simulation in tests/test_sim.py): the helpers are here.
"""

from __future__ import annotations

import glob
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from resilient_jax.observe.tensorboard import Board


def read_events(logdir: str | os.PathLike) -> EventAccumulator:
  """Every event of `logdir`, as TensorBoard reads it (with its purge of rewound steps)."""
  return EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def scalars(logdir: str | os.PathLike, tag: str) -> list[tuple[int, float]]:
  return [(e.step, e.value) for e in read_events(logdir).Scalars(tag)]


def texts(logdir: str | os.PathLike, tag: str) -> list[tuple[int, str]]:
  """Text events `events/<tag>` as (step, text)."""
  found = read_events(logdir).Tensors(f"events/{tag}/text_summary")
  return [(e.step, e.tensor_proto.string_val[0].decode()) for e in found]


def assert_losses_match(workdir, rows: list[dict]) -> None:
  """`tb/` holds the loss of every metrics row once, with the same value."""
  got = scalars(workdir / "tb", "train/loss")
  assert [s for s, _ in got] == [r["step"] for r in rows]
  assert [v for _, v in got] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


def trace_file(workdir, step: int) -> bytes:
  """The `jax.profiler` trace of `step` in `workdir/profile` (its XPlane protobuf)."""
  found = glob.glob(str(workdir / "profile" / f"step{step}" / "**" / "*.xplane.pb"),
                    recursive=True)
  assert len(found) == 1, found
  with open(found[0], "rb") as f:
    return f.read()


def annotated_ops(trace: bytes) -> set[tuple[str, int, int]]:
  """(op, pipeline, stage) of every op dispatch the host annotated in a trace (AR aside)."""
  from jax.profiler import ProfileData

  found = set()
  for plane in ProfileData.from_serialized_xspace(trace).planes:
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        if "pipeline" in stats:
          found.add((e.name, stats["pipeline"], stats["stage"]))
  return found


def test_rewound_steps_are_read_once_with_their_new_values(tmp_path):
  board = Board(tmp_path, start_step=1)
  for step in (1, 2, 3):
    board.step({"step": step, "loss": float(step), "live_workers": 4, "grad_norm": 0.5})
  board.text(3, "failure", "node(s) [1] failed during step 3")
  board.rewind(2)  # a restore of step 1: steps 2 and 3 are redone
  board.text(3, "failure", "node(s) [1] failed during step 3 (again)")
  board.step({"step": 2, "loss": 20.0, "live_workers": 3, "grad_norm": 0.5, "skipped": True})
  board.close()
  # A resumed run (its own file) that redoes step 3 and goes on.
  board = Board(tmp_path, start_step=3)
  for step in (3, 4):
    board.step({"step": step, "loss": 10.0 * step, "live_workers": 3, "grad_norm": 0.5})
  board.close()
  assert len(os.listdir(tmp_path)) == 2
  assert scalars(tmp_path, "train/loss") == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]
  assert scalars(tmp_path, "train/live_workers") == [(1, 4.0), (2, 3.0), (3, 3.0), (4, 3.0)]
  assert [v for _, v in scalars(tmp_path, "train/skipped")] == [0.0, 1.0, 0.0, 0.0]
  assert texts(tmp_path, "failure")[-1] == (3, "node(s) [1] failed during step 3 (again)")


def test_a_write_error_is_logged_once_and_never_raised(tmp_path):
  lines = []
  (tmp_path / "file").write_text("")
  board = Board(tmp_path / "file" / "tb", log=lines.append)  # cannot create the directory
  board.step({"step": 1, "loss": 1.0})
  board.text(1, "failure", "x")
  board.close()
  assert len(lines) == 1 and "TensorBoard: cannot write events" in lines[0]

  lines.clear()
  board = Board(tmp_path / "tb", log=lines.append)
  board.step({"step": 1, "loss": 1.0})

  def full_disk(event):
    raise OSError(28, "No space left on device")

  board._events.write_event = full_disk
  for step in (2, 3):
    board.step({"step": step, "loss": 1.0})
  board.close()
  assert len(lines) == 1 and "No space left on device" in lines[0]
  assert not board.active
  assert scalars(tmp_path / "tb", "train/loss") == [(1, 1.0)]


def test_a_board_without_directory_writes_nothing(tmp_path):
  board = Board(None)
  board.step({"step": 1, "loss": 1.0})
  board.rewind(1)
  board.close()
  assert not board.active
