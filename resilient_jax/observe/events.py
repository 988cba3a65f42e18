"""What happened to a run, as typed records: failures, the policy's decisions, restores, state
copies, rejoins, stragglers, corrupt replicas and checkpoints.

Every part that acts emits an `Event` (`EventLog.emit`); the renderings read them: the log line
(`Event.line`, the words a person reads), `events.jsonl` in the workdir (process 0; one JSON
object per event with its `kind`, what tools and tests read), TensorBoard's text tab, and the
run's `TrainResult.events`. Tests assert on these records, not on the wording of the lines.

Costs: O(1) per event (a line appended to a file, a list entry); events come per failure,
rejoin, re-weighting, corruption or checkpoint, never per op.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from resilient_jax.files import read_jsonl


@dataclasses.dataclass(frozen=True)
class Event:
  """One thing that happened at `step` (1-based; the step it happened at or before)."""

  step: int
  kind: ClassVar[str] = "event"

  def line(self) -> str:
    """The log's rendering."""
    return f"{self.kind} at step {self.step}"

  def to_json(self) -> dict[str, Any]:
    out = {"kind": self.kind}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      out[f.name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(
        v, (tuple, list, frozenset)) else v
    return out


def _when(mid_step: bool) -> str:
  return "during" if mid_step else "at the start of"


@dataclasses.dataclass(frozen=True)
class Failure(Event):
  """`node` was lost; `worker` is its grid position `(dp, stage)` (None: it held no work)."""

  node: int
  worker: tuple[int, int] | None
  mid_step: bool
  kind: ClassVar[str] = "failure"

  def line(self) -> str:
    if self.worker is None:
      return f"FAILURE: node {self.node} failed {_when(self.mid_step)} step {self.step} " \
             "(it held no work)"
    d, s = self.worker
    return f"FAILURE: worker (dp={d}, stage={s}) failed {_when(self.mid_step)} step {self.step}"


@dataclasses.dataclass(frozen=True)
class Rejoined(Event):
  """`node` (grid position `worker`) runs again from the start of `step`."""

  node: int
  worker: tuple[int, int]
  kind: ClassVar[str] = "rejoin"

  def line(self) -> str:
    d, s = self.worker
    return f"REJOIN: worker (dp={d}, stage={s}) rejoined at the start of step {self.step}"


@dataclasses.dataclass(frozen=True)
class Decided(Event):
  """The policy in force after a change of membership or speeds: the plan it runs (`plan`,
  its name), on `live_workers`, and the cost model's step time relative to the one before
  (`predicted_ratio`) and to the fault-free plan's (`relative_to_fault_free`)."""

  policy: str
  plan: str
  live_workers: int
  predicted_ratio: float
  relative_to_fault_free: float
  kind: ClassVar[str] = "decision"

  def line(self) -> str:
    return f"  predicted step time x{self.predicted_ratio:.2f}"


@dataclasses.dataclass(frozen=True)
class Restored(Event):
  """A failure at `step` that no plan survives: the checkpoint of `from_step` (0: none, from
  the initial state) was restored onto `plan`; steps `from_step + 1 .. step` are redone."""

  from_step: int
  plan: str
  reason: str
  kind: ClassVar[str] = "restore"

  def line(self) -> str:
    redo = self.step - self.from_step
    return (f"{self.reason}; restored the checkpoint of step {self.from_step} onto {self.plan}; "
            f"redoing {redo} step(s)" if self.from_step else
            f"{self.reason}; started again from step 1 on {self.plan}")


@dataclasses.dataclass(frozen=True)
class Copied(Event):
  """`nbytes` of parameters and optimizer state copied from surviving replicas (or peers,
  for a rejoin) before `step` ran on its new plan."""

  nbytes: int
  kind: ClassVar[str] = "copy"

  def line(self) -> str:
    return (f"  copied {self.nbytes / 2**20:.2f} MiB of parameters and optimizer state from "
            "surviving replicas")


@dataclasses.dataclass(frozen=True)
class Speeds(Event):
  """The measured speeds put in force from `step` (`[(dp, stage, speed), ...]`, speed 1
  left out): stragglers found, or recovered (`recovered`)."""

  speeds: tuple[tuple[int, int, float], ...]
  recovered: tuple[tuple[int, int], ...] = ()
  kind: ClassVar[str] = "speeds"

  def line(self) -> str:
    parts = [f"(dp={d}, stage={s}) at {v:.2f}" for d, s, v in self.speeds]
    parts += [f"(dp={d}, stage={s}) recovered" for d, s in self.recovered]
    return f"speeds from step {self.step}: " + ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Corrupt(Event):
  """Replica `worker` on `node` disagreed with its stage after `step` (`majority`: the
  stage's digest, None where no majority); it is dropped at the start of the next step."""

  node: int
  worker: tuple[int, int]
  majority: int | None
  kind: ClassVar[str] = "corruption"


@dataclasses.dataclass(frozen=True)
class CheckpointLoaded(Event):
  """The checkpoint of `step` (`path`) was loaded, saved on the layout `saved_on` ("dp=2 pp=4
  tp=1"), onto the plan `onto`: at the start (a resume), or by a restore or a rejoin."""

  path: str
  saved_on: str
  onto: str
  kind: ClassVar[str] = "checkpoint_loaded"

  def line(self) -> str:
    return f"restored step {self.step} from {self.path} (saved on {self.saved_on}) onto {self.onto}"


@dataclasses.dataclass(frozen=True)
class CheckpointSaved(Event):
  """The checkpoint of `step` is being written to `path` (committed later, in the
  background); `due_at`: the step it was due at when it was deferred."""

  path: str
  due_at: int | None = None
  kind: ClassVar[str] = "checkpoint"


E = TypeVar("E", bound=Event)


class EventLog:
  """A run's events: kept in order, rendered to the log, `events.jsonl` (when `path` is set:
  process 0) and every added sink (TensorBoard).

  Args:
    log: where lines go (events whose line is empty are not logged: their own part logs
      in words of its own).
    path: `events.jsonl`, appended to (a resumed run goes on after the earlier run's).
  """

  def __init__(self, log: Callable[[str], None], path: Path | None = None):
    self.log, self.path = log, path
    self.events: list[Event] = []
    self.sinks: list[Callable[[Event], None]] = []

  def emit(self, event: Event, *, line: bool = True) -> None:
    """Records `event`; `line`: also log its line (False where the caller's lines say more)."""
    self.events.append(event)
    if line:
      self.log(event.line())
    if self.path is not None:
      with self.path.open("a") as f:
        f.write(json.dumps(event.to_json()) + "\n")
    for sink in self.sinks:
      sink(event)

  def of(self, *kinds: type[E]) -> list[E]:
    """The events of these types, in order."""
    return [e for e in self.events if isinstance(e, kinds)]


def read_events(path: Path, kinds: Sequence[str] = ()) -> list[dict]:
  """The events an `events.jsonl` holds (of `kinds` only, when given); damaged lines are
  skipped."""
  rows = read_jsonl(path, valid=lambda r: isinstance(r, dict) and isinstance(r.get("kind"), str))
  return [r for r in rows if not kinds or r["kind"] in kinds]
