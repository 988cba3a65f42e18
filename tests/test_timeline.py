"""Tests for the Chrome-trace and Gantt writers in `resilient_jax.observe.timeline`, the timelines a
run draws around its failures, and the failure report's step times."""

from __future__ import annotations

import dataclasses
import json
import re

import matplotlib.pyplot as plt
import pytest

from resilient_jax.observe import timeline
from resilient_jax.policy.phases import Phase, PhaseLog
from resilient_jax.schedule.core import AR, OPT, B, F, Op, W

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass(frozen=True)
class FakeSpan:
  """Stands in for the cost model's `Span`: only the attributes the writers read."""

  worker: tuple[int, int]
  op: Op
  start: float
  end: float


def grid_spans() -> list[FakeSpan]:
  """A hand-built 1F1B-ish step on a 2x2 grid, 2 micro-batches per pipeline, in seconds."""
  spans = []
  f, b, w, ar, opt = 0.010, 0.012, 0.008, 0.005, 0.002
  for d in range(2):
    mbs = [2 * d, 2 * d + 1]
    # stage 0: F F ... B W B W, stage 1 starts after its input arrives.
    t = 0.0
    for mb in mbs:
      spans.append(FakeSpan((d, 0), Op(F, mb), t, t + f))
      t += f
    t1 = f
    for mb in mbs:
      spans.append(FakeSpan((d, 1), Op(F, mb), t1, t1 + f))
      spans.append(FakeSpan((d, 1), Op(B, mb), t1 + f, t1 + f + b))
      spans.append(FakeSpan((d, 1), Op(W, mb), t1 + f + b, t1 + f + b + w))
      t1 += f + b + w
    t0 = 2 * f + b  # stage 0 waits for the gradient of the first micro-batch
    for mb in mbs:
      spans.append(FakeSpan((d, 0), Op(B, mb), t0, t0 + b))
      spans.append(FakeSpan((d, 0), Op(W, mb), t0 + b, t0 + b + w))
      t0 += b + w + 0.004
    end = max(t0, t1)
    for s in range(2):
      spans.append(FakeSpan((d, s), Op(AR), end, end + ar))
      spans.append(FakeSpan((d, s), Op(OPT), end + ar, end + ar + opt))
  return spans


def test_chrome_trace_events(tmp_path):
  spans = grid_spans()
  transfers = [((0, 0), (0, 1), 0.010, 0.011, "act mb0"), ((1, 1), (1, 0), 0.03, 0.031, "grad")]
  out = timeline.write_chrome_trace(
    spans,
    tmp_path / "nested" / "trace.json",
    title="2x2",
    metadata={"schedule": "1f1b"},
    transfers=transfers,
  )
  assert out == str(tmp_path / "nested" / "trace.json")
  with open(out) as fh:
    trace = json.load(fh)

  assert trace["displayTimeUnit"] == "ms"
  assert trace["otherData"] == {"schedule": "1f1b", "title": "2x2"}
  events = trace["traceEvents"]
  xs = [e for e in events if e["ph"] == "X" and e["cat"] != "comm"]
  assert len(xs) == len(spans)
  by_key = {(e["pid"], e["tid"], e["name"]): e for e in xs}
  for sp in spans:
    e = by_key[(sp.worker[0], sp.worker[1], str(sp.op))]
    assert e["cat"] == sp.op.kind
    assert e["ts"] == pytest.approx(sp.start * 1e6)
    assert e["dur"] == pytest.approx((sp.end - sp.start) * 1e6)
    assert e["args"] == {"mb": sp.op.mb, "worker": list(sp.worker)}

  meta = [e for e in events if e["ph"] == "M"]
  procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
  assert procs == {0: "pipeline 0", 1: "pipeline 1"}
  for d in range(2):
    for s in range(2):
      assert threads[(d, s)] == f"stage {s}"

  comm = [e for e in events if e["ph"] == "X" and e["cat"] == "comm"]
  assert len(comm) == 2
  first = next(e for e in comm if e["name"] == "act mb0")
  assert (first["pid"], first["ts"], first["args"]["src"]) == (0, pytest.approx(1e4), [0, 0])
  assert threads[(first["pid"], first["tid"])] == "stage 1 recv"


