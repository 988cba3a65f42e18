"""The list scheduler behind `plan_adaptive` (`adaptive.py`): one event-driven pass over the
cost model that places every F, B and W of the survivors.

Its own module because it is the planner's hot loop, on the runtime's recovery path: every
variant `plan_adaptive` tries is one pass over every op of the touched grid. Its main loop is
therefore kept whole in `_place` and `_land` (a call per instant of the event queue, none per
op), on plain lists and int keys. Which variants to try and how to turn the result into a
`Schedule` is `adaptive.py`'s.

Nothing here imports JAX.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

from resilient_jax.schedule.core import B, F, PieceMap, W, Worker
from resilient_jax.schedule.cost import OpCosts
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.routing import Route

_F, _B, _W = 0, 1, 2
_KIND = (F, B, W)
_TIE = 1e-8
"""Makespans within this of each other may round equal (`adaptive`'s score rounds to 1e-9 s):
a pass stops for a makespan that could tie only where the tie would lose (`_cannot_win`)."""

# Variants tried by `plan_adaptive`, best on GPT-like profiles first: (order in which an idle
# worker considers the kinds, which ready F goes first, limit on Fs not yet back-propagated).
#   F keys:  "feed": the F whose next-stage worker has the fewest forwards coming or waiting
#            (keeps every survivor of the next stage busy; ties as "local"); "local": the lowest
#            position inside its own pipeline (mb % m), so that re-routed micro-batches
#            interleave with a survivor's own at the pace their pipeline feeds them; "mb": the
#            lowest id; "crit": first the micro-batch whose later stages run on the most loaded
#            workers (feeds the bottleneck survivors first).
#   Limits:  None: the memory cap only; "ramp": ceil((pp - s) * load / m) between F and B, 1F1B's
#            warm-up depth scaled by the worker's load: with F before B, 1F1B's rhythm.
_VARIANTS: tuple[tuple[tuple[int, ...], str, str | None], ...] = (
  ((_B, _F, _W), "feed", None),
  ((_F, _B, _W), "feed", "ramp"),
  ((_B, _F, _W), "local", None),
  ((_F, _B, _W), "local", "ramp"),
  ((_B, _F, _W), "mb", None),
  ((_B, _F, _W), "crit", None),
)


class _Listed(NamedTuple):
  """What `_list_schedule` returns (see there)."""

  out: list[list[tuple[int, int]]]
  starts: list[list[float]]
  makespan: float
  peak: int
  feed_was_local: bool
  crit_is_mb: bool


def _list_schedule(
  pp: int,
  m: int,
  route: Route,
  live: Sequence[Worker],
  costs: OpCosts,
  cap: int,
  order: tuple[int, ...],
  f_key: str,
  act_cap: Sequence[int] | None = None,
  speed: Sequence[float] | None = None,
  beat: float = math.inf,
  beat_peak: int = 0,
  pieces: PieceMap | None = None,
  samples: int = 1,
  graph: _Graph | None = None,
) -> _Listed:
  """Event-driven list scheduling of F, B and W over the cost model.

  Whenever a worker is idle it starts the best ready op: the first kind in `order` that has a
  ready op (F only while the worker holds fewer than `cap` micro-batches in flight and fewer than
  its `act_cap` between F and B), the best of that kind by its key (B and W: lowest id). An op
  starts as soon as the worker is free and its dependencies (plus `costs.comm` across workers)
  are done, which is exactly how `simulate` replays the recorded order, so the makespan this
  returns is the replay's.

  Args:
    pp: pipeline stages.
    m: micro-batches per pipeline.
    route: the routes.
    live: the live workers.
    costs: op costs.
    cap: most micro-batches in flight (F done, W not) per worker.
    order: priority of the kinds `_B`, `_F`, `_W`.
    f_key: which ready F goes first (see `_VARIANTS`).
    act_cap: per worker (in `live` order), most micro-batches between F and B; None: no limit.
    speed: per worker (in `live` order), its speed: its ops but the AR take `1 / speed` of the
      cost model's time (`routing.speed_scaled`, as `simulate` is then given); None: all 1.
    beat: the makespan to beat (the best variant's so far): the pass stops as soon as some
      worker's ops still to run, back to back from the op it starts, plus its stage's AR and
      OPT, end later (by more than `_TIE`), so its makespan would: it then returns a makespan
      of infinity and half a plan. A plan that is finished is the same as without `beat`.
    beat_peak: the best variant's in-flight peak, which breaks a tie of makespans: once this
      pass holds as many in flight, it also stops when its makespan can at best tie `beat`
      (rounded to 1e-9 s, as `adaptive` compares them).
    pieces: stages of micro-batches split into pieces (`core.PieceMap`): each piece is a node
      of its own on its worker, timed at `costs.piece_scale` of the whole op; the next stage's
      forward waits for every piece (a gather), each piece's backward for the whole gradient.
    samples: samples in a micro-batch (what `pieces` divide).
    graph: `_nodes` of these routes and pieces, when the caller built it already (it plans
      several variants on the same routes).

  Returns:
    Per worker (in `live` order) its compute ops in execution order as `(kind, mb)` with kinds
    `_F`, `_B`, `_W` (see `_to_ops`) and their start times (`validate.Timing`), the makespan
    of the step once each worker's AR and OPT are appended, the most micro-batches any worker
    holds in flight, (for "feed") whether every F it picked was the one "local" picks, i.e.
    "local" with the same order and limits would make this very plan, and whether "crit"
    orders every worker's forwards as "mb" does (all of a worker's micro-batches meet the same
    most loaded worker downstream), i.e. would make the same plan as "mb". Stopped by `beat`,
    the makespan is infinite and `feed_was_local` says whether "local" would have made the
    same picks up to there (and so would stop there too).

  Raises:
    ScheduleError: if the ops cannot all be placed (a limit below 1).
  """
  if graph is None:
    graph = _nodes(pp, route, live, pieces, samples, costs.fixed)
  node_w = graph.node_w
  crit, crit_is_mb = _criticality(graph, len(live))
  f_entry = _f_entries(f_key, m, crit, graph.node_mb)
  act_lim = list(act_cap) if act_cap is not None else [cap] * len(live)
  speed = list(speed) if speed is not None else [1.0] * len(live)
  dur = [(costs.f_at(s) / v, costs.b_at(s) / v, costs.w_at(s) / v)
         for (_, s), v in zip(live, speed, strict=True)]
  # Per worker, the time its ops not yet started take back to back, and what follows its last
  # op (its stage's AR and OPT): its makespan's bound at each pick (`_cannot_win`).
  left = [0.0] * len(live)
  for w, x in zip(node_w, graph.scale, strict=True):
    left[w] += sum(dur[w]) * x
  tail = [costs.ar_at(s) + costs.opt_at(s) / v for (_, s), v in zip(live, speed, strict=True)]
  deadline = (tail, beat, beat_peak)
  out, starts, last_end, peak, feed_was_local = _place(
    graph, live, dur, costs.comm, cap, act_lim, order, f_key, f_entry, left, deadline)
  if last_end is None:  # stopped: it would not beat `beat`
    return _Listed(out, starts, math.inf, peak, feed_was_local, crit_is_mb)
  scheduled, total = sum(len(ops) for ops in out), 3 * len(node_w)
  if scheduled != total:
    # Cannot happen with limits >= 1 (the last stage always drains), but never return half a plan.
    raise ScheduleError(f"list scheduling stalled after {scheduled} of {total} ops (cap {cap})")
  # Staggered optimizer: a stage's AR starts when the last of its workers is done, then OPT.
  stage_end: dict[int, float] = {}
  for w, (_, s) in enumerate(live):
    stage_end[s] = max(stage_end.get(s, 0.0), last_end[w])
  makespan = max(stage_end[s] + costs.ar_at(s) + costs.opt_at(s) / speed[w]
                 for w, (_, s) in enumerate(live))
  return _Listed(out, starts, makespan, peak, feed_was_local, crit_is_mb)


class _Graph(NamedTuple):
  """The list scheduler's nodes: one per (micro-batch, stage), or per piece of a split stage,
  numbered in (micro-batch, stage, piece) order (without pieces: node = mb * pp + stage).

  Attributes:
    node_w: per node, its worker (index in `live`).
    node_s: per node, its stage.
    node_mb: per node, its micro-batch.
    nxt: per node, the nodes of the next stage of its micro-batch (its forward's consumers).
    prv: per node, the nodes of the stage before (its forward's inputs).
    scale: per node, the share of the whole op's time it takes (`OpCosts.piece_scale`).
    feeds: per node, the workers whose supply of forwards its F adds one to (the next stage's:
      each piece of a split one; a gathered whole one once, by its first piece).
  """

  node_w: list[int]
  node_s: list[int]
  node_mb: list[int]
  nxt: list[tuple[int, ...]]
  prv: list[tuple[int, ...]]
  scale: list[float]
  feeds: list[tuple[int, ...]]


def _nodes(pp: int, route: Route, live: Sequence[Worker], pieces: PieceMap | None,
           samples: int, fixed: float) -> _Graph:
  """The `_Graph` of `route` (and `pieces`) over the `live` workers."""
  wid = {w: i for i, w in enumerate(live)}
  n_mb = len(route)
  if not pieces:
    n = n_mb * pp
    last = pp - 1
    node_w = [wid[(route[mb][s], s)] for mb in range(n_mb) for s in range(pp)]
    nxt = [(i + 1,) if i % pp < last else () for i in range(n)]
    return _Graph(
      node_w,
      list(range(pp)) * n_mb,
      [mb for mb in range(n_mb) for _ in range(pp)],
      nxt,
      [(i - 1,) if i % pp else () for i in range(n)],
      [1.0] * n,
      [(node_w[i + 1],) if i % pp < last else () for i in range(n)],
    )
  node_w: list[int] = []
  node_s: list[int] = []
  node_mb: list[int] = []
  scale: list[float] = []
  at: list[tuple[int, ...]] = []  # per (mb, stage), its nodes
  for mb in range(n_mb):
    for s in range(pp):
      split = pieces.get((mb, s))
      parts = ((route[mb][s], 0, samples),) if split is None else split
      first = len(node_w)
      for d, lo, hi in parts:
        node_w.append(wid[(d, s)])
        node_s.append(s)
        node_mb.append(mb)
        scale.append(1.0 if split is None else fixed + (1.0 - fixed) * (hi - lo) / samples)
      at.append(tuple(range(first, len(node_w))))
  nxt = [at[mb * pp + s + 1] if s < pp - 1 else () for mb, s in zip(node_mb, node_s, strict=True)]
  prv = [at[mb * pp + s - 1] if s else () for mb, s in zip(node_mb, node_s, strict=True)]
  feeds = [tuple(node_w[n] for n in nxt[i] if prv[n][0] == i) for i in range(len(node_w))]
  return _Graph(node_w, node_s, node_mb, nxt, prv, scale, feeds)


def _criticality(graph: _Graph, n_w: int) -> tuple[list[int], bool]:
  """The "crit" key of every node, and whether it orders each worker's forwards as "mb" does.

  Args:
    graph: the nodes.
    n_w: live workers.

  Returns:
    Per node, minus the load of the most loaded worker at its stage or below in its
    micro-batch (pieces count as nodes); and whether all nodes of every worker share one key
    (then "crit" and "mb" make the same plan).
  """
  node_w, node_mb = graph.node_w, graph.node_mb
  load = [0] * n_w
  for w in node_w:
    load[w] += 1
  crit = [0] * len(node_w)
  worst, mb = 0, -1
  # Nodes run in (micro-batch, stage) order: backwards, each micro-batch from its last stage.
  for node in range(len(node_w) - 1, -1, -1):
    if node_mb[node] != mb:
      worst, mb = 0, node_mb[node]
    worst = max(worst, load[node_w[node]])
    crit[node] = -worst
  crit_of: list[int | None] = [None] * n_w
  for node, w in enumerate(node_w):
    if crit_of[w] is None:
      crit_of[w] = crit[node]
    elif crit_of[w] != crit[node]:
      return crit, False
  return crit, True


def _f_entries(f_key: str, m: int, crit: list[int], node_mb: list[int]) -> list[int]:
  """Every node's entry in its worker's queue of ready forwards under `f_key`.

  Queue entries are ints ordered as (key, node) tuples would be, node = entry % n_nodes:
  planning is on the recovery path, and int keys halve its time. B and W go lowest id first,
  and on one worker (one stage) node order is id order, so their entry is the node. F's key:
  "mb": the id; "local"/"feed": (mb % m, mb); "crit": (crit, mb).
  """
  n_nodes = len(crit)
  if f_key == "mb":
    return list(range(n_nodes))
  if f_key in ("local", "feed"):
    return [(node_mb[node] % m) * n_nodes + node for node in range(n_nodes)]
  low = min(crit, default=0)
  return [(crit[node] - low) * n_nodes + node for node in range(n_nodes)]


def _place(
  graph: _Graph,
  live: Sequence[Worker],
  dur: list[tuple[float, float, float]],
  comm: float,
  cap: int,
  act_lim: list[int],
  order: tuple[int, ...],
  f_key: str,
  f_entry: list[int],
  left: list[float],
  deadline: tuple[list[float], float, int],
) -> tuple[list[list[tuple[int, int]]], list[list[float]], list[float] | None, int, bool]:
  """The event loop of `_list_schedule`: idle workers pick, then the next instant's events land.

  Args:
    live, cap, order, f_key: as for `_list_schedule`.
    graph: the nodes (`_nodes`).
    dur, comm: per worker, its F, B and W times (at its speed) for a whole micro-batch; the
      transfer time.
    act_lim: per worker, most micro-batches between F and B.
    f_entry: every node's entry in a queue of ready forwards (`_f_entries`).
    left, deadline: per worker, its ops' time back to back (consumed as they start); (per
      worker, its stage's AR and OPT after its last op, `beat`, `beat_peak`): see there.

  Returns:
    Per worker its `(kind, mb)` in order, their starts and its last op's end (None: stopped);
    the most micro-batches in flight; (for "feed") whether every F picked was its heap's head.
  """
  node_w, node_s, node_mb, nxt, prv, scale, feeds = graph
  n_w, n_nodes = len(live), len(node_w)
  tail, beat, tie_peak = deadline
  # B of a node waits for its own F and, below the last stage, for the Bs of the stage above;
  # F for the Fs of the stage below (more than one where that stage is split into pieces).
  b_need = [1 + len(n) for n in nxt]
  b_ready = [0.0] * n_nodes
  f_need = [len(p) for p in prv]
  f_ready = [0.0] * n_nodes
  queues, supply, rank = _start(graph, live, f_entry)
  inflight = [0] * n_w
  active = [0] * n_w
  busy = [False] * n_w
  last_end = [0.0] * n_w
  out: list[list[tuple[int, int]]] = [[] for _ in range(n_w)]
  starts: list[list[float]] = [[] for _ in range(n_w)]
  # (time, seq, code): code = (node * 3 + kind) * 2 + is_finish; seq makes ties deterministic
  # (and is unique, so the comparison never reaches the code).
  events: list[tuple[float, int, int]] = []
  seq = 0
  push, pop = heapq.heappush, heapq.heappop
  peak = 0
  dirty = set(range(n_w))
  t = 0.0
  feed_was_local = f_key == "feed"
  while True:
    # Deterministic, and downstream first: a worker that starts consuming its queued forwards
    # now no longer counts them as supply when its upstream peers pick at the same instant.
    for w in sorted(dirty, key=rank.__getitem__):
      if busy[w]:
        continue
      q = queues[w]
      pick = -1
      for kind in order:
        if q[kind] and (kind != _F or (inflight[w] < cap and active[w] < act_lim[w])):
          pick = kind
          break
      if pick < 0:
        continue
      if pick == _F and f_key == "feed":
        node, was_head = _feed_pick(q[_F], supply, node_w, nxt)
        feed_was_local = feed_was_local and was_head
      else:
        node = pop(q[pick]) % n_nodes
      if pick == _F:
        inflight[w] += 1
        peak = max(peak, inflight[w])
        active[w] += 1
        supply[w] -= 1
        for v in feeds[node]:
          supply[v] += 1
      elif pick == _B:
        active[w] -= 1
      end = t + left[w] + tail[w]  # the pass's makespan at the earliest; the call only near it
      if end >= beat - _TIE and _cannot_win(end, beat, peak >= tie_peak):
        return out, starts, None, peak, feed_was_local
      took = dur[w][pick] * scale[node]
      left[w] -= took
      busy[w] = True
      out[w].append((pick, node_mb[node]))
      starts[w].append(t)
      seq += 1
      push(events, (t + took, seq, (node * 3 + pick) * 2 + 1))
    dirty.clear()
    if not events:
      return out, starts, last_end, peak, feed_was_local
    t = events[0][0]
    seq = _land(t, events, seq, graph, f_entry, queues, busy, last_end, inflight,
                (b_need, b_ready, f_need, f_ready), dirty, comm)


def _start(graph: _Graph, live: Sequence[Worker], f_entry: list[int]
           ) -> tuple[list[tuple[list, list, list]], list[int], list[int]]:
  """`_place`'s start: per worker its queues of ready F, B and W (the first stage's forwards
  queued), its supply (forwards started upstream or waiting here that it has not started yet),
  and the order idle workers pick in (downstream stages first, then by worker: `(-stage, w)` as
  one int)."""
  node_w, node_s, _, _, prv, _, _ = graph
  n_w = len(live)
  queues: list[tuple[list, list, list]] = [([], [], []) for _ in range(n_w)]
  supply = [0] * n_w
  for node in range(len(node_w)):
    if not prv[node]:
      heapq.heappush(queues[node_w[node]][_F], f_entry[node])
      supply[node_w[node]] += 1
  pp = max(node_s, default=0) + 1
  rank = [(pp - 1 - s) * n_w + w for w, (_, s) in enumerate(live)]
  return queues, supply, rank


def _cannot_win(end: float, beat: float, tie_loses: bool) -> bool:
  """Whether a pass whose makespan is at least `end` (a worker's remaining ops back to back,
  then its stage's AR and OPT) cannot beat `beat`, the best makespan so far rounded to 1e-9 s
  as `adaptive` compares them: it is later by more than `_TIE`, or, where a tie loses (the pass
  holds as many in flight as the best), it cannot round below `beat` (`end`, a sum of floats,
  is taken 1e-12 lower than computed, more than its rounding error)."""
  return end > beat + _TIE or (tie_loses and end >= beat - _TIE
                               and round(end - 1e-12, 9) >= beat)


def _feed_pick(fq: list[int], supply: list[int], node_w: list[int],
               nxt: list[tuple[int, ...]]) -> tuple[int, bool]:
  """Takes "feed"'s F out of the heap `fq`: the F whose next stage has the fewest forwards
  coming or waiting, which keeps every worker of the next stage fed instead of queueing work at
  one of them (of a split next stage, its first piece's worker; `nxt`: `_Graph.nxt`).
  Returns its node and whether it was the heap's head ("local"'s pick)."""
  n_nodes = len(node_w)
  best_i = min(
    range(len(fq)),
    key=lambda i: (supply[node_w[n[0]]] if (n := nxt[fq[i] % n_nodes]) else 0, fq[i]),
  )
  was_head = fq[best_i] == fq[0]
  node = fq[best_i] % n_nodes
  fq[best_i] = fq[-1]
  fq.pop()
  heapq.heapify(fq)
  return node, was_head


def _land(
  t: float,
  events: list[tuple[float, int, int]],
  seq: int,
  graph: _Graph,
  f_entry: list[int],
  queues: list[tuple[list, list, list]],
  busy: list[bool],
  last_end: list[float],
  inflight: list[int],
  needs: tuple[list[int], list[float], list[int], list[float]],
  dirty: set[int],
  comm: float,
) -> int:
  """Lands every event at time `t`, before any worker picks, so choices see all that is ready.

  A finished op frees its worker and makes its successors ready: the next stage's F (after
  `comm`, once every piece it gathers is done), its own W, and the B of the stage below once
  both its F and every B above are done. Readiness at a later time is a new event; at `t` the
  op joins its worker's queue at once. Every worker touched goes into `dirty`. `needs`: per
  node, the Bs and Fs it still waits for and when the last one's output arrives. Returns the
  last event sequence number used.
  """
  push, pop = heapq.heappush, heapq.heappop
  node_w, nxt, prv = graph.node_w, graph.nxt, graph.prv
  b_need, b_ready, f_need, f_ready = needs
  while events and events[0][0] <= t:
    code = pop(events)[2]
    node, kind = divmod(code >> 1, 3)
    w = node_w[node]
    dirty.add(w)
    if not code & 1:
      push(queues[w][kind], f_entry[node] if kind == _F else node)
      continue
    busy[w] = False
    last_end[w] = t
    # What becomes ready now (free transfers) joins its queue at once: an event at time t
    # would only be popped in this same batch, before any worker picks.
    if kind == _F:
      at = t + comm
      for n in nxt[node]:
        if f_need[n] > 1:  # a gather: the last piece's output completes the input
          f_need[n] -= 1
          if at > f_ready[n]:
            f_ready[n] = at
          continue
        ready = f_ready[n] if f_ready[n] > at else at
        if ready > t:
          seq += 1
          push(events, (ready, seq, (n * 3 + _F) * 2))
        else:
          push(queues[node_w[n]][_F], f_entry[n])
          dirty.add(node_w[n])
      # Its own B needs this F (and every B of the stage above).
      if t > b_ready[node]:
        b_ready[node] = t
      b_need[node] -= 1
      if b_need[node] == 0:
        if b_ready[node] > t:
          seq += 1
          push(events, (b_ready[node], seq, (node * 3 + _B) * 2))
        else:
          push(queues[w][_B], node)
      continue
    if kind == _W:
      inflight[w] -= 1
      continue
    push(queues[w][_W], node)
    # B of each node of the stage below is ready once its own F and every B above are done.
    at = t + comm
    for up in prv[node]:
      if at > b_ready[up]:
        b_ready[up] = at
      b_need[up] -= 1
      if b_need[up] == 0:
        if b_ready[up] > t:
          seq += 1
          push(events, (b_ready[up], seq, (up * 3 + _B) * 2))
        else:
          push(queues[node_w[up]][_B], up)
          dirty.add(node_w[up])
  return seq
