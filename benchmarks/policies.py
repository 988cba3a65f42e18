"""Resilience policies side by side: one cost profile, one failure sequence, one table.

Every policy is planned by its own planner over the same cost model (`resilient_jax.sim`):
recycle (`plan_adaptive`), naive (`plan_naive`), oobleck (pipeline templates re-instantiated on
the survivors), bamboo (redundant forward of the successor stage in every step; the
predecessor takes over), restart (restore the last checkpoint onto the largest grid of the
survivors) and auto (per failure state, the fastest of the others).

Prints per policy: fault-free throughput, throughput after 1, 2 and 4 failures (relative to
recycle's fault-free throughput, so policies that cost something fault-free show it), the
pause to recover from the first failure, auto's choice per state, and recycle/oobleck and
recycle/bamboo (the ReCycle paper reports up to 1.46x and 1.64x).

This is the cost model at cluster scale, where the planners' choices matter; the same policies
run on the real runtime (tiny GPT, simulated CPU devices) in `benchmarks/policies_runtime.py`.

Op times come from the simulator's spec-based cost model of a sim config (FLOPs and bytes on
the config's device and network); Oobleck needs that, because it re-partitions layers by their
per-layer times and memory.

Run:
  python benchmarks/policies.py                                   # GPT-3 1.3B, 64 A100s: 16 x 4
  python benchmarks/policies.py --config=configs/sim/gpt3_6_7b.py:256
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import record  # noqa: E402
from resilient_jax.policy import Grid, PolicyUnavailableError, Transition, build_policies  # noqa: E402
from resilient_jax.sim.config import from_config_dict, load_config_file  # noqa: E402
from resilient_jax.sim.run import build_costs  # noqa: E402


def failure_sequence(dp: int, pp: int) -> list[tuple[int, int]]:
  """Four failures in different pipelines, several in the same stage (the stage next to the
  last carries the most re-routed work)."""
  return [(dp - 1, pp - 2), (1, pp // 2), (2, pp - 2), (dp - 2, 1)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/sim/gpt3_1_3b.py:64")
  args = parser.parse_args()
  cfg = from_config_dict(load_config_file(args.config))
  lay = cfg.layout
  grid = Grid(dp=lay.dp, pp=lay.pp, m=lay.microbatches, base=lay.schedule)
  costs = build_costs(cfg)
  seq = failure_sequence(grid.dp, grid.pp)
  states = {0: frozenset()} | {k: frozenset(seq[:k]) for k in (1, 2, 4)}
  policies = build_policies()
  samples = grid.dp * grid.m  # micro-batches per step; throughput in micro-batches/s

  print(f"{args.config}: D={grid.dp} x p={grid.pp}, m={grid.m}, base {grid.base}; "
        f"failures in order (dp, stage): {seq}")
  header = f"{'policy':9s} {'fault-free':>11s} {'1 failed':>9s} {'2 failed':>9s} " \
           f"{'4 failed':>9s} {'recover 1st':>12s}"
  print(header + "   (throughput relative to recycle's fault-free)")
  rows: dict[str, dict[int, float]] = {}
  reference = None
  for name, policy in policies.items():
    try:
      policy.check(grid, costs)
      times = {k: policy.step_time(grid, f, costs) for k, f in states.items()}
      rec = policy.recovery(Transition(grid, states[0], states[1], costs, times[0]))
    except PolicyUnavailableError as e:
      print(f"{name:9s} unavailable: {e}")
      continue
    if reference is None:
      reference = samples / times[0]
    rows[name] = {k: (samples / t if t > 0 else 0.0) / reference for k, t in times.items()}
    pause = f"{rec.pause_s:.0f} s" + (" +rollback" if rec.rollback else "")
    print(f"{name:9s} " + " ".join(f"{rows[name][k]:9.3f}" + ("  " if k == 0 else "")
                                   for k in (0, 1, 2, 4)) + f" {pause:>12s}")
  auto = policies["auto"]
  print("auto's choice: " + ", ".join(
    f"{k} failed -> {auto.choice(grid, f, costs).name}" for k, f in states.items()))
  for other, paper in (("oobleck", 1.46), ("bamboo", 1.64)):
    if "recycle" in rows and other in rows:
      ratios = " ".join(f"{rows['recycle'][k] / rows[other][k]:.2f}" for k in (0, 1, 2, 4))
      print(f"recycle/{other} at 0/1/2/4 failures: {ratios}  (paper: up to {paper}x)")
  worst = [k for k in (0, 1, 2, 4)
           if any(rows["auto"][k] < r[k] * (1 - 0.01) for n, r in rows.items() if n != "auto")]
  print("auto >= every other policy (within its 1% tie rule) in every row: "
        + ("yes" if not worst else f"NO at {worst}"))
  path, _, variant = args.config.partition(":")  # another config: its own file
  name = "policies" if args.config == parser.get_default("config") else \
    f"policies_{os.path.basename(path).removesuffix('.py')}{'_' * bool(variant)}{variant}"
  record(name, {f"{p}_{k}_failed": round(v, 3) for p, r in rows.items() for k, v in r.items()})


if __name__ == "__main__":
  main()
