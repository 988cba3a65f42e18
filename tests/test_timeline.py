"""Tests for the Chrome-trace and Gantt writers in `resilient_jax.timeline`."""

from __future__ import annotations

import dataclasses
import json

import matplotlib.pyplot as plt
import pytest

from resilient_jax import timeline
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
