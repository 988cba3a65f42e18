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
     CRC pass) and to the plainest form of the same work (each array read into a fresh
     `np.empty` array, then `jax.device_put` onto the devices of the layout that hold it; no
     verification). Raw reads and loads are interleaved, `--repeats` times, and medians reported,
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
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import record  # noqa: E402
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


def _finite_alone(arrays: list) -> float:
  """Seconds to test the given in-memory arrays for inf/NaN on one thread, as the reader does
  (1 MiB slices)."""
  import numpy as np

  from resilient_jax.checkpoint import reader

  mask = np.empty(reader.SLICE_BYTES, bool)
  t0 = time.perf_counter()
  for a in arrays:
    if reader.is_floating(a.dtype):
      flat, step = a.reshape(-1), reader.SLICE_BYTES // a.itemsize
      for i in range(0, flat.size, step):
        part = flat[i:i + step]
        np.isfinite(part, out=mask[:part.size]).all()
  return time.perf_counter() - t0


def _fresh_alone(shapes: list) -> float:
  """Seconds, on one thread, to fault in fresh memory for arrays of the given (shape, dtype)s as
  the reader allocates it (one write per 4 KiB page; the kernel zeroes each page it hands
  out). With the raw read (the copy), the CRC32 and the finiteness test alone, the parts of a
  verified load into fresh memory, each one pass over the bytes."""
  import numpy as np

  from resilient_jax.checkpoint import reader

  empty = getattr(reader, "aligned_empty", np.empty)  # np.empty: the script on an older tree
  t0 = time.perf_counter()
  fresh = [empty(shape, dtype).reshape(-1).view(np.uint8) for shape, dtype in shapes]
  for b in fresh:
    b[::4096] = 0
  return time.perf_counter() - t0


def _needs(interpreter) -> list[tuple[object, list[tuple[str, str]]]]:
  """What each local worker of a layout holds: its device and the (group, name) entries of its
  parameters and optimizer state, as `Interpreter.place` picks them."""

  from resilient_jax.checkpoint import universal

  out = []
  for slot in interpreter.local_slots:
    prog = interpreter.program(slot)
    template = prog.opt_template
    out.append((interpreter.device(slot), [("params", n) for n in prog.param_names]
                + [("opt_state", k) for k in universal.flatten_state(template)]))
  return out


def _load_plain(path: Path, needs: list) -> list:
  """The fastest plain form of the same work, unverified: every array read (one thread, file
  order) into a fresh `np.empty` array, then `jax.device_put` onto each device of the layout
  that holds it. No checksum, no finiteness test, no fallback."""
  import jax
  import numpy as np

  from resilient_jax.checkpoint import reader, store

  meta = store.read_meta(path)
  where = reader._chunk_locations(path / "state", meta)
  host = {}
  for key in sorted(where, key=lambda k: (str(where[k].file or ""), where[k].offset)):
    info, w = meta["entries"][key[0]][key[1]], where[key]
    a = np.empty(info["shape"], info["dtype"])
    if w.inline is not None:
      a.reshape(-1).view(np.uint8)[:] = np.frombuffer(w.inline, np.uint8)
    else:
      with open(w.file, "rb", buffering=0) as f:
        f.seek(w.offset)
        f.readinto(a.reshape(-1).view(np.uint8))
    host[key] = a
  out = [jax.device_put([host[k] for k in keys], dev) for dev, keys in needs]
  jax.block_until_ready(out)
  return out


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


def _first_load(path: Path) -> None:
  """A restart's load, run in a fresh process (`--first_load_of`): load + verify, then
  `jax.device_put` of every array onto both devices (on 2x1 each worker holds the whole model);
  prints the seconds of each and the page faults, as JSON."""
  import jax
  import tensorstore  # noqa: F401  (imported before the clock starts, as a trainer has it)

  from resilient_jax import checkpoint as ckpt

  devices = jax.devices()
  jax.block_until_ready(jax.device_put(0.0, devices[0]))
  f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  t0 = time.perf_counter()
  loaded = ckpt.load(path)
  t1 = time.perf_counter()
  arrays = [*loaded.params.values(), *loaded.opt_state.values()]
  jax.block_until_ready(jax.device_put([a for _ in devices for a in arrays],
                                       [d for d in devices for _ in arrays]))
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
  print(json.dumps({"load": t1 - t0, "place": time.perf_counter() - t1, "faults": faults}))


