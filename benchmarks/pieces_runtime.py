"""The runtime on a sample-split plan: its profiled steps replayed against the cost model.

The tiny GPT on a 4 x 2 grid, one micro-batch of 4 samples per pipeline and step; workers
(1, 1) and (3, 0) fail at the start of steps 2 and 3 (`tests/test_pieces_runtime.py`'s
failures). With `--pieces=1` (`resilience.pieces`) the plan then runs micro-batch 1's last stage
and micro-batch 3's first stage in two pieces each. After the run, step 4 is re-run profiled
`--reps` times (the first two as warm-up): each op's measured time replayed through the plan's
dependencies (`profiling.replay_records`) against the cost model's makespan of the same plan
from that step's per-stage mean op times (`costs_from_records`, which leaves pieces out), with
the fixed share of an op (`OpCosts.fixed`) measured from the pieces' own times, and with none
(the coordinator's analytic costs have none). Prints each step's figures, then
`predicted_vs_replayed: X` (medians) and `predicted_vs_replayed_fixed0: X`. Simulated CPU
devices: op times, not wall times, are what it compares.

Run:
  python benchmarks/pieces_runtime.py              # pieces
  python benchmarks/pieces_runtime.py --pieces=0   # the same failures, whole micro-batches
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pieces", type=int, default=1)
  parser.add_argument("--reps", type=int, default=8)
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

  from resilient_jax.observe.profiling import costs_from_records, replay_records
  from resilient_jax.schedule.core import Piece
  from resilient_jax.schedule.cost import simulate
  from resilient_jax.training.loop import Trainer
  from tests.helpers import tiny_config

  cfg = tiny_config(mesh__dp=4, mesh__pp=2, pipeline__microbatches=1, train__steps=4,
                    faults__schedule="2:1.1,3:3.0", resilience__pieces=bool(args.pieces))
  lines: list[str] = []
  trainer = Trainer(cfg, tempfile.mkdtemp(), log=lines.append)
  trainer.run()
  print("\n".join(x for x in lines if x.startswith("step ") and " loss " in x))
  sched = trainer.coordinator.plan.schedule
  print(f"pieces: {dict(sched.pieces)}")
  replayed, predicted, predicted0 = [], [], []
  for rep in range(args.reps):
    records = trainer.run_step(cfg.train.steps, profile=True).result.records
    if rep < 2:
      continue
    costs = costs_from_records(records, cfg.mesh.pp)
    shares = []
    for r in records:
      if isinstance(r.op, Piece):
        whole = getattr(costs, {"F": "f", "B": "b", "W": "w"}[r.op.kind])[r.worker[1]]
        shares.append(((r.end - r.start) / whole - r.op.fraction) / (1 - r.op.fraction))
    fixed = min(max(statistics.mean(shares), 0.0), 0.95) if shares else 0.0
    replayed.append(replay_records(sched, records).makespan)
    predicted.append(simulate(sched, dataclasses.replace(costs, fixed=fixed)).makespan)
    predicted0.append(simulate(sched, costs).makespan)
    print(f"replayed {replayed[-1] * 1e3:.2f} ms  predicted (fixed {fixed:.2f}) "
          f"{predicted[-1] * 1e3:.2f} ms  (fixed 0) {predicted0[-1] * 1e3:.2f} ms")
  med = statistics.median
  print(f"replayed_ms: {med(replayed) * 1e3:.2f}")
  print(f"predicted_vs_replayed: {med(predicted) / med(replayed):.3f}")
  print(f"predicted_vs_replayed_fixed0: {med(predicted0) / med(replayed):.3f}")


if __name__ == "__main__":
  main()
