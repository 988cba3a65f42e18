"""Goodput: the effective training time ratio (ETTR) of a policy through a trace, and its losses.

ETTR is what operators of large jobs compare (Llama 3: "higher than 90%", ByteRobust: 97%):
the share of wall time that ends up as committed training. Here committed time is the kept
samples at the fastest fault-free step any simulated policy runs (`ideal_step_s`: the base
schedule's, as restart and re-routing run it, or Oobleck's templates' where those are faster),
so every policy is on one scale and a policy's own steady-state overhead (Bamboo's redundant
forwards) shows as slowed steps, not as a different baseline. Wall time
splits exactly into the committed time and the losses (`Breakdown.wall_s` is their sum):

* detection: from a failure to the job knowing (`RecoveryParams.detect_s`);
* replanning: replanning and new groups in place (`regroup_s`) and the state a policy copies;
* restarts: a restore's or a planned restart's start-up (`restart_s`);
* re-run work: training rolled back to the last checkpoint, and the step in flight;
* slowed steps: training at a step time above the ideal one (failed workers' load carried by
  others, fewer pipelines, redundant work);
* stragglers: the extra step time of a slow device: recycle and naive re-plan for the speeds
  (a slow worker keeps the share it can finish: their step time with the speeds over without,
  `engine._Replay.slow_factor`); every other policy runs its plan at the slowest device's pace
  (`Slowdown`);
* checkpoint stalls: the time saves block training (the blocking part of a save per interval,
  each policy's interval: `engine.restore_intervals`);
* waiting: no grid can be formed until a repair.

A recovery's pause is split by the rule `policy/base.py`'s `InPlacePolicy.recovery` and
`restart.py` price it with (`pause_parts`); the parts are clipped to the pause, so they always
sum to it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from resilient_jax.policy.base import (
  Grid,
  InPlacePolicy,
  PlanCosts,
  Policy,
  Recovery,
  Transition,
)
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.cost import OpCosts, simulate
from resilient_jax.schedule.generators import generate

__all__ = [
  "LOSSES",
  "Breakdown",
  "Recoveries",
  "Slowdown",
  "format_goodput",
  "goodput_json",
  "pause_parts",
  "young_daly_interval",
]

LOSSES = (
  "detection",
  "replanning",
  "restarts",
  "rerun",
  "slowed",
  "stragglers",
  "checkpoint",
  "waiting",
)
"""The loss categories of a `Breakdown`, in the order tables print them."""


def young_daly_interval(mtbf_s: float, write_s: float) -> float:
  """The checkpoint interval that minimises expected loss, `sqrt(2 * MTBF * C)` (Young 1974;
  Daly 2006's first-order optimum): saving more often stalls more, less often loses more work
  per restore. Growth law: the square root of both the time between failures and the write.

  Args:
    mtbf_s: the job's mean time between failures that force a restore.
    write_s: the time one save blocks training.

  Returns:
    Seconds between saves (`inf` when failures never come or saves are free).
  """
  if mtbf_s <= 0 or write_s < 0:
    raise ValueError(f"young_daly_interval needs mtbf_s > 0 and write_s >= 0, got "
                     f"{mtbf_s!r}, {write_s!r}")
  if write_s == 0 or math.isinf(mtbf_s):
    return math.inf
  return math.sqrt(2 * mtbf_s * write_s)


def pause_parts(rec: Recovery, t: Transition, detect_s: float) -> dict[str, float]:
  """`rec.pause_s` split into detection, replanning, restarts and re-run work (the step in
  flight), by the rule the policies price it with: a restore is detection then a restart, a
  planned restart only the restart, a move in place detection, the step in flight, then
  replanning and copies; a rejoin in place is replanning alone."""
  parts = dict.fromkeys(("detection", "replanning", "restarts", "rerun"), 0.0)
  left = rec.pause_s
  if t.failure:
    parts["detection"] = min(detect_s, left)
    left -= parts["detection"]
  if rec.rollback or rec.restart:
    parts["restarts"] = left
    return parts
  if t.failure:
    parts["rerun"] = min(t.in_flight_lost(), left)
    left -= parts["rerun"]
  parts["replanning"] = left
  return parts


class Slowdown:
  """The step time's factor when devices run slow, from the cost model.

  Synchronous training runs at its slowest worker's pace: a worker of stage `s` at speed `v`
  stretches its pipeline's step (its F, B and W take `1/v` as long), and every other pipeline
  waits for it at the gradient all-reduce. The factor is that one pipeline's fault-free
  makespan with the slow stage against without, the largest over the slow workers; it
  multiplies whatever step time a policy that does not re-plan for speeds runs (the re-routing
  policies do: `engine._Replay.slow_factor`).
  """

  def __init__(self, grid: Grid, costs: PlanCosts):
    self.grid = grid
    self.costs = costs
    self._cache: dict[Hashable, float] = {}
    self._base: float | None = None

  @property
  def ideal_step(self) -> float:
    """The plain fault-free step time: one pipeline of the base schedule with every device at
    full speed (restart's, and every re-routing policy's, before a failure)."""
    if self._base is None:
      self._base = self._makespan(0, 1.0)
    return self._base

  def _makespan(self, stage: int, speed: float) -> float:
    g = self.grid
    op = self.costs.op_costs((g.dp,) * g.pp)
    if speed < 1:
      scale = [1 / speed if s == stage else 1.0 for s in range(g.pp)]
      op = OpCosts(
        f=tuple(op.f_at(s) * scale[s] for s in range(g.pp)),
        b=tuple(op.b_at(s) * scale[s] for s in range(g.pp)),
        w=tuple(op.w_at(s) * scale[s] for s in range(g.pp)),
        bw=None if op.bw is None else tuple(op.bw_at(s) * scale[s] for s in range(g.pp)),
        ar=op.ar, opt=op.opt, comm=op.comm,
      )
    return simulate(generate(g.base, 1, g.pp, g.m), op).makespan

  def factor(self, slow: Iterable[tuple[Worker, float]], down: frozenset[Worker]) -> float:
    """The step time's factor with `slow` workers (and their speeds) running; those `down`
    do not count."""
    worst = 1.0
    for worker, speed in slow:
      if worker in down or speed >= 1:
        continue
      key = (worker[1], speed)
      if key not in self._cache:
        self._cache[key] = self._makespan(worker[1], speed) / self.ideal_step
      worst = max(worst, self._cache[key])
    return worst


@dataclasses.dataclass
class Recoveries:
  """How a policy's recoveries from failures went.

  Attributes:
    failures: failures it recovered from.
    in_place: recoveries that went on without a restore.
    restores: recoveries that restored the last checkpoint (restart's only kind).
    fallbacks: restores a policy that goes on in place needed because it could not (every
      worker of a stage lost, Bamboo's two neighbours): the recovery itself failed.
    interrupted: failures that struck while the job was still recovering from an earlier one.
  """

  failures: int = 0
  in_place: int = 0
  restores: int = 0
  fallbacks: int = 0
  interrupted: int = 0

  def count(self, policy: Policy, t: Transition, rec: Recovery, *, recovering: bool) -> None:
    """Counts the recovery `rec` from the failure `t` (rejoins are not counted)."""
    if not t.failure:
      return
    self.failures += 1
    self.interrupted += recovering
    if not rec.rollback:
      self.in_place += 1
      return
    self.restores += 1
    self.fallbacks += _fell_back(policy, t)

  @property
  def success_rate(self) -> float | None:
    """Recoveries that did what the policy meant to do (None: restart, which always restores,
    or no failure)."""
    if self.in_place + self.fallbacks == 0:
      return None
    return 1 - self.fallbacks / self.failures


def _fell_back(policy: Policy, t: Transition) -> bool:
  """Whether a restore was forced: not restart's own way, nor `auto` choosing restart while
  one of its in-place candidates could have gone on."""
  chosen = policy.current or policy
  if chosen.name != "restart":
    return True
  if not policy.chooses:
    return False
  in_place = [c for c in policy.usable(t.grid, t.costs) if isinstance(c, InPlacePolicy)]
  return all(c.cannot_run(t.grid, t.after, t.costs) for c in in_place)


@dataclasses.dataclass
class Breakdown:
  """Where one policy's wall time went (seconds; see the module docstring).

  Attributes:
    committed: training time that counts, at the ideal step time.
    losses: seconds per category of `LOSSES`.
  """

  committed: float = 0.0
  losses: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))

  @property
  def wall_s(self) -> float:
    return self.committed + sum(self.losses.values())

  @property
  def ettr(self) -> float:
    return self.committed / self.wall_s if self.wall_s else 0.0

  def add_training(self, seconds: float, counted: bool, ideal_step: float, policy_step: float,
                   factor: float, stall: float) -> None:
    """`seconds` of training at the policy's `policy_step` times the stragglers' `factor`,
    a fraction `stall` of it blocked by checkpoint saves; not `counted`: rolled back."""
    if seconds <= 0:
      return
    if not counted:
      self.losses["rerun"] += seconds
      return
    if not math.isfinite(policy_step):
      self.losses["waiting"] += seconds
      return
    self.losses["checkpoint"] += seconds * stall
    running = seconds * (1 - stall)
    step = policy_step * factor
    self.committed += running * ideal_step / step
    self.losses["slowed"] += running * (policy_step - ideal_step) / step
    self.losses["stragglers"] += running * (step - policy_step) / step

  def add_pause(self, parts: Mapping[str, float], counted_s: float) -> None:
    """A recovery's pause `parts`, of which `counted_s` seconds were not already paused."""
    total = sum(parts.values())
    if total <= 0 or counted_s <= 0:
      return
    for name, v in parts.items():
      self.losses[name] += v * counted_s / total

  def to_json(self, recoveries: Recoveries) -> dict[str, Any]:
    wall = self.wall_s
    return {
      "ettr": self.ettr,
      "committed_s": self.committed,
      "wall_s": wall,
      "losses_s": dict(self.losses),
      "losses_share": {k: v / wall if wall else 0.0 for k, v in self.losses.items()},
      "recoveries": dataclasses.asdict(recoveries),
      "recovery_success_rate": recoveries.success_rate,
    }


_SHORT = {"detection": "detect", "replanning": "replan", "restarts": "restart", "rerun": "rerun",
          "slowed": "slowed", "stragglers": "stragg", "checkpoint": "ckpt", "waiting": "wait"}


def goodput_json(result: Any) -> dict[str, Any]:
  """results.json's `goodput`: per policy its ETTR, losses and recoveries (an
  `engine.TraceResult` in), what it was measured against, and re-routing against restart."""
  intervals = getattr(result, "intervals", None) or {}
  policies = {
    name: {**run.breakdown.to_json(run.recoveries),
           "checkpoint_interval_s": intervals.get(name, result.checkpoint_interval_s)}
    for name, run in result.policies.items()
  }
  out: dict[str, Any] = {
    "ideal_step_s": result.ideal_step_s,
    "checkpoint_interval_s": result.checkpoint_interval_s,
    "checkpoint_write_s": result.checkpoint_write_s,
    "failures_by_cause": result.trace.causes(),
    "slowdowns": result.trace.slowdowns,
    "policies": policies,
  }
  singles = {n: g["ettr"] for n, g in policies.items() if n != "auto"}
  if singles:
    best = max(singles, key=singles.get)
    out["best_single"] = {"policy": best, "ettr": singles[best]}
  if "restart" in policies:
    out["over_restart"] = {
      n: {"points": g["ettr"] - policies["restart"]["ettr"],
          "ratio": g["ettr"] / policies["restart"]["ettr"] if policies["restart"]["ettr"] else None}
      for n, g in policies.items() if n != "restart"
    }
  return out


def format_goodput(results: Mapping[str, Any]) -> list[str]:
  """The printed ETTR table: per policy its ETTR, its losses in % of wall time and its
  recoveries, then `auto` against the best single policy and re-routing against restart."""
  g = results["goodput"]
  lines = [
    f"ETTR (committed training / wall time, at the fault-free step {g['ideal_step_s']:.3f} s; "
    f"a checkpoint blocks {g['checkpoint_write_s']:.3g} s, every `ckpt s`); losses in % of wall "
    "time:",
    f"{'policy':>8} {'ETTR':>6} " + " ".join(f"{_SHORT[k]:>7}" for k in LOSSES)
    + f" {'failures':>8} {'in place':>8} {'restores':>8} {'fallback':>8} {'in recov':>8}"
    + f" {'ckpt s':>7}",
  ]
  for name, p in g["policies"].items():
    r = p["recoveries"]
    interval = p.get("checkpoint_interval_s", g["checkpoint_interval_s"])
    every = f"{interval:7.0f}" if interval is not None and math.isfinite(interval) else "  never"
    lines.append(
      f"{name:>8} {p['ettr']:6.4f} "
      + " ".join(f"{100 * p['losses_share'][k]:7.2f}" for k in LOSSES)
      + f" {r['failures']:8d} {r['in_place']:8d} {r['restores']:8d} {r['fallbacks']:8d}"
      + f" {r['interrupted']:8d} {every}"
    )
  best = g.get("best_single")
  if best and "auto" in g["policies"]:
    auto = g["policies"]["auto"]["ettr"]
    lines.append(f"auto {auto:.3f} against the best single policy, {best['policy']} "
                 f"{best['ettr']:.3f} ({auto - best['ettr']:+.4f})")
  over = g.get("over_restart", {})
  for name in ("recycle", "auto"):
    if name in over and over[name]["ratio"]:
      lines.append(f"{name} over restart: {100 * over[name]['points']:+.2f} points of wall "
                   f"time, x{over[name]['ratio']:.3f} the committed training")
  return lines
