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

from resilient_jax.policy.base import Grid, Policy, Transition
from resilient_jax.policy.registry import build_policies
from resilient_jax.policy.rejoin import rejoin_choice
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.routing import relative_throughput_bound
from resilient_jax.sim.cost_model import CostModel, load_profile
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
    segments: `(start, end, samples/s, counted)` training intervals.
  """

  name: str
  samples: float = 0.0
  fault_free_throughput: float = 0.0
  paused_s: float = 0.0
  lost_s: float = 0.0
  stopped_s: float = 0.0
  segments: list[list] = dataclasses.field(default_factory=list)

  def binned(self, duration_s: float, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """`(bin start times, mean counted samples/s per bin)`."""
    n = max(1, math.ceil(duration_s / bin_s))
    edges = np.arange(n + 1) * bin_s
    edges[-1] = duration_s
    acc = np.zeros(n)
    for t0, t1, rate, counted in self.segments:
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
  """

  trace: Trace
  states: list[tuple[float, frozenset[Worker]]]
  policies: dict[str, PolicyTrace]


def failure_states(layout: Layout, trace: Trace) -> list[tuple[float, frozenset[Worker]]]:
  """The failed-worker set after each event that changes it, from `(0, {})`."""
  tracker = FailureTracker(layout)
  states = [(0.0, frozenset())]
  for event in trace.events:
    failed = tracker.apply(event)
    if failed != states[-1][1]:
      states.append((event.time_s, failed))
  return states


def _run_policy(
  policy: Policy,
  grid: Grid,
  costs: CostModel,
  states: list[tuple[float, frozenset[Worker]]],
  duration_s: float,
  samples_per_step: int,
  checkpoint_interval_s: float,
) -> PolicyTrace:
  out = PolicyTrace(policy.name)
  horizon_s = duration_s / max(len(states) - 1, 1)
  reset = getattr(policy, "reset", None)
  if reset is not None:  # a policy that chooses by what it expects until the next event
    reset(horizon_s)
  step = policy.step_time(grid, frozenset(), costs)
  out.fault_free_throughput = samples_per_step / step
  failed = frozenset()  # what the policy runs without: the trace's failed set and idle workers
  down = frozenset()  # the trace's failed set
  resume = 0.0  # training (re)starts here after a pause
  ckpt_base = 0.0  # the state at this time is safe; checkpoints follow every interval

  def train(t0: float, t1: float, step_time: float) -> None:
    if t1 <= t0:
      return
    if not math.isfinite(step_time):
      out.stopped_s += t1 - t0
      out.segments.append([t0, t1, 0.0, True])
      return
    out.segments.append([t0, t1, samples_per_step / step_time, True])

  def roll_back(to: float) -> None:
    kept = []
    for seg in out.segments:
      t0, t1, rate, counted = seg
      if counted and rate > 0 and t1 > to:
        if t0 < to:
          kept.append([t0, to, rate, True])
          t0 = to
        out.lost_s += t1 - t0
        kept.append([t0, t1, rate, False])
      else:
        kept.append(seg)
    out.segments = kept

  prev = 0.0
  for t, after in [*states[1:], (duration_s, None)]:
    t = min(t, duration_s)
    train(max(resume, prev), t, step)
    prev = t
    if after is None:
      break
    if after < down:
      # A rejoin: the runtime coordinator's rule (`policy/rejoin.py`) on every worker back
      # (those idle since an earlier declined rejoin too); declined, they stay idle and the
      # policy goes on without them until the next event.
      choice = rejoin_choice(policy, Transition(grid, failed, after, costs, step), horizon_s)
      rec, down = choice.recovery, after
      if not choice.take:
        continue
    else:
      rec = policy.recovery(Transition(grid, failed, after, costs, step))
      down = after
    if rec.rollback:
      since = max(t - ckpt_base, 0.0)
      roll_back(ckpt_base + math.floor(since / checkpoint_interval_s) * checkpoint_interval_s)
    end_pause = max(resume, t + rec.pause_s)
    out.paused_s += max(0.0, min(end_pause, duration_s) - max(resume, t))
    resume = end_pause
    if rec.restart or rec.rollback:
      ckpt_base = resume  # the restored (or just saved) state is the new checkpoint
    failed = after
    step = policy.step_time(grid, failed, costs)
  out.samples = sum(r * (t1 - t0) for t0, t1, r, counted in out.segments if counted)
  return out


def run_trace(
  layout: Layout,
  costs: CostModel,
  policies: Mapping[str, Policy],
  trace: Trace,
  *,
  checkpoint_interval_s: float,
) -> TraceResult:
  """Runs every policy through `trace`.

  Args:
    layout: the job and its placement (maps failed devices to workers).
    costs: the cost model.
    policies: the policies.
    trace: the events.
    checkpoint_interval_s: wall time between checkpoints, for rollbacks.

  Returns:
    The result, with each policy's training segments.
  """
  if (trace.nodes, trace.devices_per_node) != (layout.nodes, layout.devices_per_node):
    raise ValueError(
      f"trace is for {trace.nodes} nodes of {trace.devices_per_node} devices, the layout has "
      f"{layout.nodes} of {layout.devices_per_node}"
    )
  grid = Grid(layout.dp, layout.pp, layout.microbatches, layout.schedule, layout.memory_cap)
  states = failure_states(layout, trace)
  runs = {
    name: _run_policy(
      p, grid, costs, states, trace.duration_s, layout.global_batch, checkpoint_interval_s
    )
    for name, p in policies.items()
  }
  return TraceResult(trace, states, runs)


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
