"""One pipeline stage on a sub-mesh of `tp` devices against the same stage on one device.

Run:
  python benchmarks/tensor_parallel.py                      # GPT middle stage, tp=2 vs tp=1
  python benchmarks/tensor_parallel.py --model=llama --tp=2 --d_model=512

Times, interleaved and repeated (medians), the stage's work of one step: `--microbatches`
forwards and fused backwards (`StagePrograms.forward`, `backward_fused`, what 1F1B runs) and
one optimizer step, on one device and on a `tp`-device sub-mesh (`mesh.tp`), plus each op
alone. Also prints the parameter bytes each device holds (what tensor parallelism is for: a
stage larger than one device) and checks that both give the same gradients.

On simulated CPU devices (`--xla_force_host_platform_device_count`) the `tp` devices share the
machine's cores with everything else, and their collectives are memory copies: the ratio shows
the partitioning's overhead on one host, not a speed-up. The load average is printed.
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
from benchmarks.split_backward import time_interleaved  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
  p.add_argument("--tp", type=int, default=2, help="devices of the sub-mesh")
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--layers", type=int, default=2, help="transformer blocks in the stage")
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--batch", type=int, default=4, help="micro-batch size")
  p.add_argument("--microbatches", type=int, default=4)
  p.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median taken)")
  p.add_argument("--inner", type=int, default=2, help="stage steps per timing")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if args.tp < 2:
    sys.exit("error: --tp must be at least 2")
  runtime_setup.configure_jax(1 + args.tp)

  import jax
  import numpy as np
  import optax

  from resilient_jax.model.sharding import target, worker_mesh
  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.spec.model import family

  devices = jax.devices()
  if len(devices) < 1 + args.tp:
    sys.exit(f"error: needs {1 + args.tp} devices, found {len(devices)}")
  heads = max(args.d_model // 64, args.tp)
  keys = dict(vocab_size=256, seq_len=args.seq_len, num_layers=3 * args.layers, num_heads=heads,
              d_model=args.d_model)
  if args.model == "llama":
    keys["num_kv_heads"] = max(heads // 2, args.tp)
  model = family(args.model)(**keys).build(0)
  layers = [range(i * args.layers, (i + 1) * args.layers) for i in range(3)]
  optimizer = optax.adamw(1e-3)
  runs = {}
  for tp, where in ((1, devices[0]), (args.tp, target(worker_mesh(devices[1:1 + args.tp])))):
    prog = build_stage_programs(model, layers, args.batch, args.seq_len, optimizer,
                                args.batch * args.microbatches, tp=tp)[1]  # the middle stage
    params = prog.initial_params(where)
    opt = prog.init_opt_state(params, where)
    owned = prog.norm_weights(prog.param_names, where)
    rng = np.random.default_rng(0)  # the same inputs on both
    xs = [jax.device_put(rng.normal(size=prog.input_spec.shape).astype(np.float32), where)
          for _ in range(args.microbatches)]
    gs = [jax.device_put(rng.normal(size=prog.output_spec.shape).astype(np.float32), where)
          for _ in range(args.microbatches)]

    def step(prog=prog, params=params, opt=opt, owned=owned, xs=xs, gs=gs, where=where):
      acc = prog.zero_grads(params, where)
      for x, g in zip(xs, gs, strict=True):
        _, res, saved = prog.forward(params, x, None)
        _, acc = prog.backward_fused(res, saved, params, g, acc)
      return prog.optimizer_step(params, opt, acc, owned), acc

    runs[tp] = (prog, params, step)
    jax.block_until_ready(step())  # compile

  one, many = runs[1], runs[args.tp]
  (_, _, sumsq1), grads1 = one[2]()
  (_, _, sumsq2), grads2 = many[2]()
  worst = max(float(np.max(np.abs(np.asarray(grads1[n]) - np.asarray(grads2[n]))) /
                    max(float(np.max(np.abs(np.asarray(grads1[n])))), 1e-30))
              for n in grads1)

  load_before = os.getloadavg()
  times = time_interleaved({"tp=1": one[2], f"tp={args.tp}": many[2]}, args.repeats,
                           args.inner)
  load_after = os.getloadavg()
  med = {n: statistics.median(v) for n, v in times.items()}
  rounds = [b / a for a, b in zip(times["tp=1"], times[f"tp={args.tp}"], strict=True)]

  def per_device(params) -> int:
    return max(sum(s.data.nbytes for v in params.values() for s in v.addressable_shards
                   if s.device == d) for d in {s.device for v in params.values()
                                                for s in v.addressable_shards})

  split = sum(1 for s in many[0].param_specs.values() if any(a is not None for a in s))
  mib = 1 / 2**20
  print(f"{args.model} middle stage: {args.layers} blocks, d_model={args.d_model}, "
        f"heads={heads}, seq_len={args.seq_len}, micro-batch {args.batch} x "
        f"{args.microbatches}; {devices[0].platform} ({len(devices)} devices), "
        f"{args.repeats} rounds x {args.inner} steps")
  print(f"t(stage step, tp=1)      {med['tp=1'] * 1e3:9.2f} ms")
  print(f"t(stage step, tp={args.tp})      {med[f'tp={args.tp}'] * 1e3:9.2f} ms")
  print(f"tp={args.tp} / tp=1              {med[f'tp={args.tp}'] / med['tp=1']:9.3f}   (median "
        f"of per-round ratios {statistics.median(rounds):.3f})")
  print(f"parameters per device    {per_device(one[1]) * mib:9.2f} MiB (tp=1)  "
        f"{per_device(many[1]) * mib:.2f} MiB (tp={args.tp}; {split} of "
        f"{len(many[0].param_specs)} parameters split)")
  print(f"gradients tp={args.tp} vs tp=1   max relative difference {worst:.2e}; squared norm "
        f"{float(sumsq2):.6g} vs {float(sumsq1):.6g}")
  print(f"load average {' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in load_after)} after, on {os.cpu_count()} cores"
        + (f"; the {len(devices)} simulated devices share them" if devices[0].platform == "cpu"
           else ""))
  record(f"tensor_parallel_{args.model}_tp{args.tp}", {
    "stage_step_tp1_ms": round(med["tp=1"] * 1e3, 2),
    f"stage_step_tp{args.tp}_ms": round(med[f"tp={args.tp}"] * 1e3, 2),
    f"tp{args.tp}_over_tp1": round(med[f"tp={args.tp}"] / med["tp=1"], 3),
    "params_per_device_tp1_mib": round(per_device(one[1]) * mib, 2),
    f"params_per_device_tp{args.tp}_mib": round(per_device(many[1]) * mib, 2),
    "grad_max_relative_difference": worst})


if __name__ == "__main__":
  main()
