"""Host time per op of the interpreter's dispatch, one process driving 8 simulated devices.

Run:
  python benchmarks/dispatch.py                         # 8x1, 4x2, 2x4
  python benchmarks/dispatch.py --grids=8x1 --steps=20
  python benchmarks/dispatch.py --tree=/tmp/base --modes=pipelines,slots,serial   # an older
                                                        # checkout's thread modes, side by side

With one process per host (`mesh.placement`, `launch.local --devices_per_process`) a process
dispatches the ops of all its host's workers. For each grid dp x pp (8 devices in all) and
each dispatch mode (one thread, `serial`, is the library's only one since the thread modes
lost, `runtime/dispatch.py`; a checkout before that, `--tree`, still has `pipelines`, a thread
per pipeline, and `slots`, one per worker), a `Trainer` on the tiny config runs
`Trainer.run_step`; steps are interleaved round-robin (the order rotates every round) after
warm-up steps that compile, and medians are printed:

  - dispatch wall ms/op: the wall time of the dispatch loop (every op dispatched, before
    waiting for the devices), per op;
  - dispatch CPU ms/op: CPU time of the threads that dispatched, summed, per op (on a loaded
    machine the wall time also counts waiting for a core; the CPU time does not), median and
    mean (the mean also counts the garbage collector's rare full passes: `--no_gc_freeze`);
  - step ms: the whole step, until its new parameters are ready;
  - caller CPU ms/op: CPU time of the calling thread over the whole `run_step` (dispatch,
    then concluding the step), per op: the one figure a library without dispatch modes gives,
    to compare with it (with dispatch threads it leaves their CPU time out);
  - arrays/op: arrays passed into and out of the library's compiled programs per op, counted
    in one more step (JAX's call of a program costs about a microsecond of host time per array);
  - mode/serial (the last mode given): the ratio of the medians, and the median of the
    per-round ratios.

Every mode of a grid trains from the same state on the same data: their losses must be
bitwise equal, which is checked and printed.

`--tree` imports the library from another checkout (e.g. the merge base, extracted with
`git archive`), to measure the code before a change with the same script; a library without
dispatch modes runs as `serial` and its dispatch CPU is the caller's over `run_step`.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--grids", default="8x1,4x2,2x4", help="dp x pp grids")
  p.add_argument("--modes", default="serial", help="dispatch modes to compare (--tree's)")
  p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
  p.add_argument("--microbatches", type=int, default=0, help="per pipeline; 0: the config's")
  p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
  p.add_argument("--tree", default="", help="import resilient_jax from this checkout")
  p.add_argument("--no_gc_freeze", action="store_true",
                 help="leave the set-up's objects in the garbage collector (as before)")
  p.add_argument("--deep", type=int, default=4,
                 help="also count arrays per op at 8x1 for the model with this many times its "
                      "layers (0: not)")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  sys.path.insert(0, ROOT)
  from benchmarks.results import record  # this checkout's, before --tree's

  if args.tree:
    sys.path.insert(0, os.path.abspath(args.tree))
  from benchmarks.overhead import make_cfg

  try:
    from resilient_jax.runtime import setup as runtime_setup
  except ImportError:  # a checkout before resilient_jax/ was grouped into packages (--tree)
    from resilient_jax import runtime_setup

  grids = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",") if g.strip()]
  modes = [m for m in args.modes.split(",") if m.strip()]
  runtime_setup.configure_jax(max(dp * pp for dp, pp in grids))

  import tempfile

  import jax

  import resilient_jax

  try:
    from resilient_jax.training.loop import Trainer
  except ImportError:  # --tree: an older checkout
    from resilient_jax.trainer import Trainer

  overhead_args = argparse.Namespace(
    model=args.model, d_model=0, seq_len=0, layers=0, heads=0, global_batch=0,
    microbatches=args.microbatches, schedule="1f1b", warmup=args.warmup, steps=args.steps)
  trainers: dict[str, Trainer] = {}
  keep = []
  for dp, pp in grids:
    for mode in modes:
      workdir = tempfile.TemporaryDirectory(prefix="dispatch_")
      keep.append(workdir)
      trainer = Trainer(make_cfg(overhead_args, dp, pp), workdir.name, devices=jax.devices(),
                        log=lambda _: None)
      if hasattr(trainer.interpreter, "dispatch"):
        trainer.interpreter.dispatch = mode
      elif len(modes) > 1:
        raise SystemExit("error: this library has no dispatch modes: pass --modes=serial")
      trainers[f"{dp}x{pp} {mode}"] = trainer

  def run(name: str, t: int) -> tuple[float, float, float, float, float]:
    trainer = trainers[name]
    c0, w0 = time.thread_time(), time.perf_counter()
    result = trainer.run_step(t).result
    cpu = time.thread_time() - c0
    jax.block_until_ready(list(trainer.interpreter.params.values()))
    step = time.perf_counter() - w0
    return result.loss, result.dispatch_time_s, getattr(result, "dispatch_cpu_s", cpu), step, cpu

  if not args.no_gc_freeze:
    import gc

    gc.freeze()  # as `Trainer.run` does before its steps
  names = list(trainers)
  for t in range(1, args.warmup + 1):
    for n in names:
      run(n, t)
  rows: dict[str, list[tuple[float, float, float, float, float]]] = collections.defaultdict(list)
  load_before = os.getloadavg()
  for i in range(args.steps):
    t = args.warmup + 1 + i
    for n in names[i % len(names):] + names[: i % len(names)]:
      rows[n].append(run(n, t))
  load_after = os.getloadavg()

  arrays = {n: arrays_per_op(trainers[n], args.warmup + args.steps + 1) for n in names}
  cfg = next(iter(trainers.values())).cfg
  print(f"{cfg.model.name}: d_model={cfg.model.d_model}, layers={cfg.model.num_layers}, "
        f"micro-batches per pipeline {cfg.pipeline.microbatches}; library "
        f"{os.path.dirname(os.path.dirname(resilient_jax.__file__))}; "
        f"{len(jax.devices())} simulated devices in one process, {os.cpu_count()} cores; "
        f"{args.steps} timed steps per variant after {args.warmup} warm-up")
  print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
  print(f"{'grid':5} {'mode':9} {'ops':>4} {'dispatch wall ms/op':>20} {'dispatch CPU ms/op':>19} "
        f"{'(mean)':>7} {'step ms':>8} {'caller CPU ms/op':>17} {'arrays/op':>9}")
  figures: dict[str, float] = {}
  for dp, pp in grids:
    g = f"{dp}x{pp}"
    ops = sum(len(s.ops) for s in trainers[f"{g} {modes[0]}"].interpreter.step_program
              .slots.values())
    for mode in modes:
      r = rows[f"{g} {mode}"]
      print(f"{g:5} {mode:9} {ops:4d} {statistics.median(x[1] for x in r) / ops * 1e3:20.3f} "
            f"{statistics.median(x[2] for x in r) / ops * 1e3:19.3f} "
            f"{statistics.mean(x[2] for x in r) / ops * 1e3:7.3f} "
            f"{statistics.median(x[3] for x in r) * 1e3:8.1f} "
            f"{statistics.median(x[4] for x in r) / ops * 1e3:17.3f} "
            f"{arrays[f'{g} {mode}'] / ops:9.1f}")
      key = f"{g}_{mode}"
      figures.update({
        f"{key}_dispatch_wall_ms_per_op": round(statistics.median(x[1] for x in r) / ops * 1e3, 3),
        f"{key}_dispatch_cpu_ms_per_op": round(statistics.median(x[2] for x in r) / ops * 1e3, 3),
        f"{key}_step_ms": round(statistics.median(x[3] for x in r) * 1e3, 1)})
    if len(modes) > 1:
      b = rows[f"{g} {modes[-1]}"]
      for mode in modes[:-1]:
        a = rows[f"{g} {mode}"]
        for what, k in (("dispatch wall", 1), ("dispatch CPU", 2), ("step", 3)):
          med = statistics.median(x[k] for x in a) / statistics.median(x[k] for x in b)
          per_round = statistics.median(x[k] / y[k] for x, y in zip(a, b, strict=True))
          print(f"{'':5} {mode}/{modes[-1]} {what}: {med:.3f} (per round {per_round:.3f})")
      equal = all([x[0] for x in rows[f"{g} {m}"]] == [x[0] for x in b] for m in modes)
      print(f"{'':5} losses bitwise equal across modes: {equal}")
  key = f"8x1_{modes[-1]}"
  if f"8x1 {modes[-1]}" in trainers:
    figures["host_cpu_ms_per_op_8x1"] = figures[f"{key}_dispatch_cpu_ms_per_op"]
    figures["args_per_op_8x1"] = round(arrays[f"8x1 {modes[-1]}"] / ops_of(trainers[
      f"8x1 {modes[-1]}"]), 1)
    if "2x4 serial" in trainers:
      two = figures[f"2x4_{modes[-1]}_dispatch_cpu_ms_per_op"]
      figures["host_cpu_8x1_over_2x4"] = round(figures[f"{key}_dispatch_cpu_ms_per_op"] / two, 3)
    if args.deep:  # the same model with more layers: the arrays a program passes per op
      deep = argparse.Namespace(**{**vars(overhead_args),
                                   "layers": cfg.model.num_layers * args.deep})
      with tempfile.TemporaryDirectory(prefix="dispatch_") as workdir:
        trainer = Trainer(make_cfg(deep, 8, 1), workdir, devices=jax.devices(), log=lambda _: None)
        trainer.run_step(1)
        figures[f"args_per_op_8x1_{args.deep}x_layers"] = round(
          arrays_per_op(trainer, 2) / ops_of(trainer), 1)
    for name in ("host_cpu_ms_per_op_8x1", "host_cpu_8x1_over_2x4", "args_per_op_8x1",
                 f"args_per_op_8x1_{args.deep}x_layers"):
      if name in figures:
        print(f"{name}: {figures[name]}")
  record("dispatch", figures)


def ops_of(trainer) -> int:
  return sum(len(s.ops) for s in trainer.interpreter.step_program.slots.values())


def arrays_per_op(trainer, step: int) -> int:
  """Arrays passed into and out of the library's compiled programs in one more step (JAX's call
  costs host time per array)."""
  import jax

  try:
    from resilient_jax.programs import compiled
  except ImportError:  # --tree: an older checkout
    return 0
  seen = [0]
  real = compiled.OnEachDevice.__call__

  def counting(self, *a):
    out = real(self, *a)
    seen[0] += len(jax.tree.leaves(a)) + len(jax.tree.leaves(out))
    return out

  compiled.OnEachDevice.__call__ = counting
  try:
    trainer.run_step(step)
  finally:
    compiled.OnEachDevice.__call__ = real
  return seen[0]


if __name__ == "__main__":
  main()
