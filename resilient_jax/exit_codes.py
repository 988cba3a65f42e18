"""Every exit code of a training process, defined once (launchers, docs and tests read these),
and the one way a process ends at once (`end_process`).

A cluster scheduler acts on them: 2 and 3 need a person (a bad configuration; nothing left to
train on), 4 a look at the storage, 5 a requeue of the whole job once process 0 is gone (it
resumes from the local copies its survivors wrote, or its latest checkpoint), 6 and 7 end one
process while the
others go on (7 also ends a job that a newer job on the same workdir superseded: never requeue
a 7), 9 a requeue (preempted: it stopped with a checkpoint of its last step).

The bottom of the house: it imports nothing of the library. An error a run can end with carries
its code (`class Preempted(RuntimeError): exit_code = EXIT_PREEMPTED`), so the mapping lives with
the error and `exit_code_for` needs to know none of them.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
"""Bad flags, configuration or workdir; or a checkpoint of another model or batch."""
EXIT_NO_DEVICES = 3
"""Failures left no device to continue on, or a whole stage with
`resilience.restore_on_stage_loss=false`."""
EXIT_CHECKPOINT = 4
"""A checkpoint could not be written."""
EXIT_COORDINATOR_LOST = 5
"""This process lost the coordination service: process 0 was lost, or this host was cut off
from the job (it cannot tell which; its last line names both, and where its local copy went).
It wrote its stages' state of the last committed step to `checkpoint.local_dir` first. Once
process 0 is gone (every other process exits 5), requeue the job: it resumes from the newest
step every stage can be read at (those copies, or a checkpoint)."""
EXIT_WAIT_TIMEOUT = 6
"""A blocking wait passed `distributed.wait_timeout_s` (a live peer stopped making progress)."""
EXIT_DECLARED_DEAD = 7
"""Left behind: the other processes declared this one dead (its heartbeat stopped for
`distributed.heartbeat_timeout_s`) and went on without it; or a newer job took the workdir's
lease (`checkpoint/lease.py`), so this job commits nothing more (every process of it exits 7)."""
EXIT_NONFINITE = 8
"""`train.max_nonfinite_steps` steps in a row had non-finite gradients (each was skipped on
every stage; the checkpoints hold the last finite state)."""
EXIT_PREEMPTED = 9
"""SIGTERM or SIGINT (a scheduler's preemption): the job stopped after the step in flight and
checkpointed it; run the same command to resume."""


def exit_code_for(error: BaseException) -> int | None:
  """The documented exit code for an error a run can end with (its class's `exit_code`), or
  None for a bug."""
  code = getattr(type(error), "exit_code", None)
  return code if isinstance(code, int) else None


def end_process(code: int, message: str | None = None) -> NoReturn:
  """Writes `message` (one line, to stderr) and ends the process at once with `code`.

  The one place the library ends a process without unwinding: in a `jax.distributed` job the
  client's shutdown (run by atexit handlers) would block on peers that are gone, and its own
  error handler aborts from a C++ thread. Safe from a C-level signal handler (it only writes
  and exits).
  """
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # closed or broken: the exit code still says it
      pass
  if message:
    os.write(2, message.encode(errors="replace") + b"\n")
  os._exit(code)
