"""Events (`observe/events.py`): what happened to a run as typed records, rendered to the log and
`events.jsonl`; the coordinator's failures, rejoins and decisions among them."""

from __future__ import annotations

import json

from resilient_jax.observe.events import (
  Copied,
  Decided,
  EventLog,
  Failure,
  Rejoined,
  read_events,
)
from resilient_jax.policy import RunCoordinator
from tests.helpers import tiny_config


def test_an_event_is_a_line_a_record_and_a_json_row(tmp_path):
  lines = []
  log = EventLog(lines.append, tmp_path / "events.jsonl")
  log.emit(Failure(3, 5, (1, 1), mid_step=True))
  log.emit(Copied(3, 2**20), line=False)
  assert lines == ["FAILURE: worker (dp=1, stage=1) failed during step 3"]
  assert log.of(Failure) == [Failure(3, 5, (1, 1), True)] and len(log.events) == 2
  rows = read_events(tmp_path / "events.jsonl")
  assert rows == [{"kind": "failure", "step": 3, "node": 5, "worker": [1, 1], "mid_step": True},
                  {"kind": "copy", "step": 3, "nbytes": 2**20}]
  assert read_events(tmp_path / "events.jsonl", ["copy"]) == rows[1:]


def test_a_damaged_events_file_reads_without_its_damage(tmp_path):
  path = tmp_path / "events.jsonl"
  path.write_text(json.dumps({"kind": "failure", "step": 1}) + "\n[1, 2]\n{not json\n"
                  + json.dumps({"step": 2}) + "\n" + json.dumps({"kind": "copy", "step": 2})
                  + "\n")
  assert [r["kind"] for r in read_events(path)] == ["failure", "copy"]


def test_the_coordinator_records_failures_rejoins_and_decisions():
  cfg = tiny_config(mesh__dp=2, mesh__pp=2)
  lines = []
  coord = RunCoordinator(cfg, range(4), log=lines.append)
  coord.fail({3}, 2, mid_step=True)
  coord.rejoin({3}, 4)
  kinds = [type(e) for e in coord.events.events]
  assert kinds == [Failure, Decided, Rejoined, Decided]
  failure, decided, rejoined, back = coord.events.events
  assert (failure.step, failure.node, failure.worker, failure.mid_step) == (2, 3, (1, 1), True)
  assert decided.live_workers == 3 and decided.policy == "recycle" and decided.plan == "adaptive"
  assert decided.predicted_ratio > 1 and decided.relative_to_fault_free == decided.predicted_ratio
  assert (rejoined.step, rejoined.worker) == (4, (1, 1))
  assert back.live_workers == 4 and back.relative_to_fault_free == 1.0
  assert "FAILURE: worker (dp=1, stage=1) failed during step 2" in lines