def test_chrome_trace_accepts_tuples_and_units(tmp_path):
  spans = [((0, 0), Op(F, 0), 0, 5), ((0, 0), ("B", 0), 5, 9), ((0, 1), "OPT", 9, 10)]
  out = timeline.write_chrome_trace(spans, tmp_path / "t.json", time_unit="ms")
  with open(out) as fh:
    trace = json.load(fh)
  xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert [(e["name"], e["ts"], e["dur"]) for e in xs] == [
    ("F0", 0, 5000),
    ("B0", 5000, 4000),
    ("OPT", 9000, 1000),
  ]
  assert trace["otherData"] == {}


def test_rejects_bad_input(tmp_path):
  with pytest.raises(ValueError, match="ends before"):
    timeline.write_chrome_trace([((0, 0), Op(F, 0), 2, 1)], tmp_path / "t.json")
  with pytest.raises(ValueError, match="time_unit"):
    timeline.plot_gantt([], tmp_path / "g.png", time_unit="hours")


@pytest.mark.parametrize("highlight", [None, {1, 2}, {((0, 1), 1)}])
def test_gantt_png(tmp_path, highlight):
  plt.close("all")
  transfers = [((0, 0), (0, 1), 0.010, 0.011, "act")]
  out = timeline.plot_gantt(
    grid_spans(),
    tmp_path / "sub" / "gantt.png",
    title="2x2 test",
    highlight_mbs=highlight,
    transfers=transfers,
  )
  assert out == str(tmp_path / "sub" / "gantt.png")
  with open(out, "rb") as fh:
    data = fh.read()
  assert data[:8] == PNG_MAGIC
  assert len(data) > 1000
  assert plt.get_fignums() == []


def test_gantt_empty(tmp_path):
  out = timeline.plot_gantt([], tmp_path / "empty.png")
  with open(out, "rb") as fh:
    assert fh.read(8) == PNG_MAGIC
  assert plt.get_fignums() == []


def _png_size(path) -> tuple[int, int]:
  data = open(path, "rb").read(24)
  return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_failed_worker_keeps_a_marked_row(tmp_path):
  spans = [sp for sp in grid_spans() if sp.worker != (1, 1)]  # (1, 1) failed: no ops
  failed = {(1, 1): 5}
  trace = json.loads(open(timeline.write_chrome_trace(spans, tmp_path / "t.json",
                                                      failed=failed)).read())
  assert trace["otherData"]["failed_workers"] == [{"worker": [1, 1], "step": 5}]
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
  assert threads[(1, 1)] == "stage 1 (failed at step 5)" and threads[(1, 0)] == "stage 0"
  (mark,) = [e for e in trace["traceEvents"] if e.get("cat") == "failed"]
  assert (mark["pid"], mark["tid"], mark["name"]) == (1, 1, "failed at step 5")
  end = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("cat") in _KINDS)
  assert (mark["ts"], mark["dur"]) == (0, pytest.approx(end))  # across the whole step

  # The Gantt chart keeps the row: as tall as the chart of all four workers, one row taller
  # than the chart without the failed worker.
  plt.close("all")
  full = _png_size(timeline.plot_gantt(grid_spans(), tmp_path / "full.png"))
  marked = _png_size(timeline.plot_gantt(spans, tmp_path / "marked.png", failed=failed))
  gone = _png_size(timeline.plot_gantt(spans, tmp_path / "gone.png"))
  assert marked[1] == full[1] > gone[1]
  assert plt.get_fignums() == []


_KINDS = {"F", "B", "W", "AR", "OPT"}


