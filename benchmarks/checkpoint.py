"""Checkpoint costs for a model of at least 100M parameters, measured side by side in one run.

Prints:
  1. time training is blocked per asynchronous save (host copy + waiting for the previous
     save), as a fraction of a training step of the same model (target < 10%);
  2. load-with-reshard time (read + verify every entry + place each stage's parameters and
     optimizer state on a *different* layout's devices) over the time to read the same bytes
     raw from disk (target <= 2x). Both are measured from a cold page cache when this process
     may drop it (root on Linux), else both warm (said in the output).

Saves happen every `--every` steps (default 2) so that a background write fits in the
interval; the output shows both, since a save interval shorter than the write time makes
the next save wait.

Run:
  python benchmarks/checkpoint.py            # ~110M-parameter GPT, saved on 1x2, loaded on 2x1
  python benchmarks/checkpoint.py --small    # a quick check of the script itself
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilient_jax import runtime_setup  # noqa: E402


def _drop_caches() -> bool:
  """Drops the page cache (Linux, root); False where that is not allowed."""
  try:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def _read_raw(path: Path) -> int:
  total = 0
  for f in sorted(path.rglob("*")):
    if f.is_file():
      with f.open("rb") as fh:
        while chunk := fh.read(1 << 24):
          total += len(chunk)
  return total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="a tiny model, to test the script")
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--every", type=int, default=2, help="steps between saves")
  args = parser.parse_args()
  runtime_setup.configure_jax(num_cpu_devices=2)

  import jax
  import numpy as np

  from configs.gpt_tiny import get_config
  from resilient_jax import checkpoint as ckpt
  from resilient_jax.config import from_config_dict
  from resilient_jax.trainer import Trainer

  cd = get_config()
  if args.small:
    cd.model.update(num_layers=2, d_model=64, seq_len=32)
  else:  # 12 blocks of d=896: 12 * 12 * 896^2 = 115.6M parameters in the blocks
    cd.model.update(num_layers=12, d_model=896, num_heads=14, seq_len=64)
  cd.train.update(global_batch=8, steps=100)
  cd.pipeline.update(microbatches=2, schedule="1f1b")

  def build(dp, pp, workdir):
    cd.mesh.update(dp=dp, pp=pp)
    return Trainer(from_config_dict(cd), workdir, log=lambda _: None)

  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    trainer = build(1, 2, tmp / "a")
    n_params = sum(int(np.prod(v.shape)) for v in trainer.interpreter.export_state()[0].values())
    print(f"model: {n_params / 1e6:.1f}M parameters, AdamW state "
          f"{3 * n_params * 4 / 2**30:.2f} GiB with parameters")

    # Training steps, timed; a save every `--every` steps (after a warm-up step).
    trainer.run_step(1)
    step_times, blocked = [], []
    for step in range(2, 2 + args.saves * args.every):
      t0 = time.perf_counter()
      trainer.run_step(step)
      step_times.append(time.perf_counter() - t0)
      if step % args.every == 0:
        t0 = time.perf_counter()
        trainer._save(step)
        blocked.append(time.perf_counter() - t0)
    trainer.writer.wait()
    step_t = float(np.median(step_times))
    print(f"step time (median of {len(step_times)}): {step_t:.3f} s; a save every {args.every} "
          f"steps, background write median {np.median(trainer.writer.write_s):.2f} s")
    print(f"blocked per async save: median {np.median(blocked):.3f} s, max {max(blocked):.3f} s "
          f"-> {np.median(blocked) / step_t:.1%} of a step (target < 10%)")

    root = tmp / "a" / "checkpoints"
    path = ckpt.step_dir(root, ckpt.committed_steps(root)[-1])
    other = build(2, 1, tmp / "b")  # another layout: 2 pipelines of 1 stage
    cold = _drop_caches()
    if not cold:
      _read_raw(path)  # then both measurements read from a warm page cache
    t0 = time.perf_counter()
    nbytes = _read_raw(path)
    raw = time.perf_counter() - t0
    if cold:
      _drop_caches()
    t0 = time.perf_counter()
    loaded = ckpt.load(path)
    other.interpreter.import_state(loaded.params, loaded.opt_state)
    jax.block_until_ready(list(other.interpreter.params.values()))
    reshard = time.perf_counter() - t0
    cache = "cold page cache" if cold else "warm page cache (could not drop it)"
    print(f"checkpoint {nbytes / 2**30:.2f} GiB, {cache}: raw read {raw:.3f} s, load + verify + "
          f"reshard onto 2x1 {reshard:.3f} s -> ratio {reshard / raw:.2f} (target <= 2)")
    for name in list(loaded.params)[:3]:
      np.testing.assert_array_equal(np.asarray(other.interpreter.params[(1, 0)][name]),
                                    loaded.params[name])


if __name__ == "__main__":
  os.environ.setdefault("RESILIENT_JAX_CACHE", "")
  main()
