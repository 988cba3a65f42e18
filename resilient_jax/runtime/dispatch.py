"""Who dispatches a step's ops: the calling thread, or a thread per pipeline or per slot.

A `StepRun` (`runtime/step_run.py`) dispatches the op lists of this process's slots; a
`Dispatcher` decides which thread runs which slots and when each op may go.

**Who dispatches: one mechanism, a number of threads (`DISPATCH_MODES`).** The local slots are
split among owners; each owner sweeps its slots round-robin, dispatching each slot's ops in
order as far as their dependencies allow, and waits when none can go on.

* `serial` (the default): one owner, the calling thread, which also runs the reductions
  between its sweeps. Profile mode and multi-process jobs always run so (see `owners`).
* `pipelines`: a thread per data-parallel pipeline (its stages pass activations among
  themselves without crossing threads); `slots`: a thread per slot. The calling thread runs
  the reductions as their holders arrive.

Where the host's time per op goes (8 simulated devices in one process; `docs/benchmarks.md`):
most of it is the compiled program's C++ call, about a microsecond per argument and result
array (a stage's parameters, gradients, optimizer state and residuals: 50 to 440 arrays a
call), then placing data and Python around it. Part of the C++ call runs without the GIL, so
threads can overlap it; measured side by side on a loaded 2-core machine they did not win
consistently (per-round step ratios against `serial` from 0.8 to 1.2, 0.67 to 1.37 in earlier
runs) and spent up to 30% (a thread per pipeline) or 40% (per slot) more CPU on handing the GIL
over, so `serial` stays the default and the thread modes are there to measure on hosts with
cores to spare (`benchmarks/dispatch.py`).

Every mode keeps the rules that make a step correct and reproducible:

* each slot runs its ops in its schedule's order, so every program sees the same inputs;
* a reduction sums its members in one order (`Transport.reduce`), so results are bitwise the
  same whichever mode and whatever the interleaving;
* reductions with holders in other processes run in the one global group order, so no two
  processes wait on each other (with one owner, only when nothing else can be dispatched,
  since the one thread blocks in them; with several, the reducing thread may block while the
  owners go on);
* `after_op` fires after the same ops (and per slot inside its reduction); a `WorkerLost` it
  raises, or any error, stops every dispatch thread and is raised to the caller, the committed
  state untouched. (With several owners, the others go on while a pause hook holds one.)
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from resilient_jax.schedule.core import AR, Op
from resilient_jax.schedule.plan import Slot

if TYPE_CHECKING:
  from resilient_jax.runtime.step_run import StepRun

DISPATCH_MODES = ("pipelines", "slots", "serial")
WAIT_BOUND_S = 600.0
"""The longest a dispatch thread waits for one op of another local slot. Local ops wait only
on each other and on transfers, which the transport bounds itself; past this the plan cannot
make progress."""
_POLL_S = 0.5  # how often a waiting thread looks whether the attempt was abandoned


def owners(slots: list[Slot], mode: str, one_thread: bool = False) -> list[list[Slot]]:
  """The local slots each dispatch thread runs; one list: the calling thread runs them all.

  `one_thread` (whatever `mode` says): profile mode, whose per-op timing waits for every op and
  so serialises the devices anyway; and a multi-process job, whose ops reading another
  process's data wait for it to arrive (`runtime.inbox`): the one thread then blocks in
  `Transport.wait_arrival` only when nothing local can go on, which several threads could not
  know of each other.

  Raises:
    ValueError: `mode` is not one of `DISPATCH_MODES`.
  """
  if mode not in DISPATCH_MODES:
    raise ValueError(f"dispatch mode {mode!r} is not one of {DISPATCH_MODES}")
  if mode == "serial" or one_thread:
    return [list(slots)]
  if mode == "slots":
    return [[s] for s in slots]
  by_pipeline: dict[int, list[Slot]] = {}
  for s in slots:
    by_pipeline.setdefault(s[0], []).append(s)
  return list(by_pipeline.values())


class _Abandoned(Exception):
  """Another dispatch thread failed: this one stops (the first error is the one raised)."""


class Dispatcher:
  """Runs each owner's slots (a list of local slots) on a thread of its own, or all of them
  on the calling thread when there is one owner.

  An owner sweeps its slots round-robin, dispatching each slot's ops in order as far as their
  dependencies allow; when none of its slots can go on, it waits until another thread
  dispatches an op one of them may wait for (`crossing`) or finishes a reduction. With one
  owner, the calling thread also runs the reductions between its sweeps (in the global order
  and only when nothing else can be dispatched if they wait on other processes, since it
  blocks in them); with several, the calling thread runs them as their holders arrive while
  the owners go on.
  """

  def __init__(self, run: StepRun, owners: list[list[Slot]]):
    self.run = run
    self.owners = [o for o in owners if o]
    self.cond = threading.Condition()
    self.generation = 0  # counts the ops other owners may wait for, done
    self.errors: list[BaseException] = []
    owner_of = {s: i for i, o in enumerate(self.owners) for s in o}
    lists = run.ip.dispatch_lists
    self.crossing = {d for s in run.local for _, deps in lists[s] for d in deps
                     if owner_of[d[0]] != owner_of[s]}

  def dispatch(self) -> None:
    run = self.run
    if len(self.owners) == 1:
      self._sweep(self.owners[0], inline=True)
      return
    run.transfers = threading.Lock()  # the transport serves one caller at a time
    threads = [threading.Thread(target=self._owner, args=(o,), name=f"dispatch {o[0]}",
                                daemon=True) for o in self.owners]
    try:
      for t in threads:
        t.start()
      self._reduce_all()
    except BaseException as err:  # noqa: BLE001 - stop the owners, then raise the first error
      self._fail(err)
    finally:
      deadline = time.monotonic() + WAIT_BOUND_S
      for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
      self._fail(RuntimeError(f"plan {run.sp.name}: a dispatch thread did not finish"))
    if self.errors:
      raise self.errors[0]

  def _owner(self, slots: list[Slot]) -> None:
    cpu = time.thread_time()
    try:
      self._sweep(slots, inline=False)
    except BaseException as err:  # noqa: BLE001 - handed to the calling thread
      self._fail(err)
    finally:
      with self.cond:
        self.run.dispatch_cpu_s += time.thread_time() - cpu

  def _fail(self, err: BaseException) -> None:
    with self.cond:
      if not isinstance(err, _Abandoned):
        self.errors.append(err)
      self.cond.notify_all()

  def _changed(self) -> None:
    with self.cond:
      self.generation += 1
      self.cond.notify_all()

  def _sweep(self, slots: list[Slot], inline: bool) -> None:
    run = self.run
    lists = run.ip.dispatch_lists
    done, arrived = run.done, run.arrived
    pos = {s: 0 for s in slots}
    remaining = sum(len(lists[s]) for s in slots)
    deadline = time.monotonic() + WAIT_BOUND_S
    while remaining:
      seen = self.generation
      progressed = False
      for slot in slots:
        ops = lists[slot]
        while pos[slot] < len(ops) and self._ready(slot, *ops[pos[slot]]):
          op = ops[pos[slot]][0]
          if op.kind == AR and (slot, op) not in done:
            if slot in arrived:
              break  # waiting for the other holders of its names
            with self.cond:
              arrived.add(slot)
              self.cond.notify_all()  # the reducing thread
            progressed = True
            if not run.slot_groups[slot]:  # a stage without parameters: nothing to reduce
              run.complete_alone(slot)
              self._changed()
            elif inline:
              self._try_reduce(blocking_ok=False)
            continue  # on, if that finished this AR
          if op.kind != AR:
            run.run_op(slot, op)
            if (slot, op) in self.crossing:
              self._changed()
          progressed = True
          pos[slot] += 1
          remaining -= 1
      if progressed:
        deadline = time.monotonic() + WAIT_BOUND_S
        continue
      if inline:
        # Heads whose only missing input is on its way from another process.
        pending = [run.remote_in[(s, lists[s][pos[s]][0])] for s in slots
                   if pos[s] < len(lists[s]) and (s, lists[s][pos[s]][0]) in run.remote_in
                   and all(d in done for d in lists[s][pos[s]][1])]
        if pending:
          run.tp.wait_arrival(pending, f"step {run.step}'s activations and gradients from other "
                              "processes")
          continue
        if not self._try_reduce(blocking_ok=True):
          heads = {s: str(lists[s][pos[s]][0]) for s in slots if pos[s] < len(lists[s])}
          raise RuntimeError(f"plan {run.sp.name} cannot make progress; stuck at {heads}")
        continue
      with self.cond:
        while self.generation == seen and not self.errors:
          if time.monotonic() > deadline:
            heads = {s: str(lists[s][pos[s]][0]) for s in slots if pos[s] < len(lists[s])}
            raise RuntimeError(f"plan {run.sp.name} cannot make progress; stuck at {heads}")
          self.cond.wait(_POLL_S)
      if self.errors:
        raise _Abandoned()

  def _ready(self, slot: Slot, op: Op, deps: tuple[tuple[Slot, Op], ...]) -> bool:
    """Whether `op` may be dispatched: the local ops it depends on are, and what it reads from
    another process has arrived (ops of other processes are not waited for; their data is)."""
    if not all(d in self.run.done for d in deps):
      return False
    key = self.run.remote_in.get((slot, op))
    return key is None or self.run.tp.arrived(key)

  def _try_reduce(self, blocking_ok: bool) -> bool:
    """Runs the reductions that may run now (`StepRun.next_groups`); whether any ran."""
    ran = False
    while groups := self.run.next_groups(blocking_ok):
      for g in groups:
        self.run.run_group(g)
      ran = True
    return ran

  def _reduce_all(self) -> None:
    """Runs the reductions as their local holders arrive (this thread may block in one with
    other processes while the owners go on)."""
    run = self.run
    todo = {g.index for g in run.ip.groups if any(h in run.local for h in g.holders)}
    while todo - run.group_done:
      deadline = time.monotonic() + WAIT_BOUND_S
      with self.cond:
        groups = run.next_groups(blocking_ok=True)
        while not groups and not self.errors:
          if time.monotonic() > deadline:
            raise RuntimeError(f"plan {run.sp.name} cannot make progress: reductions "
                               f"{sorted(todo - run.group_done)} wait for their holders")
          self.cond.wait(_POLL_S)
          groups = run.next_groups(blocking_ok=True)
      if self.errors:
        return
      for g in groups:
        run.run_group(g)
      self._changed()