def test_which_steps_are_drawn_and_their_titles():
  from resilient_jax.observe.profiling import RunTimelines

  tl = RunTimelines([5, 10], end=20, total=20)
  before = [s for s in range(1, 21) if tl.profile(s, failed=s > 5)]
  assert before == [4, 6, 11, 20]
  assert [tl.kind(s, failed=s >= 5) for s in (4, 6, 11, 20)] == [
    "fault-free", "after failure", "after failure", None]
  assert tl.title(4, "fault-free", {}, [], 0).startswith(
    "step 4: fault-free, the last step before the failure at step 5")
  assert tl.title(6, "after failure", {(1, 1): 5}, [5], 0) == (
    "step 6: the first step after the failure at step 5 (worker d1 s1)")
  assert tl.title(20, None, {(1, 1): 5, (0, 3): 10}, [5, 10], 2) == (
    "step 20 of 20: the last step, after the failures at steps 5, 10 (2 XLA compilations "
    "ran in this step: its op times include them)")
  # A short run draws its post-failure step even when it is the last; step 1 compiles every
  # program, so a failure at step 2 leaves no fault-free step to draw.
  short = RunTimelines([2], end=3, total=3)
  assert [s for s in (1, 2, 3) if short.profile(s, failed=s > 2)] == [3]
  assert short.kind(3, failed=True) == "after failure"
  last = RunTimelines([3], end=3, total=3)
  assert last.profile(2, failed=False) and last.kind(2, failed=False) == "fault-free"
  assert last.kind(3, failed=True) == "after failure"
  assert last.title(3, "after failure", {(0, 1): 3}, [3], 0) == (
    "step 3: run on the survivors of the failure in this step (worker d0 s1)")


def _trace(path):
  return json.loads(path.read_text())


def test_failure_run_draws_fault_free_and_post_failure_steps(rerouted_run):
  """Worker (1, 1) fails at the start of step 3 of 4: step 2 is drawn fault-free, step 4 (the
  last) as the first after the failure, each file named by the step it shows."""
  wd = rerouted_run.workdir
  drawn = sorted(p.name for p in wd.glob("timeline_step*.json"))
  assert drawn == ["timeline_step2.json", "timeline_step4.json"]
  for name in drawn:
    assert _trace(wd / name)["otherData"]["step"] == int(name[len("timeline_step"):-5])
    assert (wd / name.replace(".json", ".png")).read_bytes()[:8] == PNG_MAGIC

  fault_free = _trace(wd / "timeline_step2.json")
  other = fault_free["otherData"]
  assert other["title"].startswith("step 2: fault-free, the last step before the failure at "
                                   "step 3")
  assert "failed_workers" not in other and other["schedule"] == "1f1b"
  assert {(e["pid"], e["tid"]) for e in fault_free["traceEvents"] if e.get("cat") in _KINDS} \
    == {(0, 0), (0, 1), (1, 0), (1, 1)}

  for name, title in (("timeline_step4.json", "step 4: the first step after the failure at "
                                                "step 3 (worker d1 s1)"),
                      ("timeline.json", "step 4 of 4: the last step, after the failure at "
                                        "step 3")):
    trace = _trace(wd / name)
    assert trace["otherData"]["title"].startswith(title)
    assert trace["otherData"]["failed_workers"] == [{"worker": [1, 1], "step": 3}]
    events = trace["traceEvents"]
    assert [(e["pid"], e["tid"], e["name"]) for e in events if e.get("cat") == "failed"] == [
      (1, 1, "failed at step 3")]
    assert not [e for e in events if e.get("cat") in _KINDS and (e["pid"], e["tid"]) == (1, 1)]


def test_failure_log_headlines_the_replayed_step_time_on_simulated_devices(rerouted_run):
  lines = rerouted_run.lines
  assert rerouted_run.trainer.coordinator.simulated_devices == 8
  (report,) = [x for x in lines if x.startswith("step time ")]
  assert re.match(r"step time x\d+\.\d\d after the failure at step 3: both schedules replayed "
                  r"with the op times measured at step 2 \(\d+\.\d ms, \d+\.\d ms; with step 4's "
                  r"own op times x\d+\.\d\d, which single steps' timings on shared cores make "
                  r"noisy\); cost model predicts x\d+\.\d\d; wall-clock times are not meaningful "
                  r"on 8 simulated CPU devices sharing this host's cores$", report), report
  # It follows the line of the step it replays.
  assert lines.index(report) == next(i for i, x in enumerate(lines) if x.startswith("step    4"))\
    + 1
  summary = lines[lines.index(next(x for x in lines if x.startswith("step times by"))):]
  assert "replayed" in summary[1] and "(step 2, x1.00 of fault-free)" in summary[1]
  assert "not meaningful" in summary[0] and "(step 4," in summary[2]


