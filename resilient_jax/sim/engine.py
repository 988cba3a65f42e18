"""The discrete-event engine: policies over failure sweeps and failure traces.

Between two events of a trace the cluster is in one failure state, and a policy trains at one
rate: `global_batch / step_time(state)` samples per second, the step time coming from the
library's planners and cost model (`policies.py`). At an event the policy pays its recovery: a
pause and, for checkpoint-based recovery, the loss of everything since the last checkpoint. So
the engine steps from event to event, not from op to op; what happens inside a step is the cost
model's replay of the real schedule. That is what makes a day on 16384 devices take seconds.

A rejoin goes through `policy/rejoin.py`'s `rejoin_choice`, the rule the runtime's coordinator
applies: taken back in place, or with a planned restart only when that pays back before the
next event; a declined rejoin leaves the workers idle (the policy's failed set keeps them)
until a later event.

Public entry points:

* `sweep`: relative throughput against the number of concurrent failures, per policy, with
  ReCycle's analytic bound.
* `run_trace`: throughput over time through a trace, per policy.
* `predict_relative_throughput`: from a measured per-stage profile and a failed set, the
  predicted throughput relative to fault-free (for comparing with a recorded executor run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax.policy.base import Grid, Policy, Recovery, Transition, plans_speeds
from resilient_jax.policy.registry import build_policies
from resilient_jax.policy.rejoin import rejoin_choice
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.routing import relative_throughput_bound
from resilient_jax.sim.cost_model import CostModel, load_profile
from resilient_jax.sim.goodput import (
  Breakdown,
  Recoveries,
  Slowdown,
  pause_parts,
  young_daly_interval,
)
from resilient_jax.sim.layout import Layout
from resilient_jax.sim.traces import FailureTracker, Trace

__all__ = [
  "PolicyTrace",
  "Row",
  "TraceResult",
  "bound_for",
  "failure_states",
  "predict_relative_throughput",
  "run_trace",
  "sweep",
  "sweep_failed_set",
]

SWEEP_PLACEMENTS = ("stage", "random", "hosts")


@dataclasses.dataclass(frozen=True)
class Row:
  """One policy at one number of concurrent failures.

  Attributes:
    policy: the policy.
    failures: failed workers.
    throughput: samples/s in that state's steady state.
    fault_free_throughput: samples/s of the same policy with no failure.
    bound: ReCycle's analytic ceiling on relative throughput,
      `min(1, (m+p-1)(D-k)/(m*D))` with k the failed workers of the most damaged stage.
    step_time_s: seconds per step.
  """

  policy: str
  failures: int
  throughput: float
  fault_free_throughput: float
  bound: float
  step_time_s: float

  @property
  def relative(self) -> float:
    return self.throughput / self.fault_free_throughput if self.fault_free_throughput else 0.0

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["relative"] = self.relative
    return out


def bound_for(grid: Grid, failed: Iterable[Worker]) -> float:
  """ReCycle's bound for the most damaged stage (0 once a stage has no live worker)."""
  live = grid.live_per_stage(failed)
  k = grid.dp - min(live)
  return relative_throughput_bound(grid.dp, grid.pp, grid.m, k) if k < grid.dp else 0.0


