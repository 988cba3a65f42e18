"""Stragglers: a worker persistently slower than its stage's peers keeps only the share of
micro-batches it can finish in time, and gets its share back once it recovers.

A slow device (thermal throttling, a bad link, a noisy neighbour) holds every synchronous step
to its pace: without help a stage with one worker at half speed runs at half speed. ReCycle's
re-routing is the tool for it, applied in part: the policy re-plans with per-worker speeds
(`RunCoordinator.reweigh`, `Grid.speeds`), which moves micro-batches off the slow worker to its
stage's peers in proportion to its speed (`routing.proportional_loads`) and lets the list
scheduler fill bubbles with them. The global batch, the samples and the sums are unchanged, so
the losses are the fault-free run's.

Detection: every `resilience.straggler_every` steps the step runs profiled (each op waited for
and timed, as the timelines' steps are) and each worker's backward time per micro-batch is
compared with its stage peers' (their median, itself left out; `peer_ratios`). A worker
whose ratio stays above `resilience.straggler_threshold` for `resilience.straggler_steps`
measured steps in a row is a straggler at speed `1 / median ratio`; one in force whose ratios
over as many steps have their median below half-way to the threshold has recovered (a median,
so that one noisy step does not hold it back: a worker left with one micro-batch is timed by
single ops, which on shared cores read up to 4.5x its peers' once in a while). The change
goes in at the start of the next step (a log line, an event in `goodput.json`), like a failure
found after a step. A speed in force is kept until the worker recovers: re-measured under its
new share, a worker slowed 2x on shared, oversubscribed cores read ever slower (0.49, then
0.29, 0.19, 0.12 of its peers in successive re-plans), a drift of the measurement, not of the
device.
Not measured: a step that compiled (its op times include the compiles) and the first step of a
new plan (its first transfers between new pairs of devices and first placements of inputs
read as slow ops); a worker's window starts over after its speed changed.

Injection (`faults.slow=STEP:DP.STAGE:FACTOR`, by the interpreter: `fault_specs.slowdowns_at`):
from STEP on, that worker's every op (not its all-reduce) is waited for and followed by a sleep
of FACTOR - 1 times what it took (`runtime/step_run._stretch`), so the device is taken FACTOR
times as long.

In a multi-process job each process times its own workers (a job draws no timelines, so the
measured steps are its only profiled ones), and what it times is the op's device work: an op's
clock starts at its dispatch, an op that reads an activation or gradient from another process
is dispatched only once that arrived (`runtime/inbox.py`), and in a profiled step every earlier
op of the process was waited for, so no time includes a wait on another process (what kept a
job's steps unprofiled before the inbox: an op queued behind a pending pull read as slow). On
this loaded 2-core machine (tiny model, ops of ~0.4 ms), the worker that read slowest against
its stage peer on the other process read 1.1-3.0x in fault-free steps, and a worker slowed 6x
read 4.1-19.8x (`docs/benchmark_results.md`). Agreement is `Group.gather`, then
`Group.agree` (as the replica check's, `integrity.py`): each process publishes, per worker and
backward kind, its `op_times` in 4 significant digits and whether it compiled in the step,
under `step/{S}/stragglers/{attempt}/{pid}`; process 0 waits (bounded) for every process that
holds a slot, leaving out one proven dead first (the next step's agreement finds its death),
runs the watch alone and publishes the speeds to put in force, or null, under `.../speeds`;
every process then re-plans alike (`RunCoordinator.reweigh`: process 0 publishes the plan's
digest, the others check theirs). A speed put in force joins the membership history, so a
process relaunched into the job replays it with the failures (`admission.replay`) and plans
what the others do; the watch's windows are process 0's alone, and process 0 never rejoins.

Scope: only recycle and naive re-weight, on grids they plan whole (at most
`rerouting.DEFAULT_EXACT_OPS` compute ops); another policy in force, or a larger grid, keeps
its plan (the log says so).

Costs per measured step: every op waited for (a process's devices' work serialised, as in any
profiled step) and O(local ops) host work per process to summarise its records. In a job of P
processes of L workers: one key-value write of ~20 + 35 L to 20 + 70 L bytes per process (one
or two backward kinds), one directory read a poll on process 0 (`Cluster.await_keys`:
O(workers) bytes, ~1 MB at 16k workers), one
decision of 4 bytes (null) or ~15 per speed in force read by the P - 1 others, who wait for it
(process 0's gather and decision, then a key-value round trip). Process 0's decision is
O(workers log dp) (`peer_ratios`: 0.04 s of CPU at 2048 x 8 here, where comparing each worker
with each peer took 0.38 s at 512 x 8) plus the watch's O(workers). A re-plan costs one
planning of the whole grid on every process (`rerouting.py`); nothing is copied (every worker
holds its stage).
"""

