"""One process plans, the others follow: how a multi-process job shares each decision.

Every process of a job holds a `RunCoordinator` and learns of each failure and rejoin through
agreed decisions, so each could plan for itself; at 16k devices that is every process spending
the planner's time and memory on the recovery path for the same answer. Instead the coordinator
of one process, the *planner*, decides (the policy's choice, `auto`'s switch, the plan, a
restore), and publishes the outcome under a key that names the event; the others read it and
build their plan from it (`RunCoordinator._adopt`).

The planner is process 0, always, and never the first writer: a decision depends on the
policies' state (`auto`'s candidate in force, Oobleck's instance, the plan caches), which only a
process that planned every earlier event holds. Process 0 hosts the coordination service, so if
it dies the job ends anyway (`EXIT_COORDINATOR_LOST`) and nobody needs to take over its state;
a process relaunched into the job rebuilds that state by replaying the membership history with
local planning (`admission.replay`), then follows like the others.

What is published (`schedule/codec.py`): the decision's plan in the form the planner made it
(the failure's footprint and the sub-grid's lists for a large re-routed grid), the policy in
force, the layout and failed workers, the phase the decision started, and the planner's log
lines about it (so every process's log says the same); a decision that ends the run is
published as the error, which the others raise too. Keys name the event (step, attempt, and the
number of membership events before it), so a follower can never read an earlier decision.
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
    """Writes `data` under `key` (written once)."""
    ...

  def read(self, key: str) -> bytes:
    """The data published under `key`, once it is; waits with a bound (a planner that does not
    publish in `distributed.wait_timeout_s` ends this process with `EXIT_WAIT_TIMEOUT`)."""
    ...
