"""Process-wide settings a launcher makes around a run, which the library itself never makes (a
notebook or a test calling `train` keeps its own signal handlers and garbage collector).

* `stop_on_signals`: SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) asks the run to
  stop after the step in flight, in every process of the job, with a checkpoint of that step
  (`Trainer.request_stop`, then `Preempted`, exit code 9); a second signal ends the process at
  once. A launcher installs it before it builds the trainer: a signal then (nothing trained,
  nothing to checkpoint) ends the process at once with exit code 9 too, not 143.
* `steady_gc`: objects built before the steps leave the cyclic collector's full passes, which
  stalled dispatch ~150 ms every ~10 steps (`docs/benchmark_results.md`); they are still freed at
  refcount zero.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from resilient_jax.exit_codes import EXIT_PREEMPTED, end_process

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(trainer: Any = None) -> Iterator[Callable[[Any], None]]:
  """While the block runs, SIGTERM and SIGINT ask `trainer` to stop after the step in flight;
  the handlers it replaced come back after. Off the main thread (where Python cannot install
  handlers) it installs none.

  Yields `attach(trainer)`, for a launcher that enters the block before it builds its trainer:
  until a trainer is there, a signal ends the process at once with exit code 9 and one line
  (nothing has trained since the workdir's last checkpoint, so there is nothing to save).
  `attach` also installs the handlers again: joining a job (`jax.distributed.initialize`) puts
  JAX's own SIGTERM handler in their place, so a launcher calls it (with None) once joined.
  """
  held = [trainer]
  main = threading.current_thread() is threading.main_thread()

  def attach(t: Any) -> None:
    held[0] = t
    if main:
      for s in _SIGNALS:
        signal.signal(s, on_signal)

  if not main:
    yield attach
    return

  def on_signal(signum: int, frame: Any) -> None:
    del frame
    name = signal.Signals(signum).name
    if held[0] is None:
      end_process(EXIT_PREEMPTED, f"preempted: {name} before the first step; nothing to "
                  "checkpoint (the workdir is as it was): run the same command to resume")
    if held[0].transport.stop_requested:  # asked twice: stop now
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
    held[0].request_stop(name)

  previous = {s: signal.signal(s, on_signal) for s in _SIGNALS}
  try:
    yield attach
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


@contextlib.contextmanager
def steady_gc() -> Iterator[None]:
  """Freezes what exists now out of the cyclic collector's passes for the block's length."""
  gc.freeze()
  try:
    yield
  finally:
    gc.unfreeze()
