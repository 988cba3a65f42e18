"""Checkpoint costs for a model of at least 100M parameters, measured side by side in one run.

Prints:
  1. time training is blocked by asynchronous saves (the host copy, and the wait for the
     previous save under `checkpoint.if_busy=wait`), as a fraction of training time
     (target < 1%);
  2. reshard-load time (read + verify every entry + place each stage's parameters and
     optimizer state on a *different* layout's devices) over the time to read the same bytes
     raw (target <= 1.5x on an idle machine, <= 2x under load), and where the load's time
     goes (waiting for bytes, CRC32 +
     finiteness, placement), next to the load as it was before (orbax restore, then a separate
     CRC pass). Raw reads and loads are interleaved, `--repeats` times, and medians reported,
     all from the same page-cache state: warm (each read follows a full read of the same
     files), or with `--cold` dropped before each (root on Linux; it evicts every process's
     cache, so not the default on a shared machine). The machine's load average is printed.

Saves come due every `--every` steps (default 2) and follow the training loop's rule
(`Checkpoints.if_due`): a save that comes due while the previous one is still being
written waits for it (`checkpoint.if_busy=wait`, the default, as orbax's manager does) or is
deferred to the first step at which the writer is free (`defer`); both are measured, one after
the other on the same trainer, with the steps each saved.

Run:
  python benchmarks/checkpoint.py            # ~110M-parameter GPT, saved on 1x2, loaded on 2x1
  python benchmarks/checkpoint.py --small    # a quick check of the script itself
  python benchmarks/checkpoint.py --cold     # page cache dropped before every read (root)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilient_jax.runtime import setup as runtime_setup  # noqa: E402


def _drop_caches() -> bool:
  """Drops the page cache (Linux, root); False where that is not allowed."""
  try:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


_RAW_BUFFER = bytearray(1 << 24)


def _read_raw(path: Path) -> int:
  """Reads every file of the checkpoint once, through one reused buffer: the disk's share."""
  total = 0
  buf = _RAW_BUFFER
  for f in sorted(path.rglob("*")):
    if f.is_file():
      with f.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
          total += n
  return total


def _crc_alone(arrays: list) -> float:
  """Seconds to CRC32 the given in-memory arrays on one thread with the reader's CRC32 (zlib-ng's
  where installed): a floor under any verified load (no read, no allocation), to set against
  the raw read."""
  from resilient_jax.checkpoint.reader import crc32

  t0 = time.perf_counter()
  for a in arrays:
    crc32(a.reshape(-1).view("uint8"))
  return time.perf_counter() - t0


