"""An op's time against the samples it runs: the per-op fixed cost that prices pieces.

Sample-granular re-routing (`schedule.routing.split_route`) runs pieces of micro-batches, so
the cost model needs an op's time as a function of its samples: `t(n) = fixed_s +
per_sample_s * n`, whose fixed share at a whole micro-batch of `S` samples is `OpCosts.fixed`
(`fixed_s / t(S)`). This measures it for the stage programs a piece runs
(`StagePrograms.forward`, `backward_input` (B), `backward_weight` (W)) of one middle stage of
a GPT (stock nnx layers, as `benchmarks/split_backward.py` builds it), one program per batch
size (a piece of `n` samples is a program with batch `n`), timed interleaved (medians of CPU
time of this process, which moves a few percent with the load where wall time does not).
Prints per op the least-squares fit over the sizes and its fixed share at `--batch`, then
`fixed_share: X`, the share summed over F, B and W (what `OpCosts.fixed` takes).

Run:
  python benchmarks/piece_cost.py                       # GPT, d_model 256, 4 blocks, seq 128
  python benchmarks/piece_cost.py --d_model=512 --batch=8 --sizes=1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.split_backward import time_interleaved  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
  """Least-squares `(intercept, slope)` of `ys` on `xs`."""
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
    (x - mx) ** 2 for x in xs)
  return my - slope * mx, slope


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--batch", type=int, default=8, help="samples in a whole micro-batch")
  p.add_argument("--sizes", default="1,2,4,8", help="piece sizes (samples) to time")
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--inner", type=int, default=3)
  args = p.parse_args(argv)
  runtime_setup.configure_jax(1)

  import jax
  import jax.numpy as jnp
  import optax
  from resilient_jax.model.config import family

  from resilient_jax.model.check import token_batch
  from resilient_jax.programs.shared import build_stage_programs

  heads = max(args.d_model // 64, 1)
  cfg = family("gpt")(vocab_size=256, seq_len=args.seq_len, num_layers=3 * args.layers,
                      num_heads=heads, d_model=args.d_model)
  model = cfg.build(0)
  split = [range(i * args.layers, (i + 1) * args.layers) for i in range(3)]
  dev = jax.devices()[0]
  sizes = [int(n) for n in args.sizes.split(",")]
  fns = {}
  compile_s = {}
  for n in sizes:
    # One middle stage's programs for a micro-batch of n samples: a piece's programs. Every
    # stage of the split is built (and compiled) for it: what a job would add per piece size.
    c0 = time.process_time()
    prog = build_stage_programs(model, split, token_batch(args.seq_len, n), optax.sgd(1e-3),
                                n)[1]
    params = prog.initial_params(dev)
    kx, kg = jax.random.split(jax.random.key(n))
    spec = prog.input_spec
    x = jax.device_put(jax.random.normal(kx, spec.shape, spec.dtype), dev)
    batch = {k: jnp.zeros(prog.batch_specs[k].shape, prog.batch_specs[k].dtype)
             for k in prog.batch_keys}
    out, residuals, saved = prog.forward(params, x, batch)
    g = jax.tree.map(lambda a, k=kg: jax.random.normal(k, a.shape, a.dtype), out)
    _, handover = prog.backward_input(residuals, g)
    acc = {"grads": prog.zero_grads(params, dev)}  # W donates its accumulator: chained
    jax.block_until_ready(prog.backward_weight(params, saved, handover, acc["grads"]))
    acc["grads"] = prog.zero_grads(params, dev)
    compile_s[n] = time.process_time() - c0

    def weight(prog=prog, params=params, saved=saved, h=handover, acc=acc):
      acc["grads"] = prog.backward_weight(params, saved, h, acc["grads"])
      return acc["grads"]

    fns[("F", n)] = lambda prog=prog, params=params, x=x, b=batch: prog.forward(params, x, b)
    fns[("B", n)] = lambda prog=prog, r=residuals, g=g: prog.backward_input(r, g)
    fns[("W", n)] = weight
  _, cpu, _ = time_interleaved(fns, args.repeats, args.inner)
  med = {k: statistics.median(v) for k, v in cpu.items()}
  print(f"GPT stage of {args.layers} blocks, d_model {args.d_model}, seq {args.seq_len}; CPU ms "
        f"per call (median of {args.repeats}) at {sizes} samples; fit t(n) = fixed + per_sample*n")
  total_fixed = total_whole = 0.0
  for kind in ("F", "B", "W"):
    ys = [med[(kind, n)] * 1e3 for n in sizes]
    a, b = fit([float(n) for n in sizes], ys)
    whole = a + b * args.batch
    total_fixed += a
    total_whole += whole
    print(f"  {kind}: " + " ".join(f"{y:7.2f}" for y in ys)
          + f"   fixed {a:6.2f} ms + {b:6.2f} ms/sample: {a / whole:.3f} of a "
          f"{args.batch}-sample op")
  print("building and compiling every stage's programs for a piece size (CPU s): "
        + ", ".join(f"{n} samples {t:.1f}" for n, t in compile_s.items()))
  print(f"fixed_share: {total_fixed / total_whole:.3f}")


if __name__ == "__main__":
  main()
