"""Injected faults: the failures and rejoins a run schedules, checked before anything is
built, and the pause hook that lets `launch/local.py` kill a process at an exact point.

Test hook for multi-process jobs: `RESILIENT_JAX_PAUSE=STEP:WHERE` makes this process write the
time to the file named by `RESILIENT_JAX_PAUSE_FILE` and wait at that point of that step
(`start`, an op such as `F1` or `B0` right after it was dispatched, `AR` inside the gradient
all-reduce, or `save` as the step's checkpoint save begins, before this process hands its state
to process 0) until the file is gone, so that `launch/local.py` can SIGKILL it (`--kill`) or
SIGSTOP it (`--stop`) at exactly that moment. For `--relaunch`, process 0 pauses at `boundary`
(after the step's admission was decided, before the step is timed) and the relaunched process at
`0:joined` once it has announced itself. Several points, comma-separated, each pause once in
turn (`benchmarks/soak.py` holds process 0 at every relaunch's step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from resilient_jax.config import ConfigError, RunConfig, check_rejoins
from resilient_jax.schedule.core import F, Op, Worker

PAUSE_ENV = "RESILIENT_JAX_PAUSE"
PAUSE_FILE_ENV = "RESILIENT_JAX_PAUSE_FILE"


@dataclasses.dataclass(frozen=True)
class FaultEvent:
  """Worker `worker` of the initial grid fails in 1-based `step`: at its start, or right after
  `after_op` was dispatched on it (the interrupted step is then re-run on the survivors). With
  `rejoin`, the failed worker comes back at the start of `step` instead (no `after_op`).

  The failure is of the worker's node (device), so it keeps its meaning after the layout
  changed. If that node does not run `after_op` in that step (a replanned layout gave it other
  work), it fails right after its all-reduce instead: still in the middle of the step.
  With `evaluation`, it fails right after `after_op` (an F) in the evaluation after `step`
  instead (`train.eval_every`; none if its node runs no such op there)."""

  step: int
  worker: Worker
  after_op: Op | None = None
  rejoin: bool = False
  evaluation: bool = False


def pause_hook_from_env() -> Callable[[int, str], None] | None:
  """The multi-process test hook described in the module docstring, or None."""
  spec = os.environ.get(PAUSE_ENV, "")
  if not spec:
    return None
  targets = set()
  for point in filter(None, (p.strip() for p in spec.split(","))):
    step_s, _, where = point.partition(":")
    targets.add((int(step_s), where or "start"))
  path = os.environ.get(PAUSE_FILE_ENV, "")

  def hook(step: int, at: str) -> None:
    if (step, at) not in targets:  # each once: a re-run of the step goes on through it
      return
    targets.discard((step, at))
    marker = Path(path) if path else None
    if marker is not None:
      marker.write_text(json.dumps({"time": time.time(), "step": step, "at": at}))
    # The launcher kills or stops this process now; one it stops and lets go again removes the
    # marker before it resumes the process, which then goes on from here.
    deadline = time.monotonic() + 600
    while marker is None or marker.exists():
      if time.monotonic() > deadline:
        raise RuntimeError(f"paused at {spec} but nobody killed or released this process")
      time.sleep(0.01)

  return hook


def check_fault_events(events: Sequence[FaultEvent], cfg: RunConfig) -> None:
  """The programmatic faults `events` (with the config's `faults.schedule`): rejoins must
  follow a failure of the same worker (`config.check_rejoins`) and happen at a step's start.

  Raises:
    ConfigError: the first bad event (one line).
  """
  for f in events:
    if f.rejoin and f.after_op is not None:
      raise ConfigError(f"fault {f}: a rejoin happens at the start of a step, not after an op")
    if f.evaluation and (f.after_op is None or f.after_op.kind != F):
      raise ConfigError(f"fault {f}: a failure in an evaluation happens after one of its "
                        "forward ops (after_op=Op(F, mb))")
    if f.rejoin and cfg.distributed.enabled:
      raise ConfigError(f"fault {f}: in-process rejoins need an in-process run (relaunch "
                        "processes in a job instead)")
  scheduled = [(f.step, (f.dp, f.stage), f.rejoin) for f in cfg.faults.schedule]
  check_rejoins(scheduled + [(f.step, tuple(f.worker), f.rejoin) for f in events])
