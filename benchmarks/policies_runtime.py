"""The resilience policies on the real runtime: one model, one failure sequence, one table.

Every policy trains the same tiny GPT (4 x 2 grid of simulated CPU devices, 1F1B, m=4,
d_model 128 so that compute rather than dispatch dominates a step) through the same failures:
stage-0 workers (1, 0) at step 7, (2, 0) at step 13 and (3, 0) at step 19, the last one in the
middle of the step. Every policy runs `--repeats` times in turn and the last round is
reported, so that no policy pays first compiles the others then find in the persistent cache
(building programs for a new split, from that cache, still counts: it is a real cost).
Prints, per policy: the median warm step time in each failure state, the time from each failure
to the next completed step (replanning, state copies, compiling new programs, redone steps),
the total wall time, and the largest relative difference of its losses from recycle's (every
policy trains the same mathematics, so it is float noise).

The devices share this machine's cores, so a step's wall time is about the *total* compute of
the step, not its critical path: it shows work a policy adds (Bamboo's redundant forward in
every fault-free step, the extra micro-batches a survivor takes) but not how well a schedule
hides it in bubbles; `benchmarks/policies.py` compares that on the cost model.

Run:
  python benchmarks/policies_runtime.py [--policies=recycle,oobleck,bamboo,restart,auto]
      [--repeats=2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402

FAILURES = [(7, (1, 0), None), (13, (2, 0), None), (19, (3, 0), "F12")]
STEPS = 24


def _run(policy: str) -> dict:
  from configs.gpt_tiny import get_config
  from resilient_jax.config import from_config_dict
  from resilient_jax.schedule.core import Op
  from resilient_jax.training.faults import FaultEvent
  from resilient_jax.training.loop import Trainer

  cd = get_config()
  cd.mesh.update(dp=4, pp=2)
  cd.model.update(d_model=128)
  cd.train.update(steps=STEPS, global_batch=32)
  cd.checkpoint.update(every_steps=3)
  cd.resilience.policy = policy
  cfg = from_config_dict(cd)
  faults = [
    FaultEvent(step, w, Op(op[0], int(op[1:])) if op else None) for step, w, op in FAILURES
  ]
  events: list[tuple[float, str]] = []
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    trainer = Trainer(
      cfg, tmp, log=lambda line: events.append((time.perf_counter(), line)), faults=faults
    )
    result = trainer.run()
    total = time.perf_counter() - t0
  rows = result.metrics
  states: list[list[float]] = [[] for _ in range(len(FAILURES) + 1)]
  for r in rows:
    k = sum(r["step"] >= step for step, _, _ in FAILURES)
    first = r["step"] == 1 or r["step"] in {step for step, _, _ in FAILURES}
    if not first:
      states[k].append(r["step_time_s"])
  recover = []
  for i, (t, line) in enumerate(events):
    if line.startswith("FAILURE"):
      done = next((t2 for t2, l2 in events[i + 1 :] if l2.startswith("step ")), None)
      recover.append(done - t if done is not None else float("nan"))
  return {
    "states": [statistics.median(s) if s else float("nan") for s in states],
    "recover": recover,
    "total": total,
    "losses": [r["loss"] for r in rows],
    "schedules": [r["schedule"] for r in rows],
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--policies", default="recycle,oobleck,bamboo,restart,auto")
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args()
  runtime_setup.configure_jax(num_cpu_devices=8)
  names = args.policies.split(",")
  for _ in range(args.repeats - 1):
    for name in names:
      _run(name)
  results = {name: _run(name) for name in names}
  ref = results.get("recycle", next(iter(results.values())))["losses"]
  print(f"tiny GPT, 4 x 2 grid on 8 simulated CPU devices, {STEPS} steps; failures: "
        + ", ".join(f"step {s} worker {w}" + (f" after {op}" if op else "")
                    for s, w, op in FAILURES))
  print("median warm step time (s) per failure state; failure -> next step done (s)")
  head = ("| policy | 0 failed | 1 | 2 | 3 | recover 1st, 2nd, 3rd | total | max loss diff "
          "| ends on |")
  print(head)
  print("|---" * (head.count("|") - 1) + "|")
  figures: dict[str, float] = {}
  for name, r in results.items():
    diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref, strict=True))
    states = " | ".join(f"{x:.3f}" for x in r["states"])
    rec = ", ".join(f"{x:.2f}" for x in r["recover"])
    print(f"| {name} | {states} | {rec} | {r['total']:.1f} s | {diff:.1e} | {r['schedules'][-1]} |")
    figures.update({f"{name}_{k}_failed_step_s": round(x, 3) for k, x in enumerate(r["states"])})
    figures.update({f"{name}_recover_{i + 1}_s": round(x, 2) for i, x in enumerate(r["recover"])})
    figures.update({f"{name}_total_s": round(r["total"], 1), f"{name}_max_loss_diff": diff})
  record("policies_runtime", figures)


if __name__ == "__main__":
  main()
