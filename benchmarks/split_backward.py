"""Split backward (B + W) against a true fused backward, for one middle stage of a GPT or a
Llama-style model built from stock nnx layers (the split is derived automatically from the
stage's backward, `resilient_jax.model.split`).

Run:
  python benchmarks/split_backward.py --model=gpt --d_model=256 --layers=4 --seq_len=128 --batch=8
  python benchmarks/split_backward.py --model=llama
  python benchmarks/split_backward.py --model=gpt --with_3d   # also the old, slow 3-D baseline

Times, interleaved and repeated (medians):
  - B: `StagePrograms.backward_input` (input gradient, and what W needs of B's work);
  - W: `StagePrograms.backward_weight` (the rest of the backward, from a zero accumulator);
  - fused: the bwd half of `jax.fwd_and_bwd` of the plain stage function w.r.t. (params, x):
    the baseline a pipeline without split backward would run. It shares the model, whose
    dense layers run on 2-D `[tokens, features]` (`models.gpt.tokens`): the fastest plain form
    on XLA:CPU, whose backward of the 3-D product is 1.3-1.6x slower per stage (figures before
    2026-11-24 in docs/benchmarks.md's history were against that slower baseline);
  - BW: `StagePrograms.backward_fused` (B then W in one program, what 1F1B runs);
  - F split (`StagePrograms.forward`) against F plain (the fwd half of the same fwd_and_bwd).

Every program is timed twice per call: wall time, and the CPU time of this process
(`time.process_time`: every thread's), with the minor page faults per call. On a host shared
with other jobs, wall time stretches with the load (Llama's fused backward: 40 ms at load 1,
110-440 ms at load 5-15) while CPU time moves a few percent; both ratios are printed.
Two diagnostics locate what the split costs beyond the fused backward:
  - B without hand-over: B returning dx only (XLA keeps the cotangents W would read in its
    temporaries): t(B) minus this is what writing the hand-over costs B;
  - W beyond BW: t(W) minus (t(BW) - t(B)): what W costs alone beyond W inside one program
    with B, i.e. reading the hand-over back from memory instead of from cache.
A third times B then W as a pair, W reading the hand-over B has just written (fresh buffers,
as a pipeline hands them over; `W` alone re-reads the same buffers call after call).

Memory comes from `compiled.memory_analysis()` and the byte sizes of the live buffers: what is
held from F until the backward (deduplicated by buffer, parameters excluded) plus the backward
programs' temporaries and outputs. Parameters and gradient accumulators are the same on both
paths and are left out. Finally B + W's gradients are compared with the fused ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402

TARGET_RATIO = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4, help="transformer blocks in the stage")
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--batch", type=int, default=8, help="micro-batch size")
  p.add_argument("--heads", type=int, default=0, help="attention heads (0: d_model // 64)")
  p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (median taken)")
  p.add_argument("--inner", type=int, default=0, help="calls per timing (0: auto, ~0.2 s)")
  p.add_argument("--with_3d", action="store_true",
                 help="also time the fused backward with the dense layers on 3-D activations "
                      "(the slow form the baseline had before 2026-11-24)")
  return p.parse_args(argv)


def nbytes(tree, exclude: set[int] = frozenset()) -> int:
  """Bytes of the distinct device buffers in `tree`, skipping buffers whose pointer is excluded."""
  import jax

  seen: set[int] = set(exclude)
  total = 0
  for leaf in jax.tree.leaves(tree):
    ptr = leaf.unsafe_buffer_pointer()
    if ptr not in seen:
      seen.add(ptr)
      total += leaf.nbytes
  return total


def pointers(tree) -> set[int]:
  import jax

  return {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)}


def time_interleaved(
  fns: dict[str, Callable[[], object]], repeats: int, inner: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
  """Per-call wall seconds, process CPU seconds and minor page faults of each fn: `repeats`
  rounds, each timing every fn (rotating the order)."""
  import resource

  import jax

  names = list(fns)
  wall: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  faults: dict[str, list[float]] = {n: [] for n in names}
  for r in range(repeats):
    order = names[r % len(names) :] + names[: r % len(names)]
    for n in order:
      fn = fns[n]
      jax.block_until_ready(fn())
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0, c0 = time.perf_counter(), time.process_time()
      for _ in range(inner):
        res = fn()
      jax.block_until_ready(res)
      wall[n].append((time.perf_counter() - t0) / inner)
      cpu[n].append((time.process_time() - c0) / inner)
      faults[n].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / inner)
  return wall, cpu, faults


def lower(program, *args):
  """`program.lower(*args)` (a `jax.jit` or a stage's `compiled.OnEachDevice`)."""
  return program.lower(*args)


def fused_3d_backward(prog, params, x, g):
  """The fused backward (jitted bwd of `jax.fwd_and_bwd`) traced with the models' dense layers
  applied to 3-D activations directly; returns it and its residuals. Only for the comparison:
  the models use the 2-D form (`models.gpt.tokens`)."""
  import jax

  # The modules the library builds its models from (`models/` installed under this name).
  from resilient_jax.examples import gpt, llama

  fwd, bwd = jax.fwd_and_bwd(lambda p, x: prog.apply_stage(p, x), argnums=(0, 1), jitted=False)
  fwd, bwd = jax.jit(fwd), jax.jit(bwd)
  saved = gpt.tokens, llama.tokens
  # jit traces on the first call: patch the helper for that call only.
  gpt.tokens = llama.tokens = lambda layer, a: layer(a)
  try:
    _, res = fwd(params, x)
    jax.block_until_ready(bwd(res, g))
  finally:
    gpt.tokens, llama.tokens = saved
  return bwd, res


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  runtime_setup.configure_jax(1)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from resilient_jax.programs.stages import StageInfo, StagePrograms
  from resilient_jax.spec.model import family

  heads = args.heads or max(args.d_model // 64, 1)
  keys = dict(vocab_size=256, seq_len=args.seq_len, num_layers=3 * args.layers, num_heads=heads,
              d_model=args.d_model)
  if args.model == "llama":
    keys["num_kv_heads"] = max(heads // 2, 1)
  cfg = family(args.model)(**keys)
  model = cfg.build(0)
  info = StageInfo(index=1, num_stages=3, layers=range(args.layers, 2 * args.layers))
  x_spec = jax.ShapeDtypeStruct((args.batch, args.seq_len, args.d_model), jnp.float32)
  t_spec = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
  prog = StagePrograms(model, info, x_spec, t_spec, optax.sgd(1e-3), args.batch)
  dev = jax.devices()[0]
  params = prog.initial_params(dev)
  kx, kg = jax.random.split(jax.random.key(1))
  x = jax.device_put(jax.random.normal(kx, x_spec.shape, x_spec.dtype), dev)
  g = jax.device_put(jax.random.normal(kg, x_spec.shape, x_spec.dtype), dev)

  # The baseline: the plain stage function, differentiated as a whole.
  fwd, bwd = jax.fwd_and_bwd(lambda p, x: prog.apply_stage(p, x), argnums=(0, 1), jitted=False)
  fused_fwd, fused_bwd = jax.jit(fwd), jax.jit(bwd)

  def bwd_acc(res, g, acc):
    dparams, dx = bwd(res, g)
    return dx, {n: acc[n] + v for n, v in dparams.items()}

  # What a pipeline without the split runs per micro-batch: the fused backward, accumulating
  # into the step's gradients (W and BW accumulate too).
  fused_acc_bwd = jax.jit(bwd_acc, donate_argnums=(2,))

  # Compile everything and produce the inputs of each backward.
  out_t, residuals, saved = prog.forward(params, x, None)
  dx_b, taps = prog.backward_input(residuals, g)
  grads_w = prog.backward_weight(params, saved, taps, prog.zero_grads(params, dev))
  out_p, fused_res = fused_fwd(params, x)
  dparams_f, dx_f = fused_bwd(fused_res, g)
  jax.block_until_ready((grads_w, dparams_f, dx_f))
  if args.with_3d:
    fused_bwd_3d, fused_res_3d = fused_3d_backward(prog, params, x, g)

  # --- correctness: B + W against the fused backward
  diff_out = float(jnp.max(jnp.abs(out_t - out_p)))
  diff_dx = float(jnp.max(jnp.abs(dx_b - dx_f)))
  diff_w = max(float(jnp.max(jnp.abs(grads_w[n] - dparams_f[n]))) for n in prog.param_names)
  scale_w = max(float(jnp.max(jnp.abs(dparams_f[n]))) for n in prog.param_names)

  # --- timing
  acc = [prog.zero_grads(params, dev)]

  def run_w():
    acc[0] = prog.backward_weight(params, saved, taps, acc[0])  # accumulates; acc is donated
    return acc[0]

  acc_f = [prog.zero_grads(params, dev)]

  def run_fused_acc():
    dx, acc_f[0] = fused_acc_bwd(fused_res, g, acc_f[0])
    return dx, acc_f[0]

  def run_bw():
    dx, acc[0] = prog.backward_fused(residuals, saved, params, g, acc[0])
    return dx, acc[0]

  acc_p = [prog.zero_grads(params, dev)]

  def run_b_then_w():
    _, handover = prog.backward_input(residuals, g)
    acc_p[0] = prog.backward_weight(params, saved, handover, acc_p[0])
    return acc_p[0]

  # B returning dx only: the cotangents it would hand over stay XLA temporaries.
  b_no_handover = jax.jit(lambda r, g: prog.split.backward_input(r, [g])[0][0])
  fns = {
    "B": lambda: prog.backward_input(residuals, g),
    "B_no_handover": lambda: b_no_handover(residuals, g),
    "W": run_w,
    "fused": lambda: fused_bwd(fused_res, g),
    "fused_acc": run_fused_acc,
    "BW": run_bw,
    "B_then_W": run_b_then_w,
    "F_split": lambda: prog.forward(params, x, None),
    "F_plain": lambda: fused_fwd(params, x),
  }
  if args.with_3d:
    fns["fused_3d"] = lambda: fused_bwd_3d(fused_res_3d, g)
  inner = args.inner
  if inner <= 0:
    probe = time_interleaved({"fused": fns["fused"]}, 1, 2)[0]["fused"][0]
    inner = max(2, min(100, round(0.2 / max(probe, 1e-6))))
  times, cpu_times, faults = time_interleaved(fns, args.repeats, inner)
  med = {n: statistics.median(v) for n, v in times.items()}
  # The ratio per round (the five programs of a round ran within moments of each other) is
  # more robust to the shared cores' load than the ratio of medians; both are printed.
  round_ratios = [
    (b + w) / f for b, w, f in zip(times["B"], times["W"], times["fused"], strict=True)
  ]

  # --- memory
  p_ptrs = pointers(params)
  held_split = nbytes((residuals, saved), p_ptrs)
  held_res_only = nbytes(residuals, p_ptrs)
  held_saved_only = nbytes(saved, p_ptrs | pointers(residuals))
  held_fused = nbytes(fused_res, p_ptrs)
  mem = {
    "B": lower(prog.backward_input, residuals, g).compile().memory_analysis(),
    "W": lower(prog.backward_weight, params, saved, taps, acc[0]).compile().memory_analysis(),
    "fused": fused_bwd.lower(fused_res, g).compile().memory_analysis(),
  }
  # Of what the fused path holds: copies of parameters (jit returns residuals that are inputs
  # as fresh copies) and residuals its bwd never reads (XLA prunes them from the bwd only).
  by_shape: dict[tuple, list] = {}
  for v in params.values():
    by_shape.setdefault(v.shape, []).append(v)
  fused_param_copies = sum(
    leaf.nbytes
    for leaf in jax.tree.leaves(fused_res)
    if any(bool(jnp.array_equal(leaf, v)) for v in by_shape.get(leaf.shape, []))
  )
  fused_unread = held_fused - (mem["fused"].argument_size_in_bytes - g.nbytes)
  taps_bytes = nbytes(taps)
  dx_bytes = dx_b.nbytes
  # Split: during B everything F kept is live, plus B's temporaries and outputs (dx, taps);
  # during W the residuals are gone but `saved` and the taps are live, plus W's temporaries.
  split_during_b = held_split + mem["B"].temp_size_in_bytes + dx_bytes + taps_bytes
  split_during_w = nbytes(saved, p_ptrs) + taps_bytes + mem["W"].temp_size_in_bytes
  split_peak = max(split_during_b, split_during_w)
  # Fused: its residuals, its temporaries and dx (parameter gradients excluded on both paths).
  fused_peak = held_fused + mem["fused"].temp_size_in_bytes + dx_f.nbytes

  mib = 1 / 2**20
  print(
    f"{args.model} stage: {args.layers} blocks (middle stage), d_model={args.d_model}, "
    f"heads={heads}, "
    f"seq_len={args.seq_len}, batch={args.batch}; {jax.devices()[0].platform}, "
    f"{args.repeats} rounds x {inner} calls"
  )
  print(f"t(B)              {med['B'] * 1e3:9.2f} ms")
  print(f"t(W)              {med['W'] * 1e3:9.2f} ms")
  print(f"t(B)+t(W)         {(med['B'] + med['W']) * 1e3:9.2f} ms")
  print(f"t(fused)          {med['fused'] * 1e3:9.2f} ms")
  if args.with_3d:
    r3 = [a / b for a, b in zip(times["fused_3d"], times["fused"], strict=True)]
    print(f"t(fused, 3-D)     {med['fused_3d'] * 1e3:9.2f} ms   (dense layers on 3-D "
          f"activations: {med['fused_3d'] / med['fused']:.3f}x the 2-D fused backward, "
          f"per-round {statistics.median(r3):.3f}; (B+W)/this "
          f"{(med['B'] + med['W']) / med['fused_3d']:.3f})")
  ratio = (med["B"] + med["W"]) / med["fused"]
  flag = "ok" if ratio <= TARGET_RATIO else "ABOVE TARGET"
  print(
    f"(B+W)/fused       {ratio:9.3f}   (median of per-round ratios "
    f"{statistics.median(round_ratios):.3f}; target <= {TARGET_RATIO}: {flag})"
  )
  acc_ratio = (med["B"] + med["W"]) / med["fused_acc"]
  acc_rounds = [
    (b + w) / f for b, w, f in zip(times["B"], times["W"], times["fused_acc"], strict=True)
  ]
  print(f"t(fused+acc)      {med['fused_acc'] * 1e3:9.2f} ms   (fused backward accumulating "
        "into the step's gradients, as a pipeline runs it)")
  print(
    f"(B+W)/(fused+acc) {acc_ratio:9.3f}   (median of per-round ratios "
    f"{statistics.median(acc_rounds):.3f})"
  )
  print(f"t(BW program)      {med['BW'] * 1e3:9.2f} ms   (StagePrograms.backward_fused: B then W)")
  print(f"t(F split)       {med['F_split'] * 1e3:9.2f} ms")
  print(f"t(F plain)        {med['F_plain'] * 1e3:9.2f} ms")
  f_rounds = [t / p for t, p in zip(times["F_split"], times["F_plain"], strict=True)]
  print(
    f"F split/plain    {med['F_split'] / med['F_plain']:9.3f}   "
    f"(median of per-round ratios {statistics.median(f_rounds):.3f})"
  )
  cpu = {n: statistics.median(v) for n, v in cpu_times.items()}

  def cpu_ratio(parts: tuple[str, ...], base: str) -> str:
    rounds = [sum(cpu_times[p][r] for p in parts) / cpu_times[base][r]
              for r in range(args.repeats)]
    return (f"{sum(cpu[p] for p in parts) / cpu[base]:.3f} (median of per-round ratios "
            f"{statistics.median(rounds):.3f})")

  print("CPU time per call (every thread of this process; moves little with the host's load):")
  print("  " + ", ".join(f"{n} {cpu[n] * 1e3:.2f} ms" for n in
                         ("B", "W", "fused", "fused_acc", "BW", "B_no_handover")))
  print(f"  (B+W)/fused {cpu_ratio(('B', 'W'), 'fused')}; (B+W)/(fused+acc) "
        f"{cpu_ratio(('B', 'W'), 'fused_acc')}; BW/fused {cpu_ratio(('BW',), 'fused')}")
  print(f"  B writing the hand-over: t(B) - t(B without hand-over) = "
        f"{(cpu['B'] - cpu['B_no_handover']) * 1e3:.2f} ms CPU "
        f"({(med['B'] - med['B_no_handover']) * 1e3:.2f} ms wall)")
  print(f"  W reading it back: t(W) - (t(BW) - t(B)) = "
        f"{(cpu['W'] - cpu['BW'] + cpu['B']) * 1e3:.2f} ms CPU "
        f"({(med['W'] - med['BW'] + med['B']) * 1e3:.2f} ms wall)")
  print(f"  B then W (W reading the hand-over B has just written): {cpu['B_then_W'] * 1e3:.2f} ms "
        f"CPU; (B then W)/fused {cpu_ratio(('B_then_W',), 'fused')}")
  print("  minor page faults per call: " + ", ".join(
    f"{n} {statistics.median(faults[n]):.0f}" for n in ("B", "W", "fused", "BW", "B_then_W")))
  print("memory (MiB; parameters and gradient accumulators excluded):")
  print(
    f"  split: held F->B/W {held_split * mib:.2f} (residuals {held_res_only * mib:.2f} + "
    f"saved not already in residuals {held_saved_only * mib:.2f}), "
    f"B temp {mem['B'].temp_size_in_bytes * mib:.2f}, W temp "
    f"{mem['W'].temp_size_in_bytes * mib:.2f}, B->W hand-over {taps_bytes * mib:.2f}"
  )
  print(
    f"  fused: held F->BW {held_fused * mib:.2f} (of which parameter copies "
    f"{fused_param_copies * mib:.2f}, never read by bwd {fused_unread * mib:.2f}), bwd temp "
    f"{mem['fused'].temp_size_in_bytes * mib:.2f}"
  )
  print(
    f"  peak split {split_peak * mib:.2f} ({split_peak} B; during B {split_during_b * mib:.2f}, "
    f"during W {split_during_w * mib:.2f}), peak fused {fused_peak * mib:.2f} ({fused_peak} B), "
    f"split/fused {split_peak / fused_peak:.3f}"
  )
  print(
    f"max |diff| vs fused: output {diff_out:.3g}, dx {diff_dx:.3g}, "
    f"param grads {diff_w:.3g} (largest grad {scale_w:.3g})"
  )
  np.testing.assert_allclose(np.asarray(dx_b), np.asarray(dx_f), rtol=1e-4, atol=1e-5)
  record(f"split_backward_{args.model}", {
    "b_plus_w_over_fused": round(ratio, 3), "b_plus_w_over_fused_acc": round(acc_ratio, 3),
    "f_split_over_plain": round(med["F_split"] / med["F_plain"], 3),
    "cpu_b_plus_w_over_fused": round((cpu["B"] + cpu["W"]) / cpu["fused"], 3),
    "cpu_bw_over_fused": round(cpu["BW"] / cpu["fused"], 3),
    "peak_split_over_fused": round(split_peak / fused_peak, 3)})


if __name__ == "__main__":
  main()
