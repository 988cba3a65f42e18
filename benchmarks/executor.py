"""Executor overheads, and executed steps against the cost model's replay of measured op times.

Run:
  python benchmarks/executor.py --schedules=zb-h1,1f1b --steps=12

Trains configs/gpt_tiny.py on a dp=2 x pp=4 grid of simulated CPU devices, one executor per
schedule (all built from the same initial parameters), with the schedules' steps interleaved.
Prints per schedule:
  - host dispatch overhead per op: the host time until the last op of a step was dispatched
    (`StepResult.dispatch_time_s`), divided by the number of ops in the schedule; and, as a
    bound on the whole per-op overhead, the step time of the same grid and schedule with a
    model so small that its ops do almost no work, divided by the number of ops;
  - the executed step time (not profiled; median over the steps after warm-up);
  - the profiled per-op durations (profile mode waits for each op), medians per kind and stage;
  - the replayed makespan: the schedule replayed with those measured op times
    (`profiling.replay_records`), i.e. the step as it would run with one core per worker;
  - the sum of all op durations / cores: what the measured work needs on this host's cores.

The model's dense layers run on 2-D `[tokens, features]` (`models.gpt.tokens`), the fast form
on XLA:CPU, so the op durations are not inflated by the 3-D product's slow backward. The
library's step against the plain `jax.jit` step of the same work is `benchmarks/overhead.py`.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402

KINDS = ("F", "B", "W", "BW", "AR", "OPT")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--schedules", default="zb-h1,1f1b")
  p.add_argument("--dp", type=int, default=2)
  p.add_argument("--pp", type=int, default=4)
  p.add_argument("--steps", type=int, default=12, help="timed steps per schedule")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
  p.add_argument("--profile_steps", type=int, default=3, help="profiled steps per schedule")
  p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="for the work bound")
  return p.parse_args(argv)


def make_cfg(schedule: str, dp: int, pp: int, tiny_ops: bool = False):
  from configs.gpt_tiny import get_config
  from resilient_jax.config import from_config_dict

  cd = get_config()
  cd.mesh.dp, cd.mesh.pp = dp, pp
  cd.pipeline.schedule = schedule
  if tiny_ops:
    # Same grid, schedule, micro-batch count and layer count; ops that do almost nothing.
    cd.model.update(vocab_size=16, seq_len=4, d_model=4, num_heads=1, mlp_ratio=1)
  return from_config_dict(cd)


def build_executor(cfg):
  import jax

  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.recipe import make_data, make_model, make_optimizer
  from resilient_jax.runtime.interpreter import Interpreter
  from resilient_jax.runtime.transport import Transport
  from resilient_jax.schedule.generators import generate
  from resilient_jax.schedule.plan import GridPlan

  programs = build_stage_programs(
    make_model(cfg),
    cfg.partition,
    cfg.microbatch_size,
    cfg.model.seq_len,
    make_optimizer(cfg),
    cfg.train.global_batch,
  )
  dp, pp = cfg.mesh.dp, cfg.mesh.pp
  schedule = generate(cfg.pipeline.schedule, dp, pp, cfg.pipeline.microbatches)
  split = tuple((r.start, r.stop) for r in cfg.partition)
  plan = GridPlan(schedule, split, {(d, s): d * pp + s for d in range(dp) for s in range(pp)})
  transport = Transport(dict(enumerate(jax.devices()[: dp * pp])))
  source, data = make_data(cfg)
  return Interpreter(lambda _: programs, transport, plan), schedule, source, data


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  runtime_setup.configure_jax(args.dp * args.pp)

  from resilient_jax.observe.profiling import replay_records
  from resilient_jax.recipe import step_data

  names = [s.strip() for s in args.schedules.split(",") if s.strip()]
  runs = {}
  for name in names:
    for tiny in (False, True):
      cfg = make_cfg(name, args.dp, args.pp, tiny_ops=tiny)
      runs[(name, tiny)] = (cfg, *build_executor(cfg))

  def step(key, t: int, profile: bool = False):
    cfg, executor, schedule, source, plan = runs[key]
    _, batch = step_data(cfg, source, plan, t)
    return executor.run_step(batch, profile=profile)

  keys = list(runs)
  for t in range(1, args.warmup + 1):
    for key in keys:
      step(key, t)
  results = collections.defaultdict(list)
  for i in range(args.steps):
    order = keys[i % len(keys) :] + keys[: i % len(keys)]
    for key in order:
      results[key].append(step(key, args.warmup + 1 + i))
  profiled = collections.defaultdict(list)
  for i in range(args.profile_steps):
    for name in names:
      profiled[name].append(step((name, False), args.warmup + args.steps + 1 + i, profile=True))

  cfg0 = runs[keys[0]][0]
  m = cfg0.model
  print(
    f"configs/gpt_tiny.py: d_model={m.d_model}, layers={m.num_layers}, seq_len={m.seq_len}, "
    f"global_batch={cfg0.train.global_batch}, micro-batches/pipeline="
    f"{cfg0.pipeline.microbatches} (micro-batch {cfg0.microbatch_size}); grid dp={args.dp} x "
    f"pp={args.pp} on {args.dp * args.pp} simulated CPU devices, {args.cores} cores; "
    f"{args.steps} timed steps after {args.warmup} warm-up, {args.profile_steps} profiled"
  )
  figures: dict[str, float] = {}
  for name in names:
    _, _, schedule, _, _ = runs[(name, False)]
    n_ops = sum(len(ops) for ops in schedule.ops.values())
    res, tiny = results[(name, False)], results[(name, True)]
    step_s = statistics.median(r.step_time_s for r in res)
    dispatch_s = statistics.median(r.dispatch_time_s for r in res)
    tiny_step_s = statistics.median(r.step_time_s for r in tiny)
    tiny_dispatch_s = statistics.median(r.dispatch_time_s for r in tiny)
    makespans, sums, serial = [], [], []
    per_kind: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for r in profiled[name]:
      makespans.append(replay_records(schedule, r.records).makespan)
      sums.append(sum(rec.end - rec.start for rec in r.records))
      serial.append(r.step_time_s)
      for rec in r.records:
        per_kind[(rec.op.kind, rec.worker[1])].append(rec.end - rec.start)
    makespan = statistics.median(makespans)
    work = statistics.median(sums)
    bound = work / args.cores
    print(f"\n== {name}: {n_ops} ops per step ({len(schedule.workers)} workers)")
    print(
      f"host dispatch per op     {dispatch_s / n_ops * 1e6:8.1f} us   "
      f"(dispatch loop {dispatch_s * 1e3:.1f} ms of a {step_s * 1e3:.1f} ms step)"
    )
    print(
      f"tiny-op step per op      {tiny_step_s / n_ops * 1e6:8.1f} us   "
      f"(d_model=4 model: step {tiny_step_s * 1e3:.1f} ms, dispatch loop "
      f"{tiny_dispatch_s * 1e3:.1f} ms)"
    )
    print(f"executed step (median)   {step_s * 1e3:8.1f} ms")
    print(f"profiled step (serial)   {statistics.median(serial) * 1e3:8.1f} ms")
    print(f"replayed makespan        {makespan * 1e3:8.1f} ms   (one core per worker)")
    print(f"sum of op durations      {work * 1e3:8.1f} ms")
    print(f"  / {args.cores} cores              {bound * 1e3:8.1f} ms   ({args.cores}-core bound)")
    print(
      f"executed / replayed      {step_s / makespan:8.2f}    "
      f"executed / {args.cores}-core bound {step_s / bound:.2f}"
    )
    kinds = [k for k in KINDS if any(key[0] == k for key in per_kind)]
    print("profiled op durations, median ms:  stage " + "".join(f"{k:>8}" for k in kinds))
    for s in range(args.pp):
      cells = "".join(
        f"{statistics.median(per_kind[(k, s)]) * 1e3:8.2f}" if per_kind[(k, s)] else f"{'-':>8}"
        for k in kinds
      )
      print(f"{'':35}{s:>5} {cells}")
    figures.update({f"{name}_dispatch_us_per_op": round(dispatch_s / n_ops * 1e6, 1),
                    f"{name}_tiny_op_step_us_per_op": round(tiny_step_s / n_ops * 1e6, 1),
                    f"{name}_executed_step_ms": round(step_s * 1e3, 1),
                    f"{name}_replayed_makespan_ms": round(makespan * 1e3, 1),
                    f"{name}_executed_over_replayed": round(step_s / makespan, 2)})
  record("executor", figures)


if __name__ == "__main__":
  main()
