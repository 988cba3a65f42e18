"""A local copy's cost against its law: time linear in a process's own state's bytes.

What a survivor of a lost process 0 does (`checkpoint/local.py`): one CRC32 pass and one
sequential write of its stages' state, then an fsync and a rename; the relaunch reads and
verifies the same bytes. Prints, per size of one process's state, the median write and read
times and MiB/s, each over a raw write (`ndarray.tofile` + fsync) and a raw read of the same
bytes measured interleaved with it (`copy_vs_raw_write`, `read_vs_raw_read`): the format's own
overhead, its CRC above all. Time per MiB flat across sizes is the law (no gathering, no
per-process term). The machine's load average is printed.

Run:
  python benchmarks/local_copy.py             # 16, 64 and 256 MiB, 5 repeats
  python benchmarks/local_copy.py --small     # a quick check of the script itself
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import record  # noqa: E402
from resilient_jax.checkpoint import local  # noqa: E402


def _state(mib: int, arrays: int = 32) -> dict[str, dict[str, np.ndarray]]:
  """A stage's state of `mib` MiB: `arrays` float32 parameters and as many optimizer entries."""
  n = mib * 2**20 // 4 // (2 * arrays)
  rng = np.random.default_rng(mib)
  return {"params": {f"blocks.{i}.w": rng.normal(size=n).astype(np.float32)
                     for i in range(arrays)},
          "opt_state": {f"0/mu/blocks.{i}.w": rng.normal(size=n).astype(np.float32)
                        for i in range(arrays)}}


def _raw_write(path: Path, state: dict) -> None:
  with path.open("wb") as f:
    for group in state.values():
      for a in group.values():
        a.tofile(f)
    f.flush()
    os.fsync(f.fileno())


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()
  sizes = [1, 4] if args.small else [16, 64, 256]
  print(f"load average: {open('/proc/loadavg').read().split()[:3]}")
  meta = {"token": "bench", "data": {}, "model": {}}
  figures: dict[str, float] = {}
  with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
    root = Path(tmp)
    for mib in sizes:
      state = _state(mib)
      needs = {(g, n) for g in state for n in state[g]}
      size = sum(a.nbytes for g in state.values() for a in g.values()) / 2**20
      t = {"write": [], "raw_write": [], "read": [], "raw_read": []}
      for _ in range(args.repeats):  # interleaved: both see the same disk and load
        t0 = time.perf_counter()
        path = local.write_copy(root, 1, 6, state, meta)
        t["write"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _raw_write(root / "raw.bin", state)
        t["raw_write"].append(time.perf_counter() - t0)
        copies = local.scan(root, lambda m: "", print)
        t0 = time.perf_counter()
        got = local.read_step(copies, needs, 6)
        t["read"].append(time.perf_counter() - t0)
        assert got is not None and len(got[0]) + len(got[1]) == len(needs)
        t0 = time.perf_counter()
        np.fromfile(root / "raw.bin", np.uint8)
        t["raw_read"].append(time.perf_counter() - t0)
      med = {k: statistics.median(v) for k, v in t.items()}
      print(f"{size:7.1f} MiB  write {med['write']:.3f}s ({size / med['write']:7.0f} MiB/s, "
            f"{1e3 * med['write'] / size:.2f} ms/MiB)  copy_vs_raw_write: "
            f"{med['write'] / med['raw_write']:.2f}   read+verify {med['read']:.3f}s "
            f"({1e3 * med['read'] / size:.2f} ms/MiB)  read_vs_raw_read: "
            f"{med['read'] / med['raw_read']:.2f}   ({path.parent.name})")
      figures.update({f"{mib}MiB_write_ms_per_mib": round(1e3 * med["write"] / size, 2),
                      f"{mib}MiB_copy_vs_raw_write": round(med["write"] / med["raw_write"], 2),
                      f"{mib}MiB_read_ms_per_mib": round(1e3 * med["read"] / size, 2),
                      f"{mib}MiB_read_vs_raw_read": round(med["read"] / med["raw_read"], 2)})
  if not args.small:  # --small checks the script, not the machine
    record("local_copy", figures)


if __name__ == "__main__":
  main()
