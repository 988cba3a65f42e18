"""What a host failure costs under each placement, side by side in one run (the simulator).

For `configs/sim/hosts.py` (GPT-3 6.7B, 64 hosts of 8 A100s, dp 64 x pp 8) and each placement
(`resilient_jax/spec/placement.py`: "pipeline", a host is one pipeline; "stage", a host is
one stage of 8 pipelines), prints the re-routing policy's steady-state throughput with k hosts
failed at once (k = 1, 2, 4, 8; mean and worst over `--draws` random choices of the hosts: the
failed set depends on which hosts fail, so one draw says little), and each placement's samples/s
through the same 24-hour trace of host failures (`--seeds` traces). The last line is the ratio
pipeline / stage of the means. `mesh.placement`'s default follows from it (docs/clusters.md).

Run:
  python benchmarks/placement.py               # 20 draws per point, 4 traces: about a minute
  python benchmarks/placement.py --draws=3 --seeds=1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results import record  # noqa: E402
from configs.sim.hosts import get_config  # noqa: E402
from resilient_jax.policy.base import Grid  # noqa: E402
from resilient_jax.policy.registry import build_policies  # noqa: E402
from resilient_jax.sim import build_costs, build_trace, from_config_dict  # noqa: E402
from resilient_jax.sim.engine import run_trace, sweep  # noqa: E402
from resilient_jax.spec.placement import PLACEMENTS  # noqa: E402

HOSTS_FAILED = (1, 2, 4, 8)


def measure(placement: str, draws: int, seeds: int) -> dict:
  cd = get_config()
  cd.cluster.placement = placement
  cfg = from_config_dict(cd)
  lay = cfg.layout
  costs = build_costs(cfg)
  policies = build_policies(("recycle",), params=cfg.recovery, exact_ops=cfg.exact_ops)
  grid = Grid(lay.dp, lay.pp, lay.microbatches, lay.schedule, lay.memory_cap)
  batch = lay.global_batch
  [free] = sweep(grid, costs, policies, [0], samples_per_step=batch, placement="hosts",
                 layout=lay)
  out = {"fault_free": free.throughput, "hosts": {}, "trace": []}
  for k in HOSTS_FAILED:
    got = [sweep(grid, costs, policies, [k], samples_per_step=batch, placement="hosts",
                 seed=1000 * d, layout=lay)[0].throughput for d in range(draws)]
    out["hosts"][k] = (statistics.mean(got), min(got))
  for seed in range(seeds):
    cd.trace.seed = seed
    trace = build_trace(from_config_dict(cd))
    result = run_trace(lay, costs, policies, trace,
                       checkpoint_interval_s=cfg.recovery.checkpoint_interval_s)
    run = result.policies["recycle"]
    out["trace"].append(run.samples / trace.duration_s)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--draws", type=int, default=20, help="random host sets per point")
  ap.add_argument("--seeds", type=int, default=4, help="24-hour traces per placement")
  args = ap.parse_args()
  res = {p: measure(p, args.draws, args.seeds) for p in PLACEMENTS}
  print("GPT-3 6.7B, 64 hosts x 8 A100 (dp 64 x pp 8), policy recycle; samples/s "
        f"(relative to fault-free), mean / worst of {args.draws} random host sets")
  print(f"{'hosts failed':>12} " + " ".join(f"{p:>26}" for p in PLACEMENTS))
  print(f"{0:>12} " + " ".join(f"{res[p]['fault_free']:>26.1f}" for p in PLACEMENTS))
  for k in HOSTS_FAILED:
    cells = []
    for p in PLACEMENTS:
      mean, worst = res[p]["hosts"][k]
      ff = res[p]["fault_free"]
      cells.append(f"{mean:7.1f} ({mean / ff:.3f}) / {worst / ff:.3f}")
    print(f"{k:>12} " + " ".join(f"{c:>26}" for c in cells))
  traces = {p: statistics.mean(res[p]["trace"]) for p in PLACEMENTS}
  print(f"24 h traces of host failures ({args.seeds}), mean samples/s: "
        + ", ".join(f"{p} {traces[p]:.1f}" for p in PLACEMENTS))
  ratios = [res["pipeline"]["hosts"][k][0] / res["stage"]["hosts"][k][0] for k in HOSTS_FAILED]
  print("pipeline / stage: " + ", ".join(f"{k} hosts {r:.3f}" for k, r in
                                         zip(HOSTS_FAILED, ratios, strict=True))
        + f"; traces {traces['pipeline'] / traces['stage']:.3f}")
  figures: dict[str, float] = {}
  for p in PLACEMENTS:
    ff = res[p]["fault_free"]
    figures[f"{p}_fault_free_samples_per_s"] = round(ff, 1)
    for k in HOSTS_FAILED:
      figures[f"{p}_{k}_hosts_mean_relative"] = round(res[p]["hosts"][k][0] / ff, 3)
      figures[f"{p}_{k}_hosts_worst_relative"] = round(res[p]["hosts"][k][1] / ff, 3)
    figures[f"{p}_trace_samples_per_s"] = round(traces[p], 1)
  record("placement", figures)


if __name__ == "__main__":
  main()
