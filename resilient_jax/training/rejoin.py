"""A rejoin in the training loop: the coordinator decides, the interpreter takes the plan.

At the start of a step with a rejoin (`faults.schedule` entries `STEP:+DP.STAGE`, or
`FaultEvent(..., rejoin=True)`), `apply_rejoin` asks `RunCoordinator.rejoin` and applies the
decision:

* in place (every policy but a grown restore): `Interpreter.place(plan, interp.sources())`
  copies what the returned devices lack from live replicas, device to device, and the step runs
  on the new plan with the same samples (same global batch, same math);
* a planned restart (a restored layout grows back): the committed state of the step before is
  checkpointed first and restored onto the grown layout, so no step is lost or redone.

The log names where each returned worker's state came from (the first live holder of each of
its parameters, the source `place` copies from) and the bytes copied; `goodput.json` records
the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from resilient_jax.observe.events import Copied
from resilient_jax.runtime.handover import Source
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import GridPlan, Plan
from resilient_jax.training.checkpoints import Checkpoints
from resilient_jax.training.run import Run


def position(plan: Plan, node: int) -> str:
  """`(dp=d, stage=s)` of `node` in `plan` (for a pipeline set: its pipeline and stage index)."""
  if isinstance(plan, GridPlan):
    for (d, s), n in plan.nodes.items():
      if n == node:
        return f"(dp={d}, stage={s})"
  elif isinstance(plan, PipelineSet):
    for d, pipe in enumerate(plan.pipelines):
      if node in pipe.nodes:
        return f"(dp={d}, stage={pipe.nodes.index(node)})"
  return f"(node {node})"


def state_origins(run: Run, sources: Sequence[Source], nodes: Sequence[int]
                  ) -> dict[int, list[int]]:
  """Per node of `nodes`, the nodes its parameters come from in the current plan: for each of
  its slots' parameters the first source holding it, as `Interpreter.place` picks."""
  interp = run.interpreter
  node_of = {dev: n for n, dev in run.transport.devices.items()}
  out: dict[int, list[int]] = {}
  for slot in interp.local_slots:
    node = interp.node(slot)
    if node not in nodes:
      continue
    for name in interp.program(slot).param_names:
      held = next((src for src in sources if name in src[1]), None)
      if held is not None and held[0] in node_of and node_of[held[0]] != node:
        origin = node_of[held[0]]
        if origin not in out.setdefault(node, []):
          out[node].append(origin)
  return out


def apply_rejoin(run: Run, checkpoints: Checkpoints, nodes: set[int], step: int, *,
                 remote: bool = False) -> None:
  """`nodes` come back at the start of `step` (see the module docstring).

  With `remote` (processes admitted back into a multi-process job, `relaunch.Admissions.admit`),
  every process calls this: `nodes` hold nothing, and `place` hands each key they lack over
  from the lowest live node that holds it, across processes (`StateHandover`); the log and
  the event name those processes and bytes.
  """
  coord = run.coordinator
  old_plan = coord.plan
  decision = coord.rejoin(nodes, step, key=run.plan_key(step))
  event = run.goodput.add("rejoin", step, sorted(nodes), policy=coord.policy,
                              plan=coord.plan_name, live_workers=coord.live_count)
  if decision.restore:
    # A planned restart: checkpoint the committed state first, so nothing is redone.
    run.log(f"{decision.reason}: checkpointing step {step - 1} and restoring it onto the new "
            "layout (no step is redone)")
    checkpoints.wait()  # a save of step - 1 in flight would be the same checkpoint
    if step - 1 not in checkpoints.committed():
      checkpoints.save(step - 1, old_plan)
    run.use_plan(decision.plan)
    restored = checkpoints.load(f"rejoin/{step}/{run.attempts}")
    if restored != step - 1:
      raise RuntimeError(f"growing the layout at step {step} restored step {restored}, not the "
                         f"step {step - 1} it had just saved")
    event.extra.update(outcome=decision.reason, state_from="checkpoint")
    run.board.text(step, "rejoin", f"node(s) {sorted(nodes)} rejoined at step {step}: "
                   f"{decision.reason}")
    return
  taken = [n for n in sorted(nodes) if n in run.plan_nodes(decision.plan)]
  if remote:
    interp = run.interpreter
    interp.place(decision.plan, interp.sources(nodes), dead=nodes, tag=(step, run.attempts))
    process_of = run.transport.process_of
    moves = [m for m in interp.handed_over if m[1] in nodes]
    state_from = {str(n): {} for n in taken}
    for src, dst, size in moves:  # by source process (its workers' shares added up)
      got = state_from.setdefault(str(dst), {})
      got[str(process_of(src))] = got.get(str(process_of(src)), 0) + size
    copied = sum(size for _, _, size in moves)
    for n in taken:
      where = ", ".join(f"process {src} ({size} bytes)" for src, size in state_from[str(n)].items())
      run.log(f"  worker {position(decision.plan, n)} of process {process_of(n)}: its "
              f"parameters and optimizer state came from "
              f"{where or 'nowhere (it needed none)'} over the transfer server")
  else:
    copied, state_from = _place_locally(run, taken, step, old_plan)
  idle = sorted(set(nodes) - set(taken))
  outcome = (f"now {coord.plan_name} on {coord.live_count} live workers"
             + (f"; node(s) {idle} idle" if idle else ""))
  event.extra.update(outcome=outcome, state_from=state_from, bytes_copied=int(copied))
  run.board.text(step, "rejoin", f"node(s) {sorted(nodes)} rejoined at the start of step "
                 f"{step}: {outcome}")


def _place_locally(run: Run, taken: list[int], step: int, old_plan: Plan
                   ) -> tuple[int, dict[str, str]]:
  """In one process: places the plan from live replicas; returns bytes copied and origins."""
  down = run.coordinator.down_nodes
  sources = run.interpreter.sources(down)
  copied = run.interpreter.place(run.coordinator.plan, sources, tag=(step, run.attempts))
  origins = state_origins(run, sources, taken)
  state_from = {}
  for n in taken:
    where = ", ".join(position(old_plan, o) for o in origins.get(n, [])) or "its own device"
    state_from[str(n)] = where
    run.log(f"  worker {position(run.coordinator.plan, n)} (node {n}): its state came from "
            f"{where}")
  if copied:
    run.events.emit(Copied(step, int(copied)), line=False)
    run.log(f"  copied {copied / 2**20:.2f} MiB of parameters and optimizer state device to "
            "device from live replicas")
  return copied, state_from
