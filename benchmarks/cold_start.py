"""Cold start: time to the first finished step, and XLA compilations, library against plain JAX.

  python benchmarks/cold_start.py [--repeats=3] [--grids=1x1,2x1,1x2,2x2,4x2] [--warm] [--jax_cache]
  python benchmarks/cold_start.py --grids=4x2,4x4 --global_batch=64 [--before=/tmp/old]

Each measurement is a fresh Python process with an empty compilation cache (JAX's and the
library's `programs/` folder), simulated CPU devices, the tiny GPT config. With `--warm`, a
second process then runs the same variant on the cache the first one filled: the library on its
`programs/` folder, the plain variants on JAX's persistent compilation cache (with its
thresholds at zero, so every program is kept): a second identical run's start. With
`--jax_cache`, the library runs with JAX's persistent cache on as well (as a user who sets
`jax_compilation_cache_dir` has it), beside its own folder. It times from
building the step (model, programs, state) to the first step's updated parameters being ready,
and counts XLA compilations (`compiled.BuildCounter.xla`: every backend compile while it
counts). The variants of `benchmarks/overhead.py` run the same work:

  - library: `Trainer` + `run_step` on dp x pp devices (1F1B);
  - plain-dp: one `jax.jit` of value_and_grad + optax, micro-batches accumulated in the jit
    (`unrolled`), the batch sharded over dp x pp devices: the plain form of the same training
    when the model fits one device;
  - plain-pipeline (pp = 2 only): a plain two-device GPipe, jitted per stage.

  - library-before (`--before=TREE`): the library of another checkout, the same way.

Compilation runs on the machine's cores, so the absolute times move with its load; the
repeats of each variant are interleaved (variant order rotates per repeat), medians reported,
with the process's CPU seconds beside the wall time (on a loaded machine the steadier figure;
the wall time is what a spare core can shorten, e.g. by loading programs beside the dispatch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = ROOT
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402

_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
from resilient_jax.runtime import setup as runtime_setup
runtime_setup.configure_jax(num_cpu_devices=max(8, {dp} * {pp}), cache_dir={cache!r})
import jax
# plain JAX at its best: its own persistent cache, every program kept (the library too with
# --jax_cache, as a user who sets jax_compilation_cache_dir runs it)
if not {variant!r}.startswith("library") or {jax_cache!r}:
  jax.config.update("jax_compilation_cache_dir", os.path.join({cache!r}, "jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from benchmarks import overhead
from resilient_jax.programs.compiled import BuildCounter
from jax._src import compiler
kernels = []
_compile = compiler.backend_compile_and_load
def counted(*a, **k):  # the fused kernels of every program XLA compiles
  out = _compile(*a, **k)
  try:
    kernels.append(sum(line.lstrip().startswith(("%fused_computation", "fused_computation"))
                       for m in out.hlo_modules() for line in m.to_string().splitlines()))
  except Exception:
    pass
  return out
compiler.backend_compile_and_load = counted
dp, pp, variant = {dp}, {pp}, {variant!r}
args = overhead.parse_args(["--steps=1", "--warmup=0", "--global_batch={global_batch}"])
t0, c0 = time.perf_counter(), time.process_time()
with BuildCounter().counting() as counts:
  if variant.startswith("library"):
    step = overhead.LibraryStep(overhead.make_cfg(args, dp, pp), jax.devices())
  elif variant == "plain-dp":
    step = overhead.PlainStep(overhead.make_cfg(args, dp * pp, 1), jax.devices(), form="unrolled")
  else:
    step = overhead.PlainPipeline(overhead.make_cfg(args, dp, pp), jax.devices())
  step(1)
print(json.dumps(dict(seconds=time.perf_counter() - t0, cpu=time.process_time() - c0,
                      xla=counts.xla, kernels=sum(kernels),
                      compiled=counts.compiled, loaded=counts.loaded)))
"""


