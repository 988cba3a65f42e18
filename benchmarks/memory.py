"""Activation memory per stage with and without rematerialisation, and what it costs in time.

Run:
  python benchmarks/memory.py --steps=8

Builds configs/gpt_tiny.py made deeper and wider (8 layers, d_model=128, seq_len=128 by
default) on a dp=1 x pp=2 grid of simulated CPU devices, once per `model.remat` setting
(`none`, `full`, ...), and prints per stage and setting:
  - `act/mb`: the bytes a micro-batch's forward leaves alive until its backward
    (`StagePrograms.activation_bytes`: the residuals B and W read, the stage input included);
  - `in-flight`: the schedule's most micro-batches between F and W on the stage's worker
    (`schedule.validate.peak_inflight`), and `act peak` = `act/mb` x `in-flight`;
  - `temp F/B/W`: the scratch bytes XLA's compiled memory analysis gives each program
    (`Compiled.memory_analysis().temp_size_in_bytes`), whose largest adds to the peak;
  - `weights`: parameters, gradient accumulator and AdamW's two moments (4 x the parameters);
  - `peak`: weights + act peak + the largest temp: the stage's device memory at its fullest.
Then the step time per setting, steps interleaved across settings (medians), and one line with
the ratios against `none` (peak bytes of the fullest stage, step time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--remat", default="none,full", help="settings to compare, none first")
  p.add_argument("--schedule", default="zb-h1")
  p.add_argument("--pp", type=int, default=2)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--global_batch", type=int, default=32)
  p.add_argument("--microbatches", type=int, default=8)
  p.add_argument("--steps", type=int, default=8, help="timed steps per setting")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
  return p.parse_args(argv)


def make_cfg(args: argparse.Namespace, remat: str):
  from configs.gpt_tiny import get_config
  from resilient_jax.config import from_config_dict

  cd = get_config()
  cd.model.update(num_layers=args.layers, d_model=args.d_model, seq_len=args.seq_len,
                  num_heads=4, remat=remat)
  cd.mesh.update(dp=1, pp=args.pp)
  cd.pipeline.update(schedule=args.schedule, microbatches=args.microbatches)
  cd.train.global_batch = args.global_batch
  return from_config_dict(cd)


def build(cfg):
  """The stage programs, an interpreter of the configured schedule, and its data."""
  import jax

  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.recipe import make_data, make_model, make_optimizer
  from resilient_jax.runtime.interpreter import Interpreter
  from resilient_jax.runtime.transport import Transport
  from resilient_jax.schedule.generators import generate
  from resilient_jax.schedule.plan import GridPlan

  programs = build_stage_programs(
    make_model(cfg), cfg.partition, cfg.microbatch_size, cfg.model.seq_len,
    make_optimizer(cfg), cfg.train.global_batch, remat=cfg.model.remat)
  pp = cfg.mesh.pp
  schedule = generate(cfg.pipeline.schedule, 1, pp, cfg.pipeline.microbatches)
  split = tuple((r.start, r.stop) for r in cfg.partition)
  plan = GridPlan(schedule, split, {(0, s): s for s in range(pp)})
  transport = Transport(dict(enumerate(jax.devices()[:pp])))
  source, data = make_data(cfg)
  return programs, schedule, Interpreter(lambda _: programs, transport, plan), source, data


def temp_bytes(programs, cfg) -> list[tuple[int, int, int]]:
  """Per stage, the compiled scratch bytes of F, B and W on one micro-batch (lowered on the
  values of one forward, run on the default device)."""
  import jax
  import jax.numpy as jnp

  out = []
  device = jax.devices()[0]
  x = tokens = jax.device_put(jnp.zeros((cfg.microbatch_size, cfg.model.seq_len), jnp.int32),
                              device)
  for prog in programs:
    params = prog.initial_params(device)
    y, res, saved = prog.forward(params, x, tokens)
    g = jnp.ones_like(y)
    _, handover = prog.backward_input(res, g)
    forward_program = prog.compiled_programs()[0]
    inputs = jax.tree.leaves((params, x, tokens if prog.info.last else None))
    compiled = [forward_program.lower(*inputs).compile(),
                prog.backward_input.lower(res, g).compile(),
                prog.backward_weight.lower(params, saved, handover,
                                           prog.zero_grads(params, device)).compile()]
    out.append(tuple(int(c.memory_analysis().temp_size_in_bytes) for c in compiled))
    x = y
  return out


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  runtime_setup.configure_jax(args.pp)

  import numpy as np

  from resilient_jax.recipe import step_data
  from resilient_jax.schedule.validate import peak_inflight

  settings = [s.strip() for s in args.remat.split(",") if s.strip()]
  runs = {r: (make_cfg(args, r), *build(make_cfg(args, r))) for r in settings}
  cfg0 = runs[settings[0]][0]
  m = cfg0.model
  print(f"configs/gpt_tiny.py: layers={m.num_layers}, d_model={m.d_model}, seq_len={m.seq_len}, "
        f"heads={m.num_heads}; micro-batch {cfg0.microbatch_size} x {args.microbatches} per "
        f"step; dp=1 x pp={args.pp}, {args.schedule}; {os.cpu_count()} cores")
  print(f"{'remat':>14} {'stage':>5} {'act/mb':>10} {'in-flight':>9} {'act peak':>11} "
        f"{'temp F/B/W':>26} {'weights':>11} {'peak':>11}")
  peaks = {}
  for r in settings:
    cfg, programs, schedule, *_ = runs[r]
    temps = temp_bytes(programs, cfg)
    peaks[r] = []
    for s, prog in enumerate(programs):
      inflight = peak_inflight(schedule.ops[(0, s)])
      act = prog.activation_bytes * inflight
      weights = 4 * sum(int(np.prod(v.shape)) * v.dtype.itemsize
                        for v in prog.abstract_params().values())
      peak = weights + act + max(temps[s])
      peaks[r].append(peak)
      print(f"{r:>14} {s:>5} {prog.activation_bytes:>10,} {inflight:>9} {act:>11,} "
            f"{'/'.join(f'{t:,}' for t in temps[s]):>26} {weights:>11,} {peak:>11,}")

  def step(r: str, t: int) -> float:
    cfg, _, _, interp, source, plan = runs[r]
    _, batch = step_data(cfg, source, plan, t)
    return interp.run_step(batch, step=t).step_time_s

  for t in range(1, args.warmup + 1):
    for r in settings:
      step(r, t)
  times: dict[str, list[float]] = {r: [] for r in settings}
  for i in range(args.steps):
    order = settings[i % len(settings):] + settings[: i % len(settings)]
    for r in order:
      times[r].append(step(r, args.warmup + 1 + i))
  base = settings[0]
  figures: dict[str, float] = {f"{r}_peak_bytes": max(peaks[r]) for r in settings}
  for r in settings:
    print(f"{r:>14} step {statistics.median(times[r]) * 1e3:8.1f} ms (median of {args.steps})")
    figures[f"{r}_step_ms"] = round(statistics.median(times[r]) * 1e3, 1)
  for r in settings[1:]:
    act = [p.activation_bytes for p in runs[r][1]]
    act0 = [p.activation_bytes for p in runs[base][1]]
    print(f"{r} vs {base}: activation bytes per micro-batch x"
          f"{'/'.join(f'{a / b:.3f}' for a, b in zip(act, act0, strict=True))} per stage, "
          f"peak bytes of the fullest stage x{max(peaks[r]) / max(peaks[base]):.3f}, "
          f"step time x{statistics.median(times[r]) / statistics.median(times[base]):.3f}")
    figures[f"{r}_peak_bytes_ratio"] = round(max(peaks[r]) / max(peaks[base]), 3)
    figures[f"{r}_step_time_ratio"] = round(statistics.median(times[r])
                                            / statistics.median(times[base]), 3)
  record("memory", figures)


if __name__ == "__main__":
  main()
