"""How a step's ops are dispatched: one thread sweeps every local slot's op list.

A `StepRun` (`runtime/step_run.py`) holds an attempt's state and dispatches single ops;
`dispatch` decides when each may go. It sweeps the local slots round-robin, dispatching each
slot's ops in order as far as their dependencies allow, runs the gradient reductions whose
local holders have all arrived between sweeps, and when nothing local can go on waits for what
is on its way from other processes (`Transport.wait_arrival`) or for a reduction with other
processes, in the one global group order.

Why one thread (measured, `docs/benchmark_results.md`): most of the host's time per op is the
compiled program's C++ call, about a microsecond per argument and result array (50 to 440 of
them a call). A thread per pipeline or per slot could overlap the part of it that runs without
the GIL; side by side on a loaded 2-core machine they did not win consistently (per-round step
ratios 0.67 to 1.37 against one thread) and spent up to 30% (per pipeline) or 40% (per slot)
more CPU handing the GIL over, so they were removed rather than kept as modes nobody should
pick. What does scale a host's dispatch is fewer arrays per call and fewer calls.

The rules that make a step correct and reproducible:

* each slot runs its ops in its schedule's order, so every program sees the same inputs;
* a reduction sums its members in one order (`Transport.reduce`), so results are bitwise the
  same whatever the interleaving;
* reductions with holders in other processes run in the one global group order, and only
  when nothing else can be dispatched (the thread blocks in them), so no two processes wait
  on each other;
* `after_op` fires after the same ops (and per slot inside its reduction); a `WorkerLost` it
  raises, or any error, is raised to the caller, the committed state untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resilient_jax.schedule.core import AR, Op
from resilient_jax.schedule.plan import Slot

if TYPE_CHECKING:
  from resilient_jax.runtime.step_run import StepRun


def dispatch(run: StepRun) -> None:
  """Dispatches every local op of `run` (see the module docstring).

  Raises:
    RuntimeError: the plan cannot make progress (a bug in the plan; never waits forever).
  """
  lists = run.ip.dispatch_lists
  done, arrived = run.done, run.arrived
  slots = list(run.ip.local_slots)
  pos = {s: 0 for s in slots}
  remaining = sum(len(lists[s]) for s in slots)
  while remaining:
    progressed = False
    for slot in slots:
      ops = lists[slot]
      while pos[slot] < len(ops) and _ready(run, slot, *ops[pos[slot]]):
        op = ops[pos[slot]][0]
        if op.kind == AR and (slot, op) not in done:
          if slot in arrived:
            break  # waiting for the other holders of its names
          arrived.add(slot)
          progressed = True
          if not run.slot_groups[slot]:  # a stage without parameters: nothing to reduce
            run.complete_alone(slot)
          else:
            _try_reduce(run, blocking_ok=False)
          continue  # on, if that finished this AR
        if op.kind != AR:
          run.run_op(slot, op)
        progressed = True
        pos[slot] += 1
        remaining -= 1
    if progressed:
      continue
    # Heads whose only missing inputs are on their way from other processes.
    remote = [run.remote_in[(s, lists[s][pos[s]][0])] for s in slots
              if pos[s] < len(lists[s]) and (s, lists[s][pos[s]][0]) in run.remote_in
              and all(d in done for d in lists[s][pos[s]][1])]
    pending = [k for keys in remote for k in keys if not run.tp.arrived(k)]
    if pending:
      run.tp.wait_arrival(pending, f"step {run.step}'s activations and gradients from other "
                          "processes")
      continue
    if remote:  # what they waited for arrived since the sweep (the inbox fills in a thread)
      continue
    if not _try_reduce(run, blocking_ok=True):
      heads = {s: str(lists[s][pos[s]][0]) for s in slots if pos[s] < len(lists[s])}
      raise RuntimeError(f"plan {run.sp.name} cannot make progress; stuck at {heads}")


def _ready(run: StepRun, slot: Slot, op: Op, deps: tuple[tuple[Slot, Op], ...]) -> bool:
  """Whether `op` may be dispatched: the local ops it depends on are, and what it reads from
  another process has arrived (ops of other processes are not waited for; their data is)."""
  if not all(d in run.done for d in deps):
    return False
  keys = run.remote_in.get((slot, op))
  return keys is None or all(run.tp.arrived(k) for k in keys)


def _try_reduce(run: StepRun, blocking_ok: bool) -> bool:
  """Runs the reductions that may run now (`StepRun.next_groups`); whether any ran."""
  ran = False
  while groups := run.next_groups(blocking_ok):
    for g in groups:
      run.run_group(g)
    ran = True
  return ran
