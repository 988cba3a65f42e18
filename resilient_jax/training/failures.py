"""The training loop's side of a failure: the failures a run injects, handing a loss to the
policy and applying its decision, and the record of each recovery.

A decision is a new plan on the survivors, whose state `Interpreter.place` takes from
surviving replicas (across processes through `StateHandover`), or a restore of the latest
checkpoint onto a plan of the survivors (`Checkpoints.load`).

Costs per failure: the policy plans once (process 0 in a job, the others read its plan:
`runtime/plan_exchange.py`); `place` copies only what a device lacks (a lost worker's stage
from one live replica), so the bytes moved grow with the lost stages' state, not with dp.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from resilient_jax.files import UnusableFile, read_jsonl, write_json_atomic
from resilient_jax.observe.events import Copied, Restored
from resilient_jax.observe.records import StepResult, WorkerLost
from resilient_jax.policy import Decision, NoDevicesLeft, StageLost
from resilient_jax.schedule.core import AR, Op
from resilient_jax.schedule.plan import describe
from resilient_jax.training.checkpoints import Checkpoints
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.run import Run

KILLS_FILE = "kills.jsonl"
"""Written into the workdir by `launch/local.py`: one line per injected kill, with its time."""


class Failures:
  """Failures of one run: the injected ones (`faults`: events with the node each strikes),
  and what the policy decides for every loss."""

  def __init__(self, run: Run, checkpoints: Checkpoints,
               faults: Sequence[tuple[FaultEvent, int]]):
    self.run, self.checkpoints = run, checkpoints
    self.faults = list(faults)

  def starting(self, step: int) -> set[int]:
    """Live nodes whose failure is injected at the start of `step` (they fail together: a
    whole host's workers at once)."""
    live = self.run.coordinator.live
    return {n for f, n in self.faults if f.step == step and f.after_op is None
            and not f.rejoin and n in live}

  def drop(self, step: int, nodes: set[int]) -> None:
    """Fails `nodes` at the start of `step` like an injected failure (a replica found corrupt:
    `integrity.py`); every process of a job calls it alike, from an agreed verdict."""
    pp = self.run.cfg.mesh.pp
    self.faults += [(FaultEvent(step, divmod(n, pp)), n) for n in sorted(nodes)]

  def coming_back(self, step: int) -> set[int]:
    """Failed nodes whose rejoin is injected at the start of `step`."""
    back = {n for f, n in self.faults if f.step == step and f.rejoin}
    return back - self.run.coordinator.live

  def op_hook(self, step: int, evaluation: bool = False) -> Callable[[int, Op], None] | None:
    """What runs after each op of `step` (with `evaluation`: of the evaluation after it): the
    failures injected into it (in one process), or `launch.local`'s kill points (a job)."""
    pending = [(f, n) for f, n in self.faults if f.step == step and f.after_op is not None
               and f.evaluation == evaluation]

    def hook(node: int, op: Op) -> None:
      for f, n in pending:
        if n == node and (f.after_op == op or op.kind == AR):
          pending.remove((f, n))
          raise WorkerLost(node)

    return self.run.group.op_hook(step, hook if pending else None)

  def lost_in(self, result: StepResult, step: int, attempt: int
              ) -> tuple[list[dict], float | None]:
    """Recovery events of the live nodes an uncommitted attempt lost, and the time from the
    failure to its detection (0 for an injected one; None where it is not known)."""
    run = self.run
    kills = kill_times(run.workdir)
    events = []
    for p in sorted(n for n in result.lost if n in run.coordinator.live):
      event = {"node": p, "step": step, "attempt": attempt, "detected_at": result.detected_at,
               "xla_compiles": run.builds.xla}
      proc = run.group.process_of(p)
      if proc is not None:
        event["process"] = proc
      if proc in kills:
        event["killed_at"] = kills[proc]
        event["kill_to_detect_s"] = round(result.detected_at - kills[proc], 3)
      events.append(event)
    known = [e.get("kill_to_detect_s") for e in events]
    if None in known and not run.group.knows_fault_times:
      return events, None
    return events, max([k for k in known if k is not None], default=0.0)

  def fail(self, nodes: set[int], step: int, *, mid_step: bool,
           detect_s: float | None = 0.0, detected_at: float | None = None,
           evaluation: bool = False) -> int | None:
    """Hands the loss of `nodes` to the policy and applies its decision.

    Args:
      detect_s: from the fault to its detection, for `goodput.json` (in-process: 0, the
        injected failure is known at once; None: not known).
      detected_at: when it was detected (None: now).
      evaluation: lost in the evaluation after committed `step` (with `mid_step`): no step is
        re-run unless a checkpoint is restored.

    Returns:
      The step restored from when the policy restored a checkpoint (the caller redoes the
      steps after it), else None.
    """
    run = self.run
    lost = sorted(nodes)
    run.membership.append({"kind": "fail", "nodes": lost, "step": step, "mid_step": mid_step})
    event = run.goodput.add("failure", step, lost, detect_s=detect_s, at=detected_at,
                            mid_step=mid_step)
    event.steps_rerun = int(mid_step and not evaluation)  # the step in flight is run again
    try:
      decision: Decision = run.coordinator.fail(nodes, step, mid_step=mid_step,
                                                key=run.plan_key(step))
    except (StageLost, NoDevicesLeft) as e:
      self._board(lost, step, mid_step, f"the run stops: {e}")
      # Every survivor ends with the same code: process 0 (the key-value store) leaves last.
      run.group.leave_together(f"ended/{run.attempts}", run.coordinator.live)
      raise
    if decision.restore:
      return self._restore(decision, lost, step, mid_step, event)
    self._board(lost, step, mid_step, f"now {run.coordinator.plan_name} on "
                f"{run.coordinator.live_count} live workers")
    dead = run.coordinator.down_nodes
    copied = run.interpreter.place(decision.plan, run.interpreter.sources(dead), dead=dead,
                                   tag=(step, run.attempts))
    if copied:
      run.events.emit(Copied(step, int(copied)))
    return None

  def _restore(self, decision: Decision, lost: list[int], step: int, mid_step: bool,
               event) -> int:
    run = self.run
    nodes = run.plan_nodes(decision.plan)
    where = (f"{describe(decision.plan)} ({len(nodes)} of {len(run.coordinator.live)} "
             "surviving nodes)")
    self.checkpoints.wait()  # a save in flight is a checkpoint to restore
    if run.chief and not self.checkpoints.committed():
      off = "" if run.cfg.checkpoint.every_steps else " (checkpoint.every_steps=0)"
      run.log(f"{decision.reason}; there is no checkpoint to restore{off}: starting again "
              f"from step 1 on {where}, losing {step - 1} committed step(s)")
    else:
      run.log(f"{decision.reason}; restoring the latest checkpoint onto {where}")
    run.use_plan(decision.plan)
    restored = self.checkpoints.load(f"{step}/{run.attempts}")
    run.board.rewind(restored + 1)  # the steps redone replace their first points
    self._board(lost, step, mid_step, f"{decision.reason}; going on from step {restored + 1} "
                f"on {where}")
    event.steps_rerun = step - restored - (0 if mid_step else 1)
    event.extra["outcome"] = decision.reason
    run.events.emit(Restored(step, restored, where, decision.reason), line=False)
    if restored:
      run.log(f"redoing {step - restored} step(s): {restored + 1}..{step}")
    elif self.checkpoints.committed():
      run.log(f"no checkpoint verified: starting again from step 1, losing {step - 1} "
              "committed step(s)")
    return restored

  def recovered(self, pending: list[dict], step: int, admissions: Any) -> None:
    """Completes the recovery events of the failures and rejoins `step` recovered from."""
    run = self.run
    done_at = time.time()
    run.goodput.committed(step, done_at)
    for event in pending:
      event["recovered_at"] = done_at
      if "killed_at" in event:
        event["kill_to_next_step_s"] = round(done_at - event["killed_at"], 3)
      event["detect_to_next_step_s"] = round(done_at - event["detected_at"], 3)
      # Programs compiled (or read from JAX's cache) between detection and the step's commit:
      # a recovery should find every program it needs already built.
      event["xla_compiles"] = run.builds.xla - event["xla_compiles"]
      run.recovery.append(event)
      if event.get("kind") == "rejoin":
        admissions.rejoined(event, step, done_at)
        continue
      run.board.text(step, "recovery", f"step {step} committed {event['detect_to_next_step_s']}s "
                     f"after the loss of node {event['node']} was detected")
      if "kill_to_next_step_s" in event:
        run.log(f"  recovered from the loss of node {event['node']} (process {event['process']}): "
                f"detected {event['kill_to_detect_s']:.2f}s after the kill, step {step} "
                f"completed {event['kill_to_next_step_s']:.2f}s after it")
    if pending and run.chief:
      self.write_recovery()

  def _board(self, lost: list[int], step: int, mid_step: bool, outcome: str) -> None:
    when = "during" if mid_step else "at the start of"
    self.run.board.text(step, "failure", f"node(s) {lost} failed {when} step {step} "
                        f"(policy {self.run.cfg.resilience.policy}): {outcome}")

  def write_recovery(self) -> None:
    write_json_atomic(self.run.workdir / "recovery.json", self.run.recovery)


def kill_times(workdir: Path, relaunches: bool = False) -> dict[int, float]:
  """When `launch/local.py` killed (or, with `relaunches`, relaunched) each process. These
  only annotate `recovery.json`: a damaged line is skipped, and a `kills.jsonl` that is not a
  file reads as none, never an error in the middle of a recovery."""
  def whole(r: object) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("process"), int)
            and isinstance(r.get("time"), (int, float)))

  try:
    rows = read_jsonl(workdir / KILLS_FILE, valid=whole)
  except UnusableFile:
    return {}
  return {r["process"]: r["time"] for r in rows if (r.get("signal") == "relaunch") == relaunches}
