"""The training loop's side of a relaunched process's rejoin (`runtime/admission.py`: the
protocol).

A job's `Admissions` (`Job.admissions`; a single process admits nobody). A relaunched process
starts with `join` instead of a checkpoint: it announces itself, waits to be admitted, replays
the agreed membership history on its own coordinator and returns the step it starts at. Every
live process calls `admit` before each step; when the agreed decision admits someone, every
process, the joiner included, applies it the same way: the policy's `RunCoordinator.rejoin`
gives the new plan, and `Interpreter.place` moves the joiners' state from live data-parallel
peers over the transfer server (the hand-over a failure uses): `rejoin.apply_rejoin`, which
in-process rejoins use too, with `remote=True`.

Costs: one small agreement per step boundary (process 0 decides whom it admits); a joiner's
state moves once, from one live holder per stage, whatever dp is.
"""

from __future__ import annotations

import time
from typing import Any

from resilient_jax.runtime import admission
from resilient_jax.runtime.admission import Admission
from resilient_jax.training.checkpoints import Checkpoints
from resilient_jax.training.failures import kill_times
from resilient_jax.training.group import Job
from resilient_jax.training.rejoin import apply_rejoin
from resilient_jax.training.run import Run


class Admissions:
  """Relaunched processes coming back into a running job (`run`'s membership, coordinator and
  interpreter; `rejoin.apply_rejoin`, the one way a rejoin is applied, in one process or
  many)."""

  def __init__(self, run: Run, checkpoints: Checkpoints, cluster: Any):
    self.run, self.checkpoints, self.cluster = run, checkpoints, cluster
    self._boundary = 0
    """The last step whose boundary was decided (a step redone after a restore is not one)."""

  def join(self) -> int:
    """This relaunched process: announces itself and waits to be admitted; returns the step it
    starts at (its state arrives when that step's boundary is applied, in `admit`)."""
    cl = self.cluster
    me = cl.process_id
    token = admission.announce(cl)
    cl.log(f"process {me}: announced itself to the running job; waiting to be admitted at a "
           "step boundary")
    self.run.group.pause(0, "joined")  # where `launch/local.py --relaunch` waits
    adm = admission.await_admission(cl, token)
    if adm is None:
      cl.log(f"process {me}: the job ended before it could admit this process")
      cl.finish(0)
    admission.replay(self.run.coordinator, adm.history)
    self.run.membership = list(adm.history)
    # Processes admitted back before this one: their death marks name their generation.
    cl.generations.update({p: g for p, g in admission.generations(adm.history).items() if p != me})
    self.run.attempts = adm.attempts
    # This process holds nothing yet: the survivors' plan, without a slot here.
    self.run.use_plan(self.run.coordinator.plan)
    self._boundary = adm.step - 1
    return adm.step

  def admit(self, step: int) -> list[dict[str, Any]]:
    """The step-boundary hook: applies the agreed admission before `step`, if any; returns the
    recovery events of the processes admitted (completed when the step commits)."""
    if step <= self._boundary:
      return []
    self._boundary = step
    run, layout = self.run, self.run.transport.layout
    adm = admission.decide(self.cluster, step, layout.processes_of(sorted(run.coordinator.live)),
                           range(self.cluster.num_processes), run.attempts, run.membership)
    return [] if adm is None else self._apply_admission(adm)

  def _apply_admission(self, adm: Admission) -> list[dict[str, Any]]:
    cl = self.cluster
    layout = self.run.transport.layout
    joiners = sorted(adm.joiners)  # processes; they come back with all their workers (nodes)
    back = layout.nodes_of(joiners)
    # The hand-over's transfers are named after its own attempt.
    self.run.attempts = adm.attempts + 1
    for p in joiners:
      j = adm.joiners[p]
      if p == cl.process_id:
        cl.admitted(j["generation"])
      else:
        cl.readmit(p, j["generation"], j["address"])
    admitted_at = time.time()
    compiles = self.run.builds.xla
    t0 = time.perf_counter()
    # The policy, then the hand-over.
    apply_rejoin(self.run, self.checkpoints, set(back), adm.step, remote=True)
    took = time.perf_counter() - t0
    event = self.run.goodput.events[-1]
    event.extra.update(relaunched=True, generations=adm.event()["generations"])
    # Detection of a return: from its announcement to its admission (clocks of one host here;
    # of NTP-synchronised hosts on a cluster).
    event.detect_s = round(max(0.0, admitted_at - min(j["time"] for j in adm.joiners.values())), 3)
    coord = self.run.coordinator
    self.run.log(f"  process(es) {', '.join(map(str, joiners))} relaunched and admitted before "
                 f"step {adm.step}, now {coord.plan_name} on {coord.live_count} live workers")
    if cl.process_id in adm.joiners:  # it waited for every array it pulled: the transfer time
      cl.kv_set(_handover_key(cl.process_id, adm.joiners[cl.process_id]["generation"]), took)
    self.run.membership.append(adm.event())
    # The first transfer over a new connection costs a large fraction of a second: the joiners
    # and every live process of their own or a neighbouring stage pay it here, not in the step.
    pp = self.run.cfg.mesh.pp
    near = set(layout.processes_of([n for n in self.run.coordinator.live
                                    if any(abs(n % pp - j % pp) <= 1 for j in back)]))
    near -= set(joiners)
    if cl.process_id in adm.joiners:
      cl.connect(near | set(joiners), salt=adm.step)
    elif cl.process_id in near:
      cl.connect(joiners, salt=adm.step)
    from_checkpoint = event.extra.get("state_from") == "checkpoint"  # a planned restart
    # Node to node, added up by processes (a joiner's workers may each get state).
    by_process: dict[tuple[int, int], int] = {}
    for src, dst, size in [] if from_checkpoint else self.run.interpreter.handed_over:
      if dst in back:
        key = (layout.process_of(src), layout.process_of(dst))
        by_process[key] = by_process.get(key, 0) + size
    moves = [(src, dst, size) for (src, dst), size in sorted(by_process.items())]
    where = ("every process restored the checkpoint of step "
             f"{adm.step - 1} onto the grown layout (a planned restart)" if from_checkpoint
             else admission.describe_moves(moves, adm.joiners))
    if cl.process_id in adm.joiners:
      cl.log(f"process {cl.process_id}: admitted before step {adm.step}; {where}")
    relaunched = kill_times(self.run.workdir, relaunches=True)
    events = []
    for p in joiners:
      j = adm.joiners[p]
      event = {"kind": "rejoin", "node": layout.nodes_of([p])[0], "process": p,
               "nodes": layout.nodes_of([p]), "step": adm.step,
               "generation": j["generation"], "announced_at": j["time"],
               "detected_at": admitted_at, "xla_compiles": compiles,
               "state_from": {str(src): n for src, dst, n in moves if dst == p},
               "bytes": sum(n for _, dst, n in moves if dst == p)}
      if p in relaunched:
        event["relaunched_at"] = relaunched[p]
      events.append(event)
    return events

  def rejoined(self, event: dict[str, Any], step: int, done_at: float) -> None:
    """Completes a rejoin's recovery event once its first step committed (`done_at`)."""
    if "relaunched_at" in event:
      event["relaunch_to_next_step_s"] = round(done_at - event["relaunched_at"], 3)
    # The joiner wrote how long it took to receive its state before it ran this step.
    took = self.cluster.kv_try_get(_handover_key(event["process"], event["generation"]))
    if took is not None:
      event["transfer_s"] = round(took, 4)
      event["transfer_MiB_per_s"] = round(event["bytes"] / 2**20 / max(took, 1e-9), 2)
    since = (f", {event['relaunch_to_next_step_s']:.2f}s after its relaunch"
             if "relaunch_to_next_step_s" in event else "")
    self.run.log(f"  process {event['process']} trains again: step {step} committed "
             f"{event['detect_to_next_step_s']:.2f}s after its admission{since}")


def _handover_key(process: int, generation: int) -> str:
  return f"rejoin/{process}/{generation}"


class NoAdmissions:
  """A run in one process admits nobody: its rejoins are injected (`Failures.coming_back`)."""

  def join(self) -> int:
    raise RuntimeError("only a process relaunched into a job joins it")

  def admit(self, step: int) -> list[dict[str, Any]]:
    return []

  def rejoined(self, event: dict[str, Any], step: int, done_at: float) -> None:
    raise RuntimeError("only a job admits relaunched processes")


def admissions_for(run: Run, checkpoints: Checkpoints) -> Admissions | NoAdmissions:
  """Who admits relaunched processes into `run` between steps: a job's processes do."""
  if isinstance(run.group, Job):
    return Admissions(run, checkpoints, run.group.cluster)
  return NoAdmissions()
