"""How long the simulator takes for a day on 16384 devices, against the 60 s target.

Run:
  python benchmarks/simulator.py                       # GPT-3 6.7B, 16384 A100s, 24 h trace
  python benchmarks/simulator.py --devices=4096 --hours=24 --config=configs/sim/gpt3_175b.py

Builds the config's cost model and a seeded Poisson trace, then runs every available policy
through the trace with fresh caches (so every failure state is planned), timed end to end. It
also plans one failure state both on the full grid and on the reduced grid, side by side, to
show what the reduction buys (the full grid only at sizes where that takes seconds, not hours).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402
from resilient_jax.sim import (  # noqa: E402
  Grid,
  build_costs,
  build_policies,
  build_trace,
  from_config_dict,
  run_trace,
  usable_policies,
)
from resilient_jax.sim.config import load_config_file  # noqa: E402

TARGET_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/sim/gpt3_6_7b.py")
  p.add_argument("--devices", type=int, default=16384)
  p.add_argument("--hours", type=float, default=24.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--compare_dp",
    type=int,
    default=256,
    help="pipelines of the full-vs-reduced planning comparison (0: skip it)",
  )
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  cd = load_config_file(f"{os.path.join(ROOT, args.config)}:{args.devices}")
  cd.trace.hours = args.hours
  cd.trace.seed = args.seed
  cfg = from_config_dict(cd)
  lay = cfg.layout
  costs = build_costs(cfg)
  trace = build_trace(cfg)
  print(
    f"{cfg.model.name}, {lay.devices} devices (dp {lay.dp} x pp {lay.pp} x tp {lay.tp}, "
    f"m={lay.microbatches}): {trace.duration_s / 3600:g} h trace with {trace.failures} "
    f"failures and {trace.rejoins} rejoins"
  )

  t0 = time.perf_counter()
  grid = Grid(lay.dp, lay.pp, lay.microbatches, lay.schedule, lay.memory_cap)
  built = build_policies(cfg.policies, params=cfg.recovery, exact_ops=cfg.exact_ops)
  policies, skipped = usable_policies(built, grid, costs)
  result = run_trace(
    lay, costs, policies, trace, checkpoint_interval_s=cfg.recovery.checkpoint_interval_s
  )
  wall = time.perf_counter() - t0
  plans = sum(getattr(p, "plans", 0) for p in policies.values())
  print(f"  {len(result.states) - 1} failure states, {plans} plans, policies {', '.join(policies)}")
  for name, run in result.policies.items():
    print(
      f"  {name:8s} {run.samples / trace.duration_s:10.1f} samples/s "
      f"({run.samples / trace.duration_s / run.fault_free_throughput:.3f} of fault-free)"
    )
  for name, why in skipped.items():
    print(f"  {name:8s} skipped: {why}")
  verdict = "PASS" if wall < TARGET_S else "FAIL"
  print(
    f"simulated {trace.duration_s / 3600:g} h of {lay.devices} devices in {wall:.1f} s "
    f"(target < {TARGET_S:.0f} s: {verdict}; {trace.duration_s / wall:,.0f}x real time)"
  )
  figures: dict[str, float] = {"devices": lay.devices, "trace_hours": trace.duration_s / 3600,
                               "simulation_s": round(wall, 1)}
  for name, run in result.policies.items():
    figures[f"{name}_of_fault_free"] = round(
      run.samples / trace.duration_s / run.fault_free_throughput, 3)

  # Side by side: one failure state planned on a full grid and on its reduced grid.
  recycle = policies.get("recycle")
  if recycle is not None and args.compare_dp:
    grid = Grid(args.compare_dp, lay.pp, lay.microbatches, lay.schedule, lay.memory_cap)
    failed = frozenset({(args.compare_dp - 1, lay.pp - 1), (args.compare_dp // 2, 0)})
    times = {}
    for reduce in (False, True):
      fresh = build_policies(["recycle"], params=cfg.recovery)["recycle"]
      t = time.perf_counter()
      step = fresh.step_time(grid, failed, costs, reduce=reduce)
      times[reduce] = (time.perf_counter() - t, step)
    (t_full, s_full), (t_red, s_red) = times[False], times[True]
    dp_red, _, _ = recycle.planning_grid(grid, failed, reduce=True)
    print(
      f"one state on {args.compare_dp} x {lay.pp}: full grid {t_full:.2f} s "
      f"(step {s_full:.4f} s), reduced {dp_red} x {lay.pp} {t_red:.2f} s "
      f"(step {s_red:.4f} s): {t_full / t_red:.0f}x faster, step within "
      f"{abs(s_red / s_full - 1):.1%}"
    )
    figures.update({"full_grid_plan_s": round(t_full, 2), "reduced_grid_plan_s": round(t_red, 2),
                    "reduced_step_error": round(abs(s_red / s_full - 1), 4)})
  record("simulator", figures)


if __name__ == "__main__":
  main()
