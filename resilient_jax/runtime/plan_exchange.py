"""The key-value store side of `policy/shared.py`: process 0 publishes each decision's digest,
the others wait for it.

The published bytes (a compressed SHA-256 of the decision, ~100 bytes) are stored as base85
text: every value in the store stays a string, which the store's string reads of a directory
(`Cluster.kv_keys("step")`) need. `key` is under `step/{step}/plan/`: the step's directory,
which process 0 deletes with the step's other agreements once every process is past it
(`distributed.kv_keep_steps`).

A follower's wait is `Cluster.poll`'s: woken the moment the digest is written (by a small
`ready` key written after it), and bounded by `distributed.wait_timeout_s`, past which it exits
with `EXIT_WAIT_TIMEOUT`; if process 0 dies instead, the coordinator watchdog ends the process
with `EXIT_COORDINATOR_LOST` (the job restarts from its latest checkpoint, as for any loss of
process 0). Every follower reads it once from the one coordination service: at 16k devices, 8
per process, 2047 reads of ~100 bytes per failure (the plan itself, up to ~85 kB, used to be
read instead: ~170 MB).
"""

from __future__ import annotations

import base64
import time

from resilient_jax.runtime.cluster import Cluster

PLANNER = 0
"""The process that plans (it hosts the coordination service: see `policy/shared.py`)."""


def plan_key(step: int, attempt: int, events: int) -> str:
  """The key of the decision about an event of `step`, taken after `attempt` (the run's attempt
  counter) with `events` membership events before it: no two events of a job share it."""
  return f"step/{step}/plan/{attempt}/{events}"


class KVPlanExchange:
  """`policy.shared.PlanExchange` over the job's key-value store.

  Args:
    cluster: the joined job.
  """

  def __init__(self, cluster: Cluster):
    self.cluster = cluster
    self.planner = cluster.process_id == PLANNER

  def publish(self, key: str, data: bytes) -> None:
    cl = self.cluster
    try:
      cl.client.key_value_set(key, base64.b85encode(data).decode("ascii"),
                              allow_overwrite=False)
      cl.client.key_value_set(f"{key}/ready", "1", allow_overwrite=False)
    except Exception as e:
      cl.check_coordinator()
      raise RuntimeError(f"publishing the plan {key} failed: {e}") from None

  def read(self, key: str) -> bytes:
    cl = self.cluster

    def check() -> bytes | None:
      try:
        return base64.b85decode(cl.client.key_value_try_get(key))
      except Exception as e:
        if "NOT_FOUND" in str(e):
          return None
        cl.check_coordinator()
        raise RuntimeError(f"reading the plan {key} failed: {e}") from None

    t0 = time.perf_counter()
    # Woken by the tiny `ready` key: a blocking read returns the value it waited for, which
    # would then cross twice (from one coordination service to every process).
    data = cl.poll(f"process {PLANNER}'s decision {key}", check, wake_key=f"{key}/ready")
    # Through the cluster's log, which every process prints (the training log is process 0's):
    # the line that shows this process checked its own plan against the planner's.
    cl.log(f"process {cl.process_id}: checks its plan against process {PLANNER}'s digest "
           f"{key} ({len(data)} bytes, waited {time.perf_counter() - t0:.3f}s)")
    return data
