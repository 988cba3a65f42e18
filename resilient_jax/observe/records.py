"""Records of what a step did: a leaf every layer may import (it imports only the schedule's
data types), so the loop, profiling and the benchmarks read a step's outcome without importing
the runtime that produced it."""

from __future__ import annotations

import dataclasses

from resilient_jax.schedule.core import Op
from resilient_jax.schedule.plan import Slot


@dataclasses.dataclass(frozen=True)
class Built:
  """What this process has built: a `built()` snapshot, or the difference of two (what a step
  built: `Trainer` reports its `seconds` as `compile_s`, apart from step time)."""

  seconds: float = 0.0
  """Building `OnEachDevice` programs (lowering, compiling, loading) and other XLA compiles."""
  compiled: int = 0
  from_disk: int = 0
  loaded: int = 0
  """`OnEachDevice` programs compiled, read from the cache folder, loaded on other devices."""
  xla: int = 0
  """XLA compilations of any program."""

  def __sub__(self, other: Built) -> Built:
    return Built(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                         strict=True)))

  def programs(self) -> int:
    return self.compiled + self.from_disk + self.loaded

  def describe(self) -> str:
    """`programs: 14 compiled, 12 loaded on other devices`."""
    parts = [f"{n} {what}" for n, what in ((self.compiled, "compiled"),
                                           (self.from_disk, "from the cache"),
                                           (self.loaded, "loaded on other devices")) if n]
    return "programs: " + ", ".join(parts)


@dataclasses.dataclass
class OpRecord:
  """One executed op; times are host wall-clock seconds from the step start."""

  worker: Slot
  op: Op
  start: float
  end: float


@dataclasses.dataclass
class StepResult:
  loss: float
  microbatch_losses: dict[int, float]
  step_time_s: float
  records: list[OpRecord]
  """Per-op timings; filled only in profile mode (each op is then waited for)."""
  processed: list[int]
  """Micro-batch ids whose loss was computed (each exactly once when committed)."""
  dispatch_time_s: float = 0.0
  """Host time until every op was dispatched, before waiting for the devices (benchmarks)."""
  dispatch_cpu_s: float = 0.0
  """CPU time of the thread that dispatched the ops (benchmarks)."""
  committed: bool = True
  lost: frozenset[int] = frozenset()
  """Nodes that died during the step (multi-process; the step did not commit)."""
  detected_at: float = 0.0
  """`time.time()` when the outcome was known."""
  grad_norm: float = 0.0
  """The global norm of the step's gradients, over every parameter once."""
  skipped: bool = False
  """The gradients were not finite: every stage kept its state (the step committed nothing)."""
  clipped: bool = False
  """Global-norm clipping scaled the gradients (each stage redid its optimizer step)."""
  attempts: int = 1
  """Attempts the step took (set by the training loop)."""
  stop: bool = False
  """A process asked to stop after this step (`Outcome.stop`)."""
  built: Built = Built()
  net_bytes: tuple[int, int] = (0, 0)
  """The most bytes one process of a job sent, and received, in the step (`Outcome`)."""
  device_bytes: tuple[int, int] = (0, 0)
  """The most bytes one device sent, and received, to and from its process's other devices in
  the step's gradient reductions (`Outcome`)."""
  loss_factor: float = 1.0
  """What the summed micro-batch losses were scaled by (`StagePrograms.loss_factor`): the
  samples' weight in a mean over several batches is its inverse."""
  """What the attempt built; its seconds are not counted in `step_time_s` (set by the training
  loop)."""


class WorkerLost(Exception):
  """Raised by a fault hook when a node dies in the middle of a step."""

  def __init__(self, node: int):
    super().__init__(f"node {node} failed")
    self.node = node


