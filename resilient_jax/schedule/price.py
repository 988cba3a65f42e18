"""What a step costs as the runtime runs it: a replay of a `StepProgram`, the one form every
policy's plan takes on its way to the interpreter.

`cost.simulate` replays a `Schedule`: one op list per worker, one worker per device. A step
program can put two slots on one node (Bamboo's failover: a predecessor runs the failed stage
beside its own), and the runtime dispatches both lists to that node's device, which runs one op
at a time. `replay_program` models that node as a list scheduler: every slot keeps its own
order, and a node runs, of its slots' next ops, the one that can start first (ties: the earlier
stage, so a pipeline's timing never depends on where it sits in the set).

With one slot per node there is no choice and it is `cost.simulate` exactly (tested): a
re-routed grid is priced by `cost.simulate` of its schedule, Bamboo's pipeline set by this
replay, each on the lists the runtime runs. (Oobleck's pipelines share no node; its policy
replays each distinct pipeline alone, `oobleck.oobleck_step_time`, the same lists.)

Rules as in `cost.simulate`: an op starts once its node is free and each dependency has ended
(plus `comm` when that ran on another node); an `AR` starts on every holder of its stage at
once, when the last of them can, and lasts the longest of their durations.

Cost: every op is pushed once and popped once per time its node's clock moved under it (a few
times on a shared node), and its dependencies are read at each pop: O(ops * deps * log(slots))
host time, no grid-sized table beyond the ops' end times.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from resilient_jax.schedule.core import AR, Op
from resilient_jax.schedule.cost import Span, Timeline, measured
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.plan import Slot, StepProgram

SlotDuration = Callable[[Slot, Op], float]
"""Seconds (or any unit) `op` takes on `slot`."""


def replay_program(sp: StepProgram, duration: SlotDuration, *, comm: float = 0.0) -> Timeline:
  """Replays `sp` (see the module docstring); spans are keyed by slot.

  Raises:
    ScheduleError: the program deadlocks (the message names each stuck slot's next op), or a
      duration is negative or not a number.
  """
  slots = sorted(sp.slots)
  # Ties on a shared node go to the earlier stage; across nodes they do not matter.
  rank = {s: i for i, s in enumerate(sorted(slots, key=lambda s: (sp.slots[s].stage, s)))}
  node = {s: sp.slots[s].node for s in slots}
  lists = {s: sp.slots[s].ops for s in slots}
  pos = dict.fromkeys(slots, 0)
  group_of = {slot: (split, stage) for split, stages in sp.holders.items()
              for stage, members in stages.items() for slot in members}
  members = {key: tuple(ms) for split, stages in sp.holders.items()
             for key, ms in (((split, st), m) for st, m in stages.items())}
  end: dict[tuple[Slot, Op], float] = {}
  node_free: dict[int, float] = dict.fromkeys(node.values(), 0.0)
  waiting: dict[tuple[Slot, Op], list[Slot]] = {}
  arrived: dict[tuple, set[Slot]] = {}
  heap: list[tuple[float, int, Slot]] = []
  spans: list[Span] = []

  def earliest(slot: Slot) -> float | None:
    """When `slot`'s next op can start; None (and a wait registered) if a dependency has not
    run yet."""
    op = lists[slot][pos[slot]]
    t = node_free[node[slot]]
    for dep in sp.dependencies(slot, op):
      e = end.get(dep)
      if e is None:
        waiting.setdefault(dep, []).append(slot)
        return None
      t = max(t, e + comm if node[dep[0]] != node[slot] else e)
    return t

  def offer(slot: Slot) -> None:
    if pos[slot] >= len(lists[slot]):
      return
    t = earliest(slot)
    if t is None:
      return
    if lists[slot][pos[slot]].kind != AR:
      heapq.heappush(heap, (t, rank[slot], slot))
      return
    key = group_of[slot]
    got = arrived.setdefault(key, set())
    got.add(slot)
    if len(got) == len(members[key]):
      first = members[key][0]
      heapq.heappush(heap, (max(earliest(m) for m in members[key]), rank[first], first))

  def run(slot: Slot, t0: float, dur: float) -> None:
    op = lists[slot][pos[slot]]
    if not dur >= 0:  # also rejects NaN
      raise ScheduleError(f"duration of {op} on slot {slot} is {dur!r}, not a non-negative time")
    end[(slot, op)] = t0 + dur
    node_free[node[slot]] = t0 + dur
    spans.append(Span(slot, op, t0, t0 + dur))
    pos[slot] += 1

  def woken(slot: Slot, op: Op) -> list[Slot]:
    return [slot, *waiting.pop((slot, op), ())]

  for slot in slots:
    offer(slot)
  while heap:
    t, _, slot = heapq.heappop(heap)
    op = lists[slot][pos[slot]]
    group = members[group_of[slot]] if op.kind == AR else (slot,)
    now = max(earliest(m) for m in group)  # a node's clock may have moved since the push
    if now > t:
      heapq.heappush(heap, (now, rank[slot], slot))
      continue
    dur = max(float(duration(m, lists[m][pos[m]])) for m in group)
    if op.kind == AR:
      del arrived[group_of[slot]]
    for m in group:
      run(m, t, dur)
    for m in group:
      for s in woken(m, op):
        offer(s)
  left = {s: lists[s][pos[s]] for s in slots if pos[s] < len(lists[s])}
  if left:
    stuck = ", ".join(f"{s}:{op}" for s, op in sorted(left.items())[:8])
    raise ScheduleError(f"plan {sp.name}: deadlock, {len(left)} slots can never go on; "
                        f"stuck at {stuck}")
  busy = dict.fromkeys(slots, 0.0)
  for span in spans:
    busy[span.worker] += span.end - span.start
  order = {s: i for i, s in enumerate(slots)}
  spans.sort(key=lambda s: order[s.worker])  # stable: each slot's in its list order
  return Timeline(spans=spans, makespan=max((s.end for s in spans), default=0.0), busy=busy)


def replay_measured(sp: StepProgram, durations: Mapping[tuple[Slot, Op], float], *,
                    comm: float = 0.0) -> Timeline:
  """`replay_program` with the time each op was measured to take on its slot."""
  return replay_program(sp, measured(durations, "slot"), comm=comm)