def _flat(tree: dict, prefix: str = "") -> dict:
  """`store.nest` undone: `{"blocks": {"3": {"w": a}}}` -> `{"blocks.3.w": a}`."""
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def _load_before(path: Path) -> None:
  """The load as it was before the one-pass reader: orbax's restore, then a CRC pass."""
  import numpy as np
  import orbax.checkpoint as ocp

  from resilient_jax.checkpoint import reader, store

  meta = store.read_meta(path)
  as_numpy = {g: {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in meta["entries"][g]}
              for g in reader.GROUPS}
  as_numpy["params"] = store.nest(as_numpy["params"])  # stored nested by NNX path
  tree = store._checkpointer().restore((path / "state").absolute(),
                                       args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  tree["params"] = _flat(tree["params"])
  for g in reader.GROUPS:  # the old load's separate CRC pass (threads), then its finiteness pass
    arrays = tree[g]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
      crcs = dict(zip(arrays, pool.map(
        lambda a: reader.checksum_and_finite(a, check_finite=False)[0], arrays.values()),
        strict=True))
    assert all(crcs[k] == meta["entries"][g][k]["crc32"] for k in crcs)
    assert all(np.isfinite(a).all() for a in arrays.values() if reader.is_floating(a.dtype))


def _load_average() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="a tiny model, to test the script")
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--every", type=int, default=2, help="steps between saves")
  parser.add_argument("--repeats", type=int, default=5, help="interleaved load measurements")
  parser.add_argument("--before_repeats", type=int, default=2,
                      help="how many of them also time the load as it was before (slow)")
  parser.add_argument("--workers", type=int, default=None, help="load workers (default: auto)")
  parser.add_argument("--cold", action="store_true",
                      help="drop the page cache before every read (root; evicts everyone's)")
  args = parser.parse_args()
  runtime_setup.configure_jax(num_cpu_devices=2)

  import jax
  import numpy as np

  from configs.gpt_tiny import get_config
  from resilient_jax import checkpoint as ckpt
  from resilient_jax.checkpoint import reader
  from resilient_jax.config import from_config_dict
  from resilient_jax.training.loop import Trainer

  cd = get_config()
  if args.small:
    cd.model.update(num_layers=2, d_model=64, seq_len=32)
  else:  # 12 blocks of d=896: 12 * 12 * 896^2 = 115.6M parameters in the blocks
    cd.model.update(num_layers=12, d_model=896, num_heads=14, seq_len=64)
  cd.train.update(global_batch=8, steps=100)
  cd.pipeline.update(microbatches=2, schedule="1f1b")
  cd.checkpoint.update(every_steps=args.every)

  def build(dp, pp, workdir):
    cd.mesh.update(dp=dp, pp=pp)
    return Trainer(from_config_dict(cd), workdir, log=lambda _: None)

  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    trainer = build(1, 2, tmp / "a")
    n_params = sum(int(np.prod(v.shape)) for v in trainer.interpreter.export_state()[0].values())
    print(f"model: {n_params / 1e6:.1f}M parameters, AdamW state "
          f"{3 * n_params * 4 / 2**30:.2f} GiB with parameters")

    # Training steps, timed, with the training loop's checkpoint rule after each (a save due
    # every `--every` steps), after a warm-up step: first with the library's default rule
    # (`checkpoint.if_busy=wait`: a due save waits for the previous write), then with `defer`
    # (it is taken at the first step the writer is free), on the same trainer.
    trainer.run_step(1)
    first = 2
    for rule in ("wait", "defer"):
      trainer.cfg = dataclasses.replace(trainer.cfg, checkpoint=dataclasses.replace(
        trainer.cfg.checkpoint, if_busy=rule))
      step_times, blocked, saved = [], [], []
      trainer.writer.blocked_s.clear()
      for step in range(first, first + args.saves * args.every):
        t0 = time.perf_counter()
        trainer.run_step(step)
        step_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if trainer.checkpoints.if_due(step):
          saved.append(step)
        blocked.append(time.perf_counter() - t0)
      first += args.saves * args.every
      trainer.writer.wait()
      step_t = float(np.median(step_times))
      per_save = trainer.writer.blocked_s
      print(f"checkpoint.if_busy={rule}: step time (median of {len(step_times)}) {step_t:.3f} s; "
            f"a save due every {args.every} steps, taken at steps {saved}; background write "
            f"median {np.median(trainer.writer.write_s):.2f} s")
      print(f"  training blocked by checkpointing: {sum(blocked):.3f} s over {len(step_times)} "
            f"steps = {sum(blocked) / sum(step_times):.2%} of training time (target < 1%); per "
            f"save taken: median {np.median(per_save):.3f} s, max {max(per_save):.3f} s")

    root = tmp / "a" / "checkpoints"
    path = ckpt.step_dir(root, ckpt.committed_steps(root)[-1])
    other = build(2, 1, tmp / "b")  # another layout: 2 pipelines of 1 stage
    del trainer  # its state is not needed any more; the loads get the memory

    if args.cold and not _drop_caches():
      print("--cold: cannot drop the page cache here (needs root on Linux); measuring warm")
      args.cold = False

    def fresh_cache() -> None:
      # Same state before every timed read: dropped, or warm (every file read just before).
      if args.cold:
        _drop_caches()
      else:
        _read_raw(path)

    cpu: dict[str, list[float]] = {"raw": [], "load": []}

    def timed(fn, what=None):
      fresh_cache()
      c0, t0 = time.process_time(), time.perf_counter()
      out = fn()
      if what:
        cpu[what].append(time.process_time() - c0)  # CPU seconds, all threads
      return time.perf_counter() - t0, out

    print(f"load average before the loads: {_load_average()}")
    runs: dict[str, list[float]] = {k: [] for k in (
      "raw", "crc_alone", "load", "place", "reshard", "read_s", "verify_s", "locate_s", "before")}
    for rep in range(args.repeats):
      t, nbytes = timed(lambda: _read_raw(path), "raw")
      runs["raw"].append(t)
      t_load, loaded = timed(lambda: ckpt.load(path, workers=args.workers), "load")
      t0 = time.perf_counter()
      other.interpreter.import_state(loaded.params, loaded.opt_state)
      jax.block_until_ready(list(other.interpreter.params.values()))
      t_place = time.perf_counter() - t0
      runs["load"].append(t_load)
      runs["place"].append(t_place)
      runs["reshard"].append(t_load + t_place)
      runs["read_s"].append(loaded.timings["read_s"])
      runs["verify_s"].append(loaded.timings["verify_s"])
      runs["locate_s"].append(loaded.timings["locate_s"])
      runs["crc_alone"].append(_crc_alone([*loaded.params.values(), *loaded.opt_state.values()]))
      if rep == 0:
        for name in list(loaded.params)[:3]:
          np.testing.assert_array_equal(np.asarray(other.interpreter.params[(1, 0)][name]),
                                        loaded.params[name])
        direct = f"{loaded.timings['direct']:.0f} of {loaded.timings['entries']:.0f}"
      del loaded
      if rep < args.before_repeats:
        runs["before"].append(timed(lambda: _load_before(path))[0])
    med = {k: float(np.median(v)) for k, v in runs.items() if v}
    cache = "cold page cache (dropped before each read)" if args.cold else \
        "warm page cache (each read follows a full read of the same files)"
    workers = args.workers or reader.default_workers()
    print(f"checkpoint {nbytes / 2**30:.2f} GiB, {cache}; medians of {args.repeats} interleaved "
          f"repeats; load average after: {_load_average()} on {os.cpu_count()} cores")
    print(f"  raw read (one reused 16 MiB buffer):          {med['raw']:.3f} s "
          f"({np.median(cpu['raw']):.3f} CPU-s)")
    print(f"  CRC32 alone of the same bytes in memory, 1 thread: {med['crc_alone']:.3f} s = "
        f"{med['crc_alone'] / med['raw']:.2f}x the raw read (a floor under any verified load)")
    print(f"  load + verify, {workers} workers ({direct} entries one-pass): {med['load']:.3f} s "
          f"wall (finding the arrays {med['locate_s']:.3f} s); summed over workers: waiting for "
          f"bytes {med['read_s']:.3f} s, CRC32 + finiteness {med['verify_s']:.3f} s; "
          f"{np.median(cpu['load']):.3f} CPU-s")
    print(f"  place onto 2x1 (import_state):                {med['place']:.3f} s")
    cpu = med["verify_s"] / max(1e-9, med["read_s"] + med["verify_s"])
    print(f"  CPU-bound share of the load: CRC32 + finiteness {cpu:.0%} of the workers' time; "
          f"placement {med['place'] / med['reshard']:.0%} of the reshard-load")
    if "before" in med:
      print(f"  before (orbax restore, then a CRC pass; median of {len(runs['before'])}): "
            f"{med['before']:.3f} s = {med['before'] / med['raw']:.2f}x the raw read")
    print(f"reshard-load (load + verify + place onto 2x1) {med['reshard']:.3f} s -> ratio "
          f"{med['reshard'] / med['raw']:.2f} to the raw read (target <= 1.5 idle, <= 2 loaded)")


if __name__ == "__main__":
  os.environ.setdefault("RESILIENT_JAX_CACHE", "")
  main()
