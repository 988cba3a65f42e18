"""Re-routing whole micro-batches against pieces of them, side by side, on a grid planned whole.

A GPT-3 6.7B job of the simulator's cost model (`configs/sim/gpt3_6_7b.py`, A100s, 8 stages,
m = 16) with `--samples` sequences a micro-batch, on `--devices` devices (32 pipelines at 256:
small enough that the planner plans every op, no reduced grid). k workers of the last stage
fail (the slowest stage: it runs the head); for each k, recycle's relative throughput (its step
time without failures over with) when micro-batches move whole (`Grid.samples` 1) and when
their samples may move as pieces (`Grid.samples` = `--samples`, `routing.split_route`), an
op's fixed share `--fixed` (`OpCosts.fixed`; 0.016 is `benchmarks/piece_cost.py`'s CPU fit),
and the capacity bound `(D - k) / D`. Cost replay, not wall time: the figures are the same on
any machine.

Run:
  python benchmarks/pieces.py                      # 256 devices, 4 samples, fixed 0.016
  python benchmarks/pieces.py --fixed=0.1          # pieces dearer
  python benchmarks/pieces.py --config=llama3_16k --microbatches=8 --samples=2   # its 16 a pipeline
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from resilient_jax.policy.base import Grid  # noqa: E402
from resilient_jax.policy.registry import build_policies  # noqa: E402
from resilient_jax.schedule.cost import OpCosts  # noqa: E402
from resilient_jax.sim import build_costs, from_config_dict  # noqa: E402


@dataclasses.dataclass(frozen=True)
class WithFixed:
  """A cost model whose op costs carry a fixed share (what pieces pay)."""

  costs: object
  fixed: float

  @property
  def comm(self) -> float:
    return self.costs.comm

  def op_costs(self, live) -> OpCosts:
    return dataclasses.replace(self.costs.op_costs(live), fixed=self.fixed)


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="gpt3_6_7b", help="a configs/sim preset")
  p.add_argument("--devices", type=int, default=256, help="for gpt3_*: the cluster size")
  p.add_argument("--microbatches", type=int, default=0, help="per pipeline (0: the preset's)")
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--fixed", type=float, default=0.016)
  p.add_argument("--failures", default="1,2,4")
  args = p.parse_args(argv)
  get = runpy.run_path(os.path.join(ROOT, "configs", "sim", f"{args.config}.py"))["get_config"]
  cd = get(str(args.devices)) if args.config.startswith("gpt3") else get()
  cd.parallel.micro_batch_size = args.samples
  if args.microbatches:
    cd.parallel.microbatches = args.microbatches
  cfg = from_config_dict(cd)
  lay = cfg.layout
  costs = WithFixed(build_costs(cfg), args.fixed)
  recycle = build_policies(["recycle"], exact_ops=10**9)["recycle"]
  print(f"{cfg.model.name}, dp {lay.dp} x pp {lay.pp}, m={lay.microbatches}, {args.samples} "
        f"sequences a micro-batch, fixed share {args.fixed}; k workers of the last stage failed")
  print(f"{'k':>3} {'bound':>6} {'whole':>6} {'pieces':>7} {'takers':>7} {'plan s':>7}")
  for k in (int(x) for x in args.failures.split(",")):
    failed = frozenset((lay.dp - 1 - i, lay.pp - 1) for i in range(k))
    row = []
    for samples in (1, args.samples):
      grid = Grid(lay.dp, lay.pp, lay.microbatches, lay.schedule, samples=samples)
      t0 = time.process_time()
      ff = recycle.step_time(grid, frozenset(), costs, reduce=False)
      t = recycle.step_time(grid, failed, costs, reduce=False)
      row.append((ff / t, time.process_time() - t0, grid))
    split = recycle.schedule(row[1][2], failed, costs, reduce=False)[0]
    takers = len({d for parts in split.pieces.values() for d, _, _ in parts})
    print(f"{k:3d} {(lay.dp - k) / lay.dp:6.3f} {row[0][0]:6.3f} {row[1][0]:7.3f} {takers:7d} "
          f"{row[1][1]:7.1f}")


if __name__ == "__main__":
  main()