from __future__ import annotations

import bisect
import collections
import statistics
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from resilient_jax.config import RunConfig
from resilient_jax.observe.events import Speeds
from resilient_jax.observe.profiling import RunTimelines
from resilient_jax.observe.records import OpRecord
from resilient_jax.schedule.core import BW, B, W, Worker
from resilient_jax.schedule.plan import GridPlan
from resilient_jax.training.run import Run

_MEASURED = (B, W, BW)
"""The kinds of op timed. Forwards are left out: a stage's first forward of a step also places
the step's inputs (or targets) on its device (`StepRun.data`), more of them for a worker with
more micro-batches."""

KindTimes = dict[str, tuple[float, float | None]]
"""Per kind of op, a worker's first op's duration and the median of its others' (None: it ran
one)."""


def op_times(records: Iterable[OpRecord]) -> dict[Worker, KindTimes]:
  """Per worker, per backward kind it ran, `(first, median of the rest)` of its durations. A
  worker's first op of a kind does one-off work of the step (its first W allocates the gradient
  accumulator: 2x the others' time on the tiny model), so it is kept apart: a worker left with
  one micro-batch is compared by its first ops with its peers' first ops."""
  times: dict[Worker, dict[str, list[float]]] = {}
  for r in records:
    if r.op.kind in _MEASURED:
      times.setdefault(tuple(r.worker), {}).setdefault(r.op.kind, []).append(r.end - r.start)
  return {w: {k: (ts[0], statistics.median(ts[1:]) if len(ts) > 1 else None)
              for k, ts in kinds.items()} for w, kinds in times.items()}


def peer_ratios(times: Mapping[Worker, KindTimes]) -> dict[Worker, float]:
  """Each worker's backward time per micro-batch over its stage peers' (their median, itself
  left out), summed over the kinds: its later ops against the peers' later ops where it and
  some peer ran several, else first ops against first ops. Workers with no measured peer are
  left out. Each stage's times are sorted once per kind, and a median without one member is
  read from that order (`_median_without`): O(workers log dp), not O(dp^2) a stage."""
  by_stage: dict[int, list[Worker]] = {}
  for w in times:
    by_stage.setdefault(w[1], []).append(w)
  out = {}
  for members in by_stage.values():
    kinds = {k for w in members for k in times[w]}
    firsts = {k: sorted(times[w][k][0] for w in members if k in times[w]) for k in kinds}
    rests = {k: sorted(times[w][k][1] for w in members
                       if k in times[w] and times[w][k][1] is not None) for k in kinds}
    for w in members:
      own = ref = 0.0
      for kind, (first, rest) in times[w].items():
        later = _median_without(rests[kind], rest)
        if rest is not None and later is not None:
          own, ref = own + rest, ref + later
        else:
          peers = _median_without(firsts[kind], first)
          if peers is not None:
            own, ref = own + first, ref + peers
      if ref > 0:
        out[w] = own / ref
  return out