def _first_loads(path: Path, n: int) -> list[dict]:
  """`_first_load` in `n` fresh processes, each after a full read of the files (warm cache)."""
  out = []
  for _ in range(n):
    _read_raw(path)
    proc = subprocess.run([sys.executable, __file__, "--first_load_of", str(path)],
                          capture_output=True, text=True, timeout=600, check=True)
    out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  return out


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
  parser.add_argument("--first_loads", type=int, default=3,
                      help="restarts measured: the first load in a fresh process, each")
  parser.add_argument("--first_load_of", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  runtime_setup.configure_jax(num_cpu_devices=2)
  if args.first_load_of:
    _first_load(Path(args.first_load_of))
    return

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
    figures: dict[str, float] = {}
    for rule in ("wait", "defer"):
      # The run's config, which the checkpoint rule reads (`Checkpoints.if_due`); before
      # 2026-11-27 this set a copy only the trainer held, and `defer` measured `wait` again.
      trainer.run_state.cfg = dataclasses.replace(trainer.cfg, checkpoint=dataclasses.replace(
        trainer.cfg.checkpoint, if_busy=rule))
      assert trainer.checkpoints.run.cfg.checkpoint.if_busy == rule
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
      figures[f"{rule}_blocked_fraction"] = round(sum(blocked) / sum(step_times), 4)

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

    cpu: dict[str, list[float]] = {"raw": [], "load": [], "reshard": [], "plain": []}
    needs = _needs(other.interpreter)

    def timed(fn, what=None):
      fresh_cache()
      c0, t0 = time.process_time(), time.perf_counter()
      out = fn()
      if what:
        cpu[what].append(time.process_time() - c0)  # CPU seconds, all threads
      return time.perf_counter() - t0, out

    print(f"load average before the loads: {_load_average()}")
    runs: dict[str, list[float]] = {k: [] for k in (
      "raw", "crc_alone", "load", "place", "reshard", "read_s", "verify_s", "locate_s", "before",
      "plain", "fresh_alone", "finite_alone", "faults")}
    for rep in range(args.repeats):
      t, nbytes = timed(lambda: _read_raw(path), "raw")
      runs["raw"].append(t)
      fresh_cache()
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      c0, t0 = time.process_time(), time.perf_counter()
      loaded = ckpt.load(path, workers=args.workers)
      t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
      runs["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
      other.interpreter.import_state(loaded.params, loaded.opt_state)
      jax.block_until_ready(list(other.interpreter.params.values()))
      t_place = time.perf_counter() - t0 - t_load
      cpu["load"].append(c_load)
      cpu["reshard"].append(time.process_time() - c0)
      runs["load"].append(t_load)
      runs["place"].append(t_place)
      runs["reshard"].append(t_load + t_place)
      runs["read_s"].append(loaded.timings["read_s"])
      runs["verify_s"].append(loaded.timings["verify_s"])
      runs["locate_s"].append(loaded.timings["locate_s"])
      arrays = [*loaded.params.values(), *loaded.opt_state.values()]
      runs["crc_alone"].append(_crc_alone(arrays))
      runs["finite_alone"].append(_finite_alone(arrays))
      shapes = [(a.shape, a.dtype) for a in arrays]
      del arrays
      if rep == 0:  # every worker's state is bitwise the loaded one (placement may alias it)
        for slot in other.interpreter.local_slots:
          opt = other.interpreter.program(slot).opt_entries(other.interpreter.opt_state[slot])
          for group, got in (("params", other.interpreter.params[slot]), ("opt_state", opt)):
            for name, value in got.items():
              want = getattr(loaded, group)[name]
              assert np.asarray(value).tobytes() == want.tobytes(), (slot, group, name)
        direct = f"{loaded.timings['direct']:.0f} of {loaded.timings['entries']:.0f}"
      del loaded
      runs["fresh_alone"].append(_fresh_alone(shapes))
      gc.collect()
      t, placed = timed(lambda: _load_plain(path, needs), "plain")
      runs["plain"].append(t)
      del placed
      gc.collect()
      if rep < args.before_repeats:
        runs["before"].append(timed(lambda: _load_before(path))[0])
    del other  # the fresh processes get the memory
    gc.collect()
    first = _first_loads(path, args.first_loads)
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
    print(f"  page faults of the load: {med['faults']:.0f} (4 KiB pages: {nbytes / 4096:.0f})")
    print(f"  place onto 2x1 (import_state; on CPU it aliases the loaded arrays): "
          f"{med['place']:.3f} s")
    floor = med["raw"] + med["fresh_alone"] + med["crc_alone"] + med["finite_alone"]
    cores = os.cpu_count() or 1
    print(f"  floor of a verified load into fresh memory, one thread each: copy (the raw read) "
          f"{med['raw']:.3f} + fresh pages {med['fresh_alone']:.3f} + CRC32 "
          f"{med['crc_alone']:.3f} + finiteness {med['finite_alone']:.3f} = {floor:.3f} s; "
          f"over {cores} idle cores {floor / cores:.3f} s = {floor / cores / med['raw']:.2f}x "
          "the raw read")
    share = med["verify_s"] / max(1e-9, med["read_s"] + med["verify_s"])
    print(f"  CPU-bound share of the load: CRC32 + finiteness {share:.0%} of the workers' time; "
          f"placement {med['place'] / med['reshard']:.0%} of the reshard-load")
    if "before" in med:
      print(f"  before (orbax restore, then a CRC pass; median of {len(runs['before'])}): "
            f"{med['before']:.3f} s = {med['before'] / med['raw']:.2f}x the raw read")
    print(f"  plain load (np.empty + read each array, 1 thread, then jax.device_put onto 2x1; "
          f"no verification): {med['plain']:.3f} s ({np.median(cpu['plain']):.3f} CPU-s)")
    if first:
      total = [f["load"] + f["place"] for f in first]
      print(f"  first load in a fresh process (a restart; load + verify, then device_put of "
            f"every array onto both devices), {len(first)} runs: "
            + ", ".join(f"{f['load']:.3f} + {f['place']:.3f} s" for f in first)
            + f"; median {np.median(total):.3f} s = {np.median(total) / med['raw']:.2f}x the raw "
            f"read, page faults {np.median([f['faults'] for f in first]):.0f}")
    print(f"reshard-load (load + verify + place onto 2x1) {med['reshard']:.3f} s "
          f"({np.median(cpu['reshard']):.3f} CPU-s) -> ratio {med['reshard'] / med['raw']:.2f} "
          f"to the raw read (target <= 1.5 idle, <= 2 loaded); "
          f"{med['reshard'] / med['plain']:.2f} to the plain load")
    figures.update({"checkpoint_gib": round(nbytes / 2**30, 2),
                    "reshard_load_s": round(med["reshard"], 3),
                    "reshard_over_raw_read": round(med["reshard"] / med["raw"], 2),
                    "reshard_over_plain_load": round(med["reshard"] / med["plain"], 2)})
    record("checkpoint", figures)


if __name__ == "__main__":
  os.environ.setdefault("RESILIENT_JAX_CACHE", "")
  main()