def sweep_failed_set(
  grid: Grid, failures: int, placement: str = "stage", *, stage: int = 0, seed: int = 0,
  layout: Layout | None = None,
) -> frozenset[Worker]:
  """The failed workers of a sweep point.

  Args:
    grid: the grid.
    failures: how many workers fail; for "hosts", how many hosts (nodes).
    placement: "stage": all in `stage`, spread evenly over the pipelines (the case ReCycle's
      bound describes); "random": uniformly random workers (seeded); "hosts": every worker
      with a device on `failures` uniformly random hosts (seeded), as `layout` places them.
    stage: the stage for "stage".
    seed: the seed for "random" and "hosts".
    layout: the placement, for "hosts".

  Returns:
    The failed set.
  """
  if placement == "hosts":
    if layout is None:
      raise ValueError("sweep placement 'hosts' needs the layout")
    if failures > layout.nodes:
      raise ValueError(f"{failures} host failures but only {layout.nodes} hosts")
    rng = np.random.default_rng(seed)
    hosts = rng.choice(layout.nodes, size=failures, replace=False)
    per = layout.devices_per_node
    return frozenset(layout.worker_of_device(int(h) * per + i) for h in hosts for i in range(per))
  if placement == "stage":
    if failures >= grid.dp:
      raise ValueError(f"{failures} failures in one stage leave none of its {grid.dp} workers")
    return (
      frozenset((i * grid.dp // failures, stage) for i in range(failures))
      if failures
      else frozenset()
    )
  if placement == "random":
    if failures > grid.workers:
      raise ValueError(f"{failures} failures but only {grid.workers} workers")
    rng = np.random.default_rng(seed)
    picks = rng.choice(grid.workers, size=failures, replace=False)
    return frozenset((int(r) // grid.pp, int(r) % grid.pp) for r in picks)
  raise ValueError(f"sweep placement {placement!r} is not one of {SWEEP_PLACEMENTS}")


def sweep(
  grid: Grid,
  costs: CostModel,
  policies: Mapping[str, Policy],
  failures: Sequence[int],
  *,
  samples_per_step: int,
  placement: str = "stage",
  stage: int = 0,
  seed: int = 0,
  layout: Layout | None = None,
) -> list[Row]:
  """Steady-state throughput of every policy at every failure count.

  Args:
    grid: the grid.
    costs: the cost model.
    policies: the policies to evaluate.
    failures: failure counts, e.g. (0, 1, 2, 4).
    samples_per_step: the global batch in samples.
    placement: where the failures fall (see `sweep_failed_set`).
    stage: the stage for placement "stage".
    seed: the seed for placement "random" and "hosts".
    layout: the job's placement on hosts, for placement "hosts".

  Returns:
    One row per (policy, failure count), policies in the given order.
  """
  rows = []
  for name, policy in policies.items():
    fault_free = samples_per_step / policy.step_time(grid, frozenset(), costs)
    for k in failures:
      failed = sweep_failed_set(grid, k, placement, stage=stage, seed=seed + k, layout=layout)
      t = policy.step_time(grid, failed, costs)
      rows.append(
        Row(
          policy=name,
          failures=k,
          throughput=samples_per_step / t if math.isfinite(t) else 0.0,
          fault_free_throughput=fault_free,
          bound=bound_for(grid, failed),
          step_time_s=t,
        )
      )
  return rows


@dataclasses.dataclass
class PolicyTrace:
  """One policy's run through a trace.

  Attributes:
    name: the policy.
    samples: samples trained that count (work lost to rollbacks excluded).
    fault_free_throughput: samples/s with no failure.
    paused_s: seconds spent in recovery pauses.
    lost_s: seconds of training lost to rollbacks.
    stopped_s: seconds with no runnable grid (waiting for repairs).
    segments: `[start, end, samples/s, counted, policy step time, stragglers' factor]` training
      intervals (samples/s net of checkpoint stalls and stragglers).
    breakdown: where the wall time went (`goodput.Breakdown`: ETTR and its losses).
    recoveries: how its recoveries from failures went.
  """

  name: str
  samples: float = 0.0
  fault_free_throughput: float = 0.0
  paused_s: float = 0.0
  lost_s: float = 0.0
  stopped_s: float = 0.0
  segments: list[list] = dataclasses.field(default_factory=list)
  breakdown: Breakdown = dataclasses.field(default_factory=Breakdown)
  recoveries: Recoveries = dataclasses.field(default_factory=Recoveries)

  def binned(self, duration_s: float, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """`(bin start times, mean counted samples/s per bin)`."""
    n = max(1, math.ceil(duration_s / bin_s))
    edges = np.arange(n + 1) * bin_s
    edges[-1] = duration_s
    acc = np.zeros(n)
    for t0, t1, rate, counted, *_ in self.segments:
      if not counted or rate == 0 or t1 <= t0:
        continue
      i0, i1 = int(t0 // bin_s), min(n - 1, int(math.ceil(t1 / bin_s)) - 1)
      for i in range(i0, i1 + 1):
        overlap = min(t1, edges[i + 1]) - max(t0, edges[i])
        if overlap > 0:
          acc[i] += rate * overlap
    return edges[:-1], acc / np.diff(edges)


@dataclasses.dataclass
class TraceResult:
  """Every policy's run through one trace.

  Attributes:
    trace: the trace.
    states: `(time, failed workers)` after each event that changed the failed set, starting
      with `(0, {})`.
    policies: per policy, its run.
    ideal_step_s: the fault-free step time every policy's ETTR is measured against: the
      fastest any of the policies runs.
    checkpoint_interval_s: wall time between checkpoints (the first policy's where they differ).
    checkpoint_write_s: the time one save blocks training.
    intervals: per policy, its wall time between checkpoints.
  """

  trace: Trace
  states: list[tuple[float, frozenset[Worker]]]
  policies: dict[str, PolicyTrace]
  ideal_step_s: float = 0.0
  checkpoint_interval_s: float = math.inf
  checkpoint_write_s: float = 0.0
  intervals: dict[str, float] = dataclasses.field(default_factory=dict)


def failure_states(layout: Layout, trace: Trace) -> list[tuple[float, frozenset[Worker]]]:
  """The failed-worker set after each time whose events change it, from `(0, {})` (the nodes
  of one switch failing at one instant are one state change)."""
  return [(t, failed) for t, failed, _ in _timeline(layout, trace, slow=False)]


def _timeline(
  layout: Layout, trace: Trace, *, slow: bool = True
) -> list[tuple[float, frozenset[Worker], frozenset[tuple[Worker, float]]]]:
  """`(time, failed workers, slow workers and their speeds)` after each time whose events
  change either (only the failed set when not `slow`), from `(0, {}, {})`."""
  tracker = FailureTracker(layout)
  states = [(0.0, frozenset(), frozenset())]
  events = trace.events
  for i, event in enumerate(events):
    tracker.apply(event)
    if i + 1 < len(events) and events[i + 1].time_s == event.time_s:
      continue  # one instant's events land together
    state = (event.time_s, tracker.failed, tracker.slow if slow else frozenset())
    if state[1:] != states[-1][1:]:
      states.append(state)
  return states


class _Replay:
  """One policy through a timeline: training between events, a recovery at each change of the
  failed set, the goodput accounting of both."""

  def __init__(self, policy: Policy, grid: Grid, costs: CostModel, duration_s: float,
               samples_per_step: int, interval_s: float, write_s: float, slowdown: Slowdown,
               ideal_step: float):
    self.policy, self.grid, self.costs = policy, grid, costs
    self.duration_s = duration_s
    self.batch = samples_per_step
    self.interval_s = interval_s
    # Saves block `write_s` out of every interval of wall time.
    self.stall = min(write_s / interval_s, 1.0) if math.isfinite(interval_s) and interval_s else 0.0
    self.slowdown = slowdown
    self.ideal_step = ideal_step
    self.params = policy.params
    self.out = PolicyTrace(policy.name)

  def train(self, t0: float, t1: float, step: float, factor: float) -> None:
    if t1 <= t0:
      return
    if not math.isfinite(step):
      self.out.stopped_s += t1 - t0
      self.out.segments.append([t0, t1, 0.0, True, step, factor])
      return
    rate = self.batch / (step * factor) * (1 - self.stall)
    self.out.segments.append([t0, t1, rate, True, step, factor])

  def roll_back(self, to: float) -> None:
    kept = []
    for seg in self.out.segments:
      t0, t1, rate, counted, step, factor = seg
      if counted and rate > 0 and t1 > to:
        if t0 < to:
          kept.append([t0, to, rate, True, step, factor])
          t0 = to
        self.out.lost_s += t1 - t0
        kept.append([t0, t1, rate, False, step, factor])
      else:
        kept.append(seg)
    self.out.segments = kept

  def recover(self, t: float, failed: frozenset[Worker], down: frozenset[Worker],
              after: frozenset[Worker], step: float, horizon_s: float
              ) -> tuple[Recovery, frozenset[Worker], bool]:
    """The recovery from the change of the trace's failed set from `down` to `after`: `(its
    cost, the failed set the policy runs without, whether it was taken)`."""
    move = Transition(self.grid, failed, after, self.costs, step)
    if after < down:
      # A rejoin: the runtime coordinator's rule (`policy/rejoin.py`) on every worker back
      # (those idle since an earlier declined rejoin too); declined, they stay idle and the
      # policy goes on without them until the next event.
      choice = rejoin_choice(self.policy, move, horizon_s)
      return choice.recovery, (after if choice.take else failed), choice.take
    return self.policy.recovery(move), after, True

  def slow_factor(self, slow: frozenset[tuple[Worker, float]], down: frozenset[Worker],
                  failed: frozenset[Worker], step: float) -> float:
    """The step time's factor from the `slow` workers (and their speeds) that are up: a policy
    that re-plans for speeds (recycle, naive: `policy.base.plans_speeds`) is asked for its step
    time on the grid with those speeds (the runtime's `RunCoordinator.reweigh` plans the same),
    over `step`, its step time without; any other runs at the slowest one's pace
    (`Slowdown`)."""
    speeds = {w: v for w, v in slow if w not in down and w not in failed and v < 1}
    grid = self.grid.with_speeds(speeds)
    if speeds and math.isfinite(step) and plans_speeds(self.policy, grid):
      return self.policy.step_time(grid, failed, self.costs) / step
    return self.slowdown.factor(slow, down)

  def run(self, timeline: list[tuple[float, frozenset[Worker], frozenset]]) -> PolicyTrace:
    out, grid, costs = self.out, self.grid, self.costs
    changes = sum(a[1] != b[1] for a, b in zip(timeline, timeline[1:], strict=False))
    horizon_s = self.duration_s / max(changes, 1)
    self.policy.reset(horizon_s)  # a chooser weighs what it expects until the next event
    step = self.policy.step_time(grid, frozenset(), costs)
    out.fault_free_throughput = self.batch / step
    failed = down = frozenset()  # what the policy runs without; the trace's failed set
    slow, factor = frozenset(), 1.0
    resume = ckpt_base = prev = 0.0  # training (re)starts at resume; a checkpoint at ckpt_base
    pauses = []
    for t, after, slow_after in [*timeline[1:], (self.duration_s, None, None)]:
      t = min(t, self.duration_s)
      self.train(max(resume, prev), t, step, factor)
      prev = t
      if after is None:
        break
      if slow_after != slow:
        slow = slow_after
      if after != down:
        rec, failed, taken = self.recover(t, failed, down, after, step, horizon_s)
        move = Transition(grid, down, after, costs, step)
        down = after
        if taken:
          out.recoveries.count(self.policy, move, rec, recovering=t < resume)
          if rec.rollback:
            since = max(t - ckpt_base, 0.0)
            self.roll_back(ckpt_base + math.floor(since / self.interval_s) * self.interval_s
                           if math.isfinite(self.interval_s) else ckpt_base)
          end_pause = max(resume, t + rec.pause_s)
          counted = max(0.0, min(end_pause, self.duration_s) - max(resume, t))
          out.paused_s += counted
          pauses.append((pause_parts(rec, move, self.params.detect_s if self.params else 0.0),
                         counted))
          resume = end_pause
          if rec.restart or rec.rollback:
            ckpt_base = resume  # the restored (or just saved) state is the new checkpoint
          step = self.policy.step_time(grid, failed, costs)
      factor = self.slow_factor(slow, down, failed, step)
    out.samples = sum(r * (t1 - t0) for t0, t1, r, counted, *_ in out.segments if counted)
    for t0, t1, _, counted, seg_step, seg_factor in out.segments:
      out.breakdown.add_training(t1 - t0, counted, self.ideal_step, seg_step, seg_factor,
                                 self.stall)
    for parts, counted in pauses:
      out.breakdown.add_pause(parts, counted)
    return out


def run_trace(
  layout: Layout,
  costs: CostModel,
  policies: Mapping[str, Policy],
  trace: Trace,
  *,
  checkpoint_interval_s: float | Mapping[str, float],
  checkpoint_write_s: float = 0.0,
) -> TraceResult:
  """Runs every policy through `trace`.

  Args:
    layout: the job and its placement (maps failed devices to workers).
    costs: the cost model.
    policies: the policies.
    trace: the events.
    checkpoint_interval_s: wall time between checkpoints, for rollbacks: one for every policy,
      or per policy (`restore_intervals`: Young/Daly for the restores each one needs).
    checkpoint_write_s: the time one save blocks training (checkpoint stalls).

  Returns:
    The result, with each policy's training segments and goodput breakdown.
  """
  if (trace.nodes, trace.devices_per_node) != (layout.nodes, layout.devices_per_node):
    raise ValueError(
      f"trace is for {trace.nodes} nodes of {trace.devices_per_node} devices, the layout has "
      f"{layout.nodes} of {layout.devices_per_node}"
    )
  grid = Grid(layout.dp, layout.pp, layout.microbatches, layout.schedule, layout.memory_cap)
  timeline = _timeline(layout, trace)
  slowdown = Slowdown(grid, costs)
  # Goodput is measured against the fastest fault-free step any of them runs (the base
  # schedule's, or Oobleck's templates' where they are faster), one scale for every policy.
  ideal = min([slowdown.ideal_step, *(p.step_time(grid, frozenset(), costs)
                                      for p in policies.values())])
  intervals = ({n: checkpoint_interval_s[n] for n in policies}
               if isinstance(checkpoint_interval_s, Mapping)
               else dict.fromkeys(policies, checkpoint_interval_s))
  runs = {
    name: _Replay(p, grid, costs, trace.duration_s, layout.global_batch, intervals[name],
                  checkpoint_write_s, slowdown, ideal).run(timeline)
    for name, p in policies.items()
  }
  states = [(0.0, frozenset())]
  states += [(t, f) for (t, f, _), (_, g, _) in zip(timeline[1:], timeline, strict=False) if f != g]
  first = next(iter(intervals.values()), math.inf)
  return TraceResult(trace, states, runs, ideal, first, checkpoint_write_s, intervals)


def restore_intervals(result: TraceResult, blocking_s: float, persist_s: float
                      ) -> dict[str, float]:
  """Per policy, the checkpoint interval for the restores it needs: Young/Daly,
  `sqrt(2 * blocking_s * MTBF)` with the MTBF of the failures that made that policy restore in
  `result` (a run through the same trace: restart restores at every failure, an in-place policy
  only where it fell back; at least one restore a trace is assumed, so a policy that never
  restored checkpoints as if it might once), and never more often than a save persists
  (`persist_s`: the background write to storage must end before the next save starts).

  Args:
    result: a run of the policies through the trace (any interval: whether a failure needs a
      restore does not depend on it, except for `auto`'s choice of restart, priced with it).
    blocking_s: the part of a save that blocks training (the device-to-host copy).
    persist_s: the time a save takes to reach storage, in the background.
  """
  out = {}
  for name, run in result.policies.items():
    mtbf = result.trace.duration_s / max(run.recoveries.restores, 1)
    out[name] = max(young_daly_interval(mtbf, blocking_s), persist_s)
  return out


def predict_relative_throughput(
  profile: CostModel | Mapping[str, Any] | str | Path,
  dp: int,
  pp: int,
  m: int,
  failed: Iterable[Worker],
  *,
  policy: str = "recycle",
  base: str = "zb-h1",
  memory_cap: int | None = None,
  reduce: bool | None = None,
) -> float:
  """Predicted throughput with `failed` workers down, relative to fault-free, from a profile.

  For comparing a recorded executor run with the simulator: give the per-stage op times the
  runtime measured (the `costs.py` profile format) and the failed set of the run.

  Args:
    profile: a `CostModel`, a parsed profile object, or the path of a profile JSON.
    dp: data-parallel pipelines.
    pp: pipeline stages.
    m: micro-batches per pipeline.
    failed: the failed workers.
    policy: a registered policy name ("recycle", "naive", "restart", "auto", ...).
    base: the fault-free base schedule.
    memory_cap: in-flight cap for the adaptive planner.
    reduce: plan on the reduced grid (True), the full grid (False) or decide by size (None).

  Returns:
    `fault-free step time / step time with failures` (0 when it cannot train).

  Raises:
    ValueError: for a malformed profile, shape or policy.
    PolicyUnavailableError: for a policy not available in this checkout.
  """
  if isinstance(profile, CostModel):
    costs = profile
  elif isinstance(profile, (str, Path)):
    costs = load_profile(profile, pp)
  else:
    costs = CostModel.from_profile(profile, pp)
  if costs.pp != pp:
    raise ValueError(f"the profile has {costs.pp} stages, pp={pp}")
  grid = Grid(dp, pp, m, base, memory_cap)
  pol = build_policies([policy])[policy]
  failed = frozenset(tuple(w) for w in failed)
  if reduce is not None and hasattr(pol, "planning_grid"):
    t0 = pol.step_time(grid, frozenset(), costs, reduce=reduce)
    t1 = pol.step_time(grid, failed, costs, reduce=reduce)
  else:
    t0 = pol.step_time(grid, frozenset(), costs)
    t1 = pol.step_time(grid, failed, costs)
  return t0 / t1 if math.isfinite(t1) else 0.0