def _median_without(ordered: list[float], value: float | None) -> float | None:
  """The median of `ordered` (sorted) with one occurrence of `value` left out (none if it is
  None); None if nothing is left."""
  skip = len(ordered) if value is None else bisect.bisect_left(ordered, value)
  n = len(ordered) - (value is not None)
  if n <= 0:
    return None

  def at(k: int) -> float:
    return ordered[k if k < skip else k + 1]

  return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class Step(Protocol):
  """What the watch reads of a committed step (`hooks.StepInfo`, which runs this hook)."""

  step: int
  compiles: int
  result: Any


class StragglerWatch:
  """The rule of the module docstring over a run's measured steps: `observe` takes each
  measured step's ratios, `speeds` says what should be in force.

  Args:
    threshold: `resilience.straggler_threshold`.
    steps: `resilience.straggler_steps`.
  """

  def __init__(self, threshold: float, steps: int):
    self.threshold = threshold
    self.recover = 1 + (threshold - 1) / 2
    self.steps = steps
    self.windows: dict[Worker, collections.deque[float]] = {}

  def observe(self, ratios: Mapping[Worker, float]) -> None:
    for w, r in ratios.items():
      self.windows.setdefault(w, collections.deque(maxlen=self.steps)).append(r)

  def speeds(self, in_force: Mapping[Worker, float]) -> dict[Worker, float]:
    """The speeds to put in force, given those in force now (the same dict when nothing
    changes). A new straggler's speed is the inverse of its window's median ratio, in
    hundredths; one in force stays until it recovers."""
    out = dict(in_force)
    for w, window in self.windows.items():
      if len(window) < self.steps:
        continue
      measured = max(0.05, min(1.0, round(1 / statistics.median(window), 2)))
      if w not in in_force:
        if min(window) > self.threshold:
          out[w] = measured
      elif statistics.median(window) < self.recover:
        del out[w]
    for w in {w for w in set(out) | set(in_force) if out.get(w) != in_force.get(w)}:
      self.windows.pop(w, None)  # a changed worker is measured afresh
    return out