def measure(dp: int, pp: int, variant: str, warm: bool, jax_cache: bool = False,
            global_batch: int = 0) -> dict:
  """The cold start of `variant` (and with `warm`, the second start on its cache)."""
  with tempfile.TemporaryDirectory(prefix="cold_") as cache:
    tree = BEFORE if variant == "library-before" else ROOT
    code = _CHILD.format(root=tree, cache=cache, dp=dp, pp=pp, variant=variant,
                         jax_cache=jax_cache, global_batch=global_batch)
    result = {}
    for run in ("cold", "warm") if warm else ("cold",):
      out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
      if out.returncode:
        raise RuntimeError(f"{variant} {dp}x{pp} ({run}) failed:\n{out.stderr[-3000:]}")
      result[run] = json.loads(out.stdout.strip().splitlines()[-1])
  return result


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--grids", default="1x1,2x1,1x2,2x2,4x2")
  p.add_argument("--warm", action="store_true", help="also time a second start on the cache")
  p.add_argument("--global_batch", type=int, default=0,
                 help="0: the config's (32); plain-dp at 4x4 (16 devices x 4 micro-batches) "
                      "needs 64")
  p.add_argument("--before", default="",
                 help="another checkout: its library runs too, interleaved (library-before)")
  p.add_argument("--jax_cache", action="store_true",
                 help="the library with JAX's persistent compilation cache on too")
  p.add_argument("--trace_layers", type=int, default=0,
                 help="only time tracing the loss and cutting it, for a model of this many "
                      "layers (no compile): the start-up share of the traced cut")
  args = p.parse_args(argv)
  if args.trace_layers:
    trace_and_cut(args.trace_layers, args.repeats)
    return
  global BEFORE
  BEFORE = os.path.abspath(args.before) if args.before else ROOT
  grids = [tuple(int(x) for x in g.split("x")) for g in args.grids.split(",")]
  cases = []
  for dp, pp in grids:
    cases += [(dp, pp, "library"), (dp, pp, "plain-dp")]
    if args.before:
      cases.append((dp, pp, "library-before"))
    if pp == 2 and dp == 1:
      cases.append((dp, pp, "plain-pipeline"))
  print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
  runs: dict[tuple, list[dict]] = {c: [] for c in cases}
  for r in range(args.repeats):
    for c in cases[r % len(cases):] + cases[:r % len(cases)]:
      runs[c].append(measure(*c, warm=args.warm, jax_cache=args.jax_cache,
                             global_batch=args.global_batch))
  print(f"load average at end: {os.getloadavg()[0]:.2f}")
  figures: dict[str, float | int] = {}
  for run in ("cold", "warm") if args.warm else ("cold",):
    print(f"\n{run} start (a fresh process{' on the cache the cold one filled' * (run == 'warm')})")
    print("| grid | variant | first step (median s) | CPU s (median) | XLA compilations | fused "
          "kernels compiled | stage programs compiled / loaded | library / plain-dp (wall, CPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for dp, pp, variant in cases:
      rs = [x[run] for x in runs[(dp, pp, variant)]]
      t = statistics.median(x["seconds"] for x in rs)
      cpu = statistics.median(x["cpu"] for x in rs)
      plain = statistics.median(x[run]["seconds"] for x in runs[(dp, pp, "plain-dp")])
      plain_cpu = statistics.median(x[run]["cpu"] for x in runs[(dp, pp, "plain-dp")])
      ratio = f"{t / plain:.2f}, {cpu / plain_cpu:.2f}" if variant.startswith("library") else ""
      own = f"{rs[0]['compiled']} / {rs[0]['loaded']}" if variant.startswith("library") else ""
      kernels = rs[0].get("kernels", "")
      print(f"| {dp}x{pp} | {variant} | {t:.2f} | {cpu:.2f} | {rs[0]['xla']} | {kernels} | "
            f"{own} | {ratio} |")
      key = f"{run}_{dp}x{pp}_{variant.replace('-', '_')}"
      figures.update({f"{key}_first_step_s": round(t, 2), f"{key}_cpu_s": round(cpu, 2),
                      f"{key}_xla_compilations": rs[0]["xla"], f"{key}_kernels": kernels})
  for dp, pp, variant in cases:  # the headline: the library's cold CPU, plain JAX's as 1
    if variant == "library":
      plain = statistics.median(x["cold"]["cpu"] for x in runs[(dp, pp, "plain-dp")])
      ratio = statistics.median(x["cold"]["cpu"] for x in runs[(dp, pp, variant)]) / plain
      figures[f"cold_cpu_ratio_{dp}x{pp}"] = round(ratio, 3)
      print(f"cold_cpu_ratio_{dp}x{pp}: {ratio:.3f}")
  if args.warm:
    print("\nwarm / cold first step (medians):")
    for c in cases:
      cold = statistics.median(x["cold"]["seconds"] for x in runs[c])
      warm = statistics.median(x["warm"]["seconds"] for x in runs[c])
      print(f"  {c[0]}x{c[1]} {c[2]}: {warm:.2f}s / {cold:.2f}s = {warm / cold:.2f}")
  record("cold_start" + "_jax_cache" * args.jax_cache, figures)


def trace_and_cut(layers: int, repeats: int) -> None:
  """Times, in this process, tracing the tiny GPT's loss at `layers` layers (`cut.LossCut`)
  and cutting it for pp = 2, 4 and 8 (`segments`, each a fresh cut of the same trace), against
  `jax.make_jaxpr` of the plain whole loss (the trace any jit of the step pays). Medians."""
  import time

  sys.path.insert(0, ROOT)
  from resilient_jax.runtime import setup as runtime_setup

  runtime_setup.configure_jax(num_cpu_devices=1)
  import jax

  from resilient_jax.model.check import token_batch
  from resilient_jax.model.cut import LossCut, default_loss_fn
  from resilient_jax.model.staging import Binder, flat_params, variable_names
  from resilient_jax.spec.model import partition_layers
  from tests.helpers import tiny_config

  cfg = tiny_config(model__num_layers=layers)
  model = cfg.model.build(0)
  batch = token_batch(cfg.model.seq_len, 4)
  bind = Binder(model, variable_names(model))
  params = flat_params(model)
  loss = default_loss_fn(model)
  print(f"load average at start: {os.getloadavg()[0]:.2f}")
  times: dict[str, list[float]] = {"plain make_jaxpr": [], "trace": []}
  for pp in (2, 4, 8):
    times[f"cut pp={pp}"] = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.make_jaxpr(lambda p, b: bind.run(p, loss, (b,)))(params, batch)
    times["plain make_jaxpr"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    cut = LossCut(model, None, batch)
    times["trace"].append(time.perf_counter() - t0)
    for pp in (2, 4, 8):
      cut._segments.clear()
      t0 = time.perf_counter()
      cut.segments(partition_layers(layers, pp))
      times[f"cut pp={pp}"].append(time.perf_counter() - t0)
  print(f"{layers} layers, {len(cut._flat.eqns)} equations; medians of {repeats}:")
  for name, ts in times.items():
    print(f"  {name}: {statistics.median(ts):.3f} s")
  print(f"trace_s_{layers}: {statistics.median(times['trace']):.3f}")
  print(f"cut_s_{layers}_pp4: {statistics.median(times['cut pp=4']):.3f}")
  print(f"load average at end: {os.getloadavg()[0]:.2f}")
  record("cold_start_trace", {f"{name.replace(' ', '_').replace('=', '')}_s":
                              round(statistics.median(ts), 3) for name, ts in times.items()})


if __name__ == "__main__":
  main()
