"""`python -m launch.train` end to end with its optional outputs: an absl log file, TensorBoard
events and a `jax.profiler` trace (the README's main job: tests/test_readme.py; bad inputs:
tests/test_bad_inputs.py)."""

import json
import os

from tests.helpers import run_launcher
from tests.test_tensorboard import annotated_ops, assert_losses_match, trace_file

CONFIG = "--config=configs/gpt_tiny.py:runlocal"


def test_train_with_a_log_dir_tensorboard_and_a_trace(tmp_path):
  proc = run_launcher(
    CONFIG,
    f"--workdir={tmp_path}",
    "--config.mesh.dp=2",
    "--config.mesh.pp=4",
    "--config.pipeline.schedule=zb-h1",
    "--config.profile.trace_steps=2",
    f"--log_dir={tmp_path / 'logs'}",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  # --log_dir: the progress lines are in absl's log file, at INFO; the console keeps the result
  # (the final loss, the outputs and the log file).
  (log,) = (tmp_path / "logs").glob("*.INFO.*")
  lines = log.read_text().splitlines()
  step = [x for x in lines if "step    3/3" in x and "samples/s" in x]
  assert len(step) == 1 and step[0].startswith("I"), lines
  assert any(f"outputs in {tmp_path}" in x for x in lines), lines
  # The resolved configuration, a line per section, before the first step.
  mesh = next(i for i, x in enumerate(lines) if "config mesh: dp=2 pp=4 tp=1" in x)
  assert mesh < lines.index(step[0]) and any("config train: steps=3" in x for x in lines)
  assert "step    3/3" not in proc.stdout and proc.stderr == ""
  assert "done: 3 steps" in proc.stdout and str(tmp_path / "metrics.jsonl") in proc.stdout
  assert f"log: {log}" in proc.stdout
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 3 and rows[-1]["live_workers"] == 8
  assert (tmp_path / "timeline.png").exists()
  assert_losses_match(tmp_path, rows)
  # The traced step: every stage program's named scope, of its op kind (zb-h1 splits B and W),
  # and the reduction's, and the host's annotation of every op's dispatch, named as in the
  # timeline with its stage (the last step's, the same schedule).
  where = tmp_path / "profile" / "step2"
  assert any(f"tracing step 2 with jax.profiler into {where}" in x for x in lines)
  trace = trace_file(tmp_path, 2)
  for program, kind in (("stage_forward", "F"), ("backward_input", "B"),
                        ("weight_grads", "W"), ("optimizer_step", "OPT")):
    assert f"jit({program})/{kind}/".encode() in trace, kind
  assert b"jit(add)/AR/add" in trace
  timeline = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
  kinds = ("F", "B", "W", "OPT")
  ops = {(e["name"], e["pid"], e["tid"]) for e in timeline if e.get("cat") in kinds}
  assert len(ops) == 8 * (3 * 4 + 1) and annotated_ops(trace) == ops
  assert not list((tmp_path / "profile").glob("step[13]"))


def test_the_pause_hook_stops_once_at_each_of_its_points(tmp_path, monkeypatch):
  """`RESILIENT_JAX_PAUSE` with several points (what `benchmarks/soak.py` gives a process that
  is killed again after each relaunch, and process 0 that holds at every relaunch): each point
  pauses once, in turn, announcing itself in the marker file until the launcher removes it."""
  import threading
  import time

  from resilient_jax.training.faults import pause_hook_from_env

  marker = tmp_path / "p1"
  monkeypatch.setenv("RESILIENT_JAX_PAUSE", "0:joined,4:F1,7:save")
  monkeypatch.setenv("RESILIENT_JAX_PAUSE_FILE", str(marker))
  hook = pause_hook_from_env()
  seen = []

  def run() -> None:
    for point in [(0, "joined"), (3, "F1"), (4, "start"), (4, "F1"), (4, "F1"), (7, "save")]:
      hook(*point)  # returns at once, or once the marker is gone
      seen.append(point)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  for step, at, before in [(0, "joined", 0), (4, "F1", 3), (7, "save", 5)]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      try:
        got = json.loads(marker.read_text())
        break
      except (FileNotFoundError, ValueError):  # not yet there, or half written
        time.sleep(0.005)
    time.sleep(0.05)  # it waits there: nothing past the point runs
    assert got | {"time": 0} == {"step": step, "at": at, "time": 0}
    assert len(seen) == before
    marker.unlink()
  t.join(timeout=30)
  assert len(seen) == 6  # (4, F1) a second time: it went on through it


def test_launch_local_exits_0_for_a_completed_job_whatever_it_survived():
  """`launch.local`'s exit code from its processes' `Popen.returncode`s (negative: a signal). A
  worker SIGKILLed from outside while the job completed made it exit 247 (`sys.exit(-9)`)."""
  from launch.local import job_exit_code

  assert job_exit_code({0: 0, 1: 0, 2: -9, 3: 0}, set()) == 0  # a crash the job survived
  assert job_exit_code({0: 0, 1: -9}, {1}) == 0  # its own --kill
  assert job_exit_code({0: 0, 1: 7}, set()) == 0  # declared dead; the others went on
  assert job_exit_code({0: 0, 1: 6}, set()) == 6  # a wait timed out: not the design
  assert job_exit_code({0: 9, 1: 9}, set()) == 9  # preempted
  assert job_exit_code({0: -9, 1: 5}, set()) == 128 + 9  # process 0 crashed: as a shell says
  assert job_exit_code({0: -9, 1: 5, 2: -15}, {0}) == 5  # its --kill of process 0: the others' 5


def test_a_shipped_config_is_found_by_its_name_from_any_directory(tmp_path, monkeypatch):
  """`--config=gpt_tiny[:VARIANT]`, `--config=configs/gpt_tiny.py` and a simulator config's
  bare name all reach the shipped files from a directory that has none; a file of that name
  here comes first, and an unknown name is left for the one-line error."""
  from launch import cli
  from tests.helpers import ROOT

  monkeypatch.chdir(tmp_path)
  got = cli.packaged_configs(["prog", "--config=gpt_tiny:runlocal",
                              "--config=configs/llama_tiny.py", "--config=gpt3_6_7b",
                              "--config=nothing_here", "--other=gpt_tiny"])
  shipped = os.path.realpath(ROOT)
  assert [os.path.realpath(a.split("=", 1)[1].split(":")[0]) if a.startswith("--config=")
          and "nothing" not in a else a for a in got[1:]] == [
    f"{shipped}/configs/gpt_tiny.py", f"{shipped}/configs/llama_tiny.py",
    f"{shipped}/configs/sim/gpt3_6_7b.py", "--config=nothing_here", "--other=gpt_tiny"]
  assert got[1].endswith(":runlocal")
  (tmp_path / "gpt_tiny").write_text("")  # here first
  assert cli.packaged_configs(["prog", "--config=gpt_tiny"]) == ["prog", "--config=gpt_tiny"]


def test_closed_loop_tracebacks_are_left_out_of_stderr_and_nothing_else():
  """A checkpoint write that fails mid-save (a full disk) made tensorstore's callbacks print a
  dozen `Event loop is closed` tracebacks beside the one-line error; the launchers' stderr
  leaves those out and passes every other line, other tracebacks included."""
  import io

  from launch.cli import ClosedLoopTracebacks

  closed = ('Traceback (most recent call last):\n  File "base_events.py", line 806, in '
            "call_soon_threadsafe\n    self._check_closed()\nRuntimeError: Event loop is closed\n")
  other = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: real\n'
  out = io.StringIO()
  err = ClosedLoopTracebacks(out)
  # Another thread's line in the middle of one (as the error line came, on a full disk).
  interleaved = closed.replace("    self._check", "error: saving failed\n    self._check")
  for chunk in ["warning: ", "a line\n", closed, closed[:30], closed[30:], other, interleaved,
                "error: a background checkpoint save failed: RESOURCE_EXHAUSTED\n"]:
    err.write(chunk)
  err.flush()
  assert out.getvalue() == ("warning: a line\n" + other + "error: saving failed\n"
                            + "error: a background checkpoint save failed: RESOURCE_EXHAUSTED\n")
  assert err.dropped == 3
