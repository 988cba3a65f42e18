"""Every process plans, one publishes a digest: how a multi-process job agrees on each decision.

Every process of a job holds a `RunCoordinator` and learns of each failure and rejoin through
agreed events (the same ones, in the same order, in every process), and the planners are
deterministic pure Python on deterministic inputs (grid, failed set, FLOP-based costs), so each
process derives the decision itself: the policy's choice, `auto`'s switch, the plan, a restore.
Process 0, the *planner*, also publishes a SHA-256 of its decision (`schedule/codec.py`'s
encoding of the plan, the policy, layout, failed workers and the phase it started) under a key
that names the event, and every other process checks its own against it: a mismatch would be a
bug (non-deterministic planning) and stops that process with one line rather than letting it
run another plan.

What this costs, against process 0 shipping its plan (the design before): the key-value store
serves ~100 bytes per follower per event instead of up to ~85 kB (at 16k devices, 8 per host:
0.2 MB per failure in all instead of ~170 MB, through the service that also carries
heartbeats); each process spends the planner's CPU time once per event (0.1-0.5 s at 16k
devices, in parallel on every host, where a follower used to wait that long for process 0
anyway) and holds the policies' state (`auto`'s candidate, Oobleck's instance, plan caches),
which a process relaunched into the job rebuilds by replaying the membership history
(`admission.replay`), as before. A decision that ends the run (a lost stage, no devices left)
is reached by every process alike; a planner's error is published so that the others stop at
once rather than at their wait's bound.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["PlanExchange"]


class PlanExchange(Protocol):
  """Moves published decisions between the processes of a job (`runtime/plan_exchange.py`).

  Attributes:
    planner: whether this process plans and publishes (the others read).
  """

  planner: bool

  def publish(self, key: str, data: bytes) -> None:
    """Writes `data` under `key` (written once): the planner's digest of its decision."""
    ...

  def read(self, key: str) -> bytes:
    """The data published under `key`, once it is; waits with a bound (a planner that does not
    publish in `distributed.wait_timeout_s` ends this process with `EXIT_WAIT_TIMEOUT`)."""
    ...