class Stragglers:
  """The run's detection hook and its re-weighting (see the module docstring): after a
  measured step every process publishes its own workers' op times, process 0 decides the
  speeds to put in force, and when they change every process has its coordinator re-plan for
  the next step and its interpreter take the plan.

  Args:
    cfg: the run's configuration.
    run: the run.
  """

  def __init__(self, cfg: RunConfig, run: Run):
    self.run = run
    res = cfg.resilience
    self.every = res.straggler_every
    self.watch = StragglerWatch(res.straggler_threshold, res.straggler_steps)
    """Process 0's (the others follow its decisions)."""
    self.measured_plan: object = None
    """The plan of the step before (a step on a new plan is not measured)."""

  def __call__(self, info: Step) -> dict | None:
    """The hook after every committed step: measures it when it ran profiled for that. Every
    process of a job takes part in the same steps (the step and the plan's kind are agreed);
    whether a step counts is process 0's to say (`_decide`)."""
    run = self.run
    coord = run.coordinator
    first, self.measured_plan = self.measured_plan is not coord.plan, coord.plan
    if info.step == 1:
      first = False  # the run's first plan: its first step compiles, and is skipped for that
    if not self.every or info.step % self.every or not isinstance(coord.plan, GridPlan):
      return None
    mine = {"built": bool(info.compiles), "times": _summary(op_times(info.result.records))}
    sp = run.interpreter.step_program
    processes = sorted({p for p in (run.group.process_of(prog.node)
                                    for prog in sp.slots.values()) if p is not None}) or [0]
    # Under the attempt too: a step run again after a restore must not read the first run's.
    key = f"step/{info.step}/stragglers/{run.attempts}"
    gathered = run.group.gather(key, mine, processes)
    row: dict = {}  # process 0's (it writes the row)
    wanted = run.group.agree(f"{key}/speeds", lambda: self._decide(gathered, first, row))
    if wanted is not None:
      self._reweigh(dict(coord.grid.speeds), {(d, s): v for d, s, v in wanted}, info.step + 1)
    return row

  def _decide(self, gathered: Mapping[int, Any], first: bool, row: dict) -> list | None:
    """Process 0's decision from every process's published times: the speeds to put in force
    as `[[dp, stage, speed], ...]`, or None when they stay. Not measured: the first step of a
    new plan, and a step in which any process compiled."""
    if first or any(got["built"] for got in gathered.values()):
      return None
    times = {tuple(map(int, w.split("."))): {k: (f, r) for k, (f, r) in kinds.items()}
             for got in gathered.values() for w, kinds in got["times"].items()}
    ratios = peer_ratios(times)
    self.watch.observe(ratios)
    row["straggler_ratios"] = {f"{d}.{s}": round(r, 3) for (d, s), r in sorted(
      ratios.items()) if r > self.watch.recover}
    in_force = dict(self.run.coordinator.grid.speeds)
    wanted = self.watch.speeds(in_force)
    return None if wanted == in_force else [[d, s, v] for (d, s), v in sorted(wanted.items())]

  def _reweigh(self, before: dict[Worker, float], speeds: dict[Worker, float], step: int
               ) -> None:
    """Puts `speeds` in force (`before`: those in force) for `step`: log lines, the plan, the
    events."""
    run = self.run
    coord = run.coordinator
    changed = sorted(w for w in set(speeds) | set(before) if speeds.get(w) != before.get(w))
    for d, s in changed:
      v = speeds.get((d, s))
      if v is None:
        run.log(f"STRAGGLER RECOVERED: worker (dp={d}, stage={s}) runs at its stage peers' "
                f"pace again; it gets its share back from step {step}")
      else:
        was = f" (was {before[(d, s)]:.2f})" if (d, s) in before else ""
        run.log(f"STRAGGLER: worker (dp={d}, stage={s}) runs at {v:.2f} of its stage peers' "
                f"speed{was}, measured over {self.watch.steps} steps; re-weighting its share "
                f"from step {step}")
    run.events.emit(Speeds(step, tuple((d, s, v) for (d, s), v in sorted(speeds.items())),
                           tuple(w for w in changed if w not in speeds)), line=False)
    decision = coord.reweigh(speeds, step, key=run.plan_key(step))
    # A process relaunched into a job replays it with the failures (`admission.replay`).
    run.membership.append({"kind": "speeds", "step": step,
                           "speeds": [[d, s, v] for (d, s), v in sorted(speeds.items())]})
    dead = coord.down_nodes
    run.interpreter.place(decision.plan, run.interpreter.sources(dead), dead=dead,
                          tag=(step, run.attempts))
    node_of = decision.plan.nodes if isinstance(decision.plan, GridPlan) else {}
    for w in changed:
      event = run.goodput.add("straggler" if w in speeds else "straggler_recovered", step,
                              [node_of[w]] if w in node_of else [], worker=list(w),
                              speed=speeds.get(w, 1.0), plan=coord.plan_name)
      keeps = _keeps(decision.plan, w)
      if keeps is not None:
        event.extra["microbatches"] = keeps


def _summary(times: Mapping[Worker, KindTimes]) -> dict[str, dict[str, list]]:
  """`op_times` as a key-value value, `{"dp.stage": {kind: [first, rest]}}`, in 4 significant
  digits (a ratio needs no more): 35-70 bytes a worker (one or two backward kinds)."""
  return {f"{d}.{s}": {k: [float(f"{f:.4g}"), None if r is None else float(f"{r:.4g}")]
                       for k, (f, r) in kinds.items()} for (d, s), kinds in sorted(times.items())}


def _keeps(plan: object, worker: Worker) -> int | None:
  """Micro-batches `worker` runs its stage of under `plan` (a grid plan's), else None."""
  if not isinstance(plan, GridPlan):
    return None
  return len(plan.schedule.microbatches_of(worker))


def stragglers(cfg: RunConfig, run: Run, timelines: RunTimelines) -> Stragglers | None:
  """The run's detection hook, or None when `resilience.straggler_every` is 0; the steps it
  measures run profiled (`timelines.measure_every`)."""
  if not cfg.resilience.straggler_every:
    return None
  hook = Stragglers(cfg, run)
  timelines.measure_every = hook.every
  return hook