class _Phases(PhaseLog):
  def __init__(self, simulated: int):
    self.lines = []
    self.log = self.lines.append
    self.simulated_devices = simulated
    self.phases = [Phase("zb-h1", 8, 1.0)]

  def run(self):
    """Steps 1-4 fault-free (4 profiled), a failure at step 5, step 6 profiled, 7 warm."""
    for step in (1, 2, 3, 4):
      self.record_step_time(step, 0.3, profiled=step == 4, replayed_s=0.010 if step == 4 else None)
    self._new_phase("adaptive", 7, 1.3, failure_step=5)
    self.record_step_time(5, 0.5)
    self.record_step_time(6, 0.5, profiled=True, replayed_s=0.012)
    self.record_step_time(7, 0.1)
    return self.lines


def test_failure_report_on_real_accelerators_stays_in_wall_time():
  assert _Phases(simulated=0).run() == [
    "step time 0.300s before the failure at step 5, 0.100s after (x0.33; cost model predicts "
    "x1.30)"]
  assert _Phases(simulated=8).run() == [
    "step time x1.20 after the failure at step 5, replayed from measured op times (10.0 ms at "
    "step 4, 12.0 ms at step 6; cost model predicts x1.30; wall-clock times are not meaningful "
    "on 8 simulated CPU devices sharing this host's cores)"]


def test_a_failure_reported_from_measured_op_times_compares_schedules_not_noise():
  """Both schedules replayed with the op times of the step before the failure: the ratio is
  the schedules' (here the re-routed plan's, which does more per survivor), however the other
  step's own op times came out; those are given beside it."""
  from resilient_jax.schedule import adaptive
  from resilient_jax.schedule.cost import OpCosts, simulate
  from resilient_jax.schedule.generators import generate
  from resilient_jax.schedule.routing import FailureState

  costs = OpCosts(f=0.001, b=0.001, w=0.001)
  before = generate("zb-h1", 2, 2, 4)
  after = adaptive.plan("adaptive", FailureState(2, 2, 4, frozenset({(1, 1)})), costs,
                        base="zb-h1")
  log = _Phases(simulated=8)
  log.record_step_time(1, 0.3)
  log.record_step_time(2, 0.3, profiled=True, replayed_s=0.010, measured=(before, costs))
  log._new_phase("adaptive", 3, 1.3, failure_step=3)
  log.record_step_time(3, 0.5)
  log.record_step_time(4, 0.5, profiled=True, replayed_s=0.004, measured=(after, costs))
  ratio = simulate(after, costs).makespan / simulate(before, costs).makespan
  assert ratio > 1
  (line,) = log.lines
  assert line.startswith(f"step time x{ratio:.2f} after the failure at step 3: both schedules "
                         "replayed with the op times measured at step 2"), line
  assert "with step 4's own op times x0.40" in line, line


def test_run_outputs_names_an_earlier_runs_files_apart(tmp_path):
  import os
  import time

  from resilient_jax.files import run_outputs

  started = time.time() - 30  # this run started then; the earlier one wrote before it
  for name in ("timeline_step6.png", "metrics.jsonl", "timeline.png", "config.json", ".tmp",
               "timeline_step11.png", "timeline_step4.png"):
    (tmp_path / name).write_text("x")
  os.utime(tmp_path / "timeline_step6.png", (started - 60, started - 60))
  assert run_outputs(tmp_path, started) == (
    ["metrics.jsonl", "timeline.png", "config.json", "timeline_step4.png", "timeline_step11.png"],
    ["timeline_step6.png"])
