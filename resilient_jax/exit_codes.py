"""Every exit code of a training process, defined once (launchers, docs and tests read these).

A cluster scheduler acts on them: 2 and 3 need a person (a bad configuration; nothing left to
train on), 4 a look at the storage, 5 a requeue of the whole job (it resumes from its latest
checkpoint), 6 and 7 end one process while the others go on, 9 a requeue (preempted: it stopped
with a checkpoint of its last step).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
"""Bad flags, configuration or workdir; or a checkpoint of another model or batch."""
EXIT_NO_DEVICES = 3
"""Failures left no device to continue on, or a whole stage with
`resilience.restore_on_stage_loss=false`."""
EXIT_CHECKPOINT = 4
"""A checkpoint could not be written."""
EXIT_COORDINATOR_LOST = 5
"""The coordination service (process 0) died: requeue the job; it resumes from a checkpoint."""
EXIT_WAIT_TIMEOUT = 6
"""A blocking wait passed `distributed.wait_timeout_s` (a live peer stopped making progress)."""
EXIT_DECLARED_DEAD = 7
"""The other processes declared this one dead (its heartbeat stopped for
`distributed.heartbeat_timeout_s`) and went on without it."""
EXIT_NONFINITE = 8
"""`train.max_nonfinite_steps` steps in a row had non-finite gradients (each was skipped on
every stage; the checkpoints hold the last finite state)."""
EXIT_PREEMPTED = 9
"""SIGTERM or SIGINT (a scheduler's preemption): the job stopped after the step in flight and
checkpointed it; run the same command to resume."""


def exit_code_for(error: BaseException) -> int | None:
  """The documented exit code for an error a run can end with, or None for a bug."""
  from resilient_jax.checkpoint import CheckpointError
  from resilient_jax.config import ConfigError
  from resilient_jax.policy import NoDevicesLeft, StageLost
  from resilient_jax.trainer import NonFiniteSteps, Preempted

  if isinstance(error, ConfigError):
    return EXIT_BAD_CONFIG
  if isinstance(error, (NoDevicesLeft, StageLost)):
    return EXIT_NO_DEVICES
  if isinstance(error, CheckpointError):
    return EXIT_CHECKPOINT
  if isinstance(error, NonFiniteSteps):
    return EXIT_NONFINITE
  if isinstance(error, Preempted):
    return EXIT_PREEMPTED
  return None
