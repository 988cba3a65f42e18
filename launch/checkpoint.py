"""`python -m launch.checkpoint {inspect,verify} DIR` (or `resilient-jax-checkpoint`).

DIR is one checkpoint (`.../checkpoints/12`, or an older `.../checkpoints/step_00000012`), a
checkpoints folder, or a workdir; for the latter two the newest committed checkpoint is used.
`inspect` prints the checkpoint's step, layout and entries; `verify` loads every entry and checks
its checksum. Exit codes: 0 ok, 1 corrupt, 2 bad usage, a bad flag or nothing to read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from launch import cli
from resilient_jax.checkpoint.store import (
  CheckpointError,
  committed_steps,
  load,
  meta_path,
  read_meta,
  step_dir,
)

USAGE = "usage: python -m launch.checkpoint {inspect,verify} DIR"


def _resolve(arg: str) -> Path:
  path = Path(arg)
  if meta_path(path).exists():
    return path
  for root in (path, path / "checkpoints"):
    steps = committed_steps(root)
    if steps:
      return step_dir(root, steps[-1])
  raise FileNotFoundError(f"no committed checkpoint in {arg}")


def _inspect(path: Path) -> None:
  meta = read_meta(path)
  layout = meta.get("layout", {})
  print(f"checkpoint {path}")
  print(f"  step {meta['step']}  (next data step {meta.get('data', {}).get('next_step')})")
  print(f"  saved from layout dp={layout.get('dp')} pp={layout.get('pp')} tp={layout.get('tp', 1)} "
        f"partition={layout.get('partition')} live_workers={layout.get('live_workers')}")
  print(f"  {meta['bytes'] / 2**20:.2f} MiB in {sum(len(g) for g in meta['entries'].values())} "
        "entries")
  for group, entries in meta["entries"].items():
    print(f"  {group}:")
    for name, info in sorted(entries.items()):
      nbytes = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(info["dtype"]).itemsize
      print(f"    {name:48s} {str(tuple(info['shape'])):>16s} {info['dtype']:8s} {nbytes:>12,d} B")


def main(argv: list[str]) -> int:
  if len(argv) != 3 or argv[1] not in ("inspect", "verify"):
    print(USAGE, file=sys.stderr)
    return 2
  try:
    path = _resolve(argv[2])
    if argv[1] == "inspect":
      _inspect(path)
      return 0
    loaded = load(path)
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except CheckpointError as e:
    print(f"CORRUPT: {e}", file=sys.stderr)
    return 1
  n = len(loaded.params) + len(loaded.opt_state)
  print(f"OK: {path} (step {loaded.step}): {n} entries match their checksums")
  return 0


def run() -> None:
  """The `resilient-jax-checkpoint` console script: `main` as an absl program, like the
  launchers (`--help`, absl's logging flags; a bad flag is one line and exit 2)."""
  cli.run(main)


if __name__ == "__main__":
  run()
