"""The training loop's side of a failure: injecting the scheduled ones, handing a loss to the
policy and applying its decision, and the record of each recovery.

`Trainer` mixes this in (it uses the trainer's coordinator, interpreter, cluster, goodput log,
board and log). A decision is a new plan on the survivors, whose state `Interpreter.place` takes
from surviving replicas (across processes through `StateHandover`), or a restore of the latest
checkpoint onto a plan of the survivors (`checkpointing.RunCheckpoints._load`).
"""

from __future__ import annotations

from collections.abc import Callable

from resilient_jax.checkpoint.store import committed_steps
from resilient_jax.files import read_jsonl, write_json_atomic
from resilient_jax.policy import Decision, NoDevicesLeft, StageLost
from resilient_jax.runtime.records import WorkerLost
from resilient_jax.schedule.core import AR, Op
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import Plan, describe

KILLS_FILE = "kills.jsonl"
"""Written into the workdir by `launch/local.py`: one line per injected kill, with its time."""


class Recovers:
  """The failure part of `Trainer` (mixed into it)."""

  def _fault_hook(self, step: int) -> Callable[[int, Op], None] | None:
    pending = [(f, n) for f, n in self.faults if f.step == step and f.after_op is not None]
    if self.cluster is not None:
      pause = self.transport.pause
      if pause is None:
        return None
      return lambda node, op: pause(step, str(op)) if op.kind != AR else None
    if not pending:
      return None

    def hook(node: int, op: Op) -> None:
      for f, n in pending:
        if n == node and (f.after_op == op or op.kind == AR):
          pending.remove((f, n))
          raise WorkerLost(node)

    return hook

  def _fail(self, nodes: set[int], step: int, *, mid_step: bool,
            detect_s: float | None = 0.0, detected_at: float | None = None) -> int | None:
    """Hands the loss of `nodes` to the policy and applies its decision.

    Args:
      detect_s: from the fault to its detection, for `goodput.json` (in-process: 0, the
        injected failure is known at once; None: not known).
      detected_at: when it was detected (None: now).

    Returns:
      The step restored from when the policy restored a checkpoint (the caller redoes the
      steps after it), else None.
    """
    lost = sorted(nodes)
    self.membership.append({"kind": "fail", "nodes": lost, "step": step, "mid_step": mid_step})
    event = self.goodput.add("failure", step, lost, detect_s=detect_s, at=detected_at,
                             mid_step=mid_step)
    event.steps_rerun = 1 if mid_step else 0  # the step in flight is attempted again
    try:
      decision: Decision = self.coordinator.fail(nodes, step, mid_step=mid_step,
                                                 key=self._plan_key(step))
    except (StageLost, NoDevicesLeft) as e:
      self._board_failure(lost, step, mid_step, f"the run stops: {e}")
      if self.cluster is not None:
        # Every survivor ends with the same code: process 0 (the key-value store) leaves last.
        self.leave_together(f"ended/{self.attempts}")
      raise
    if decision.restore:
      nodes = self._plan_nodes(decision.plan)
      where = (f"{describe(decision.plan)} ({len(nodes)} of {len(self.coordinator.live)} "
               "surviving nodes)")
      if self.writer is not None:
        self.writer.wait()  # a save in flight is a checkpoint to restore
      if self.chief and not committed_steps(self.ckpt_dir):
        off = "" if self.cfg.checkpoint.every_steps else " (checkpoint.every_steps=0)"
        self.log(f"{decision.reason}; there is no checkpoint to restore{off}: starting again "
                 f"from step 1 on {where}, losing {step - 1} committed step(s)")
      else:
        self.log(f"{decision.reason}; restoring the latest checkpoint onto {where}")
      self.interpreter = self._interpreter(decision.plan)
      restored = self._load(f"{step}/{self.attempts}")
      self.board.rewind(restored + 1)  # the steps redone replace their first points
      self._board_failure(lost, step, mid_step, f"{decision.reason}; going on from step "
                          f"{restored + 1} on {where}")
      event.steps_rerun = step - restored - (0 if mid_step else 1)
      event.extra["outcome"] = decision.reason
      if restored:
        self.log(f"redoing {step - restored} step(s): {restored + 1}..{step}")
      elif committed_steps(self.ckpt_dir):
        self.log(f"no checkpoint verified: starting again from step 1, losing {step - 1} "
                 "committed step(s)")
      return restored
    self._board_failure(lost, step, mid_step, f"now {self.coordinator.plan_name} on "
                        f"{self.coordinator.live_count} live workers")
    dead = self.coordinator.down_nodes
    copied = self.interpreter.place(decision.plan, self.interpreter.sources(dead), dead=dead,
                                    tag=(step, self.attempts))
    if copied:
      self.log(f"  copied {copied / 2**20:.2f} MiB of parameters and optimizer state from "
               "surviving replicas")
    return None

  def _plan_key(self, step: int) -> str | None:
    """Where process 0 publishes its decision about the event now being applied (None in one
    process): named by the step, the attempt counter and the membership events so far, which
    every process of the job agrees on (`runtime/plan_exchange.py`)."""
    if self.cluster is None:
      return None
    from resilient_jax.runtime.plan_exchange import plan_key

    return plan_key(step, self.attempts, len(self.membership))

  def _board_failure(self, lost: list[int], step: int, mid_step: bool, outcome: str) -> None:
    when = "during" if mid_step else "at the start of"
    self.board.text(step, "failure", f"node(s) {lost} failed {when} step {step} "
                    f"(policy {self.cfg.resilience.policy}): {outcome}")

  @staticmethod
  def _plan_nodes(plan: Plan) -> list[int]:
    if isinstance(plan, PipelineSet):
      return plan.nodes
    return sorted(plan.nodes[w] for w in plan.schedule.ops)

  def _kill_times(self, relaunches: bool = False) -> dict[int, float]:
    """When `launch/local.py` killed (or, with `relaunches`, relaunched) each process."""
    return {r["process"]: r["time"] for r in read_jsonl(self.workdir / KILLS_FILE)
            if (r.get("signal") == "relaunch") == relaunches}

  def _write_recovery(self) -> None:
    write_json_atomic(self.workdir / "recovery.json", self.recovery)

