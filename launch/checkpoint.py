"""`python -m launch.checkpoint {inspect,verify} DIR` (or `resilient-jax-checkpoint`).

DIR is one checkpoint (`.../checkpoints/12`, or an older `.../checkpoints/step_00000012`), a
checkpoints folder, or a workdir. `inspect` prints a checkpoint's step, layout and entries (of a
folder: the newest); `verify` loads every entry and checks its checksum, and of a folder checks
every checkpoint in it, newest first, a line each, so a damaged newest one is named even when an
older one would be used. Damaged metadata (its checksum, a step other than its folder's, a
folder without it) is damage like any other. Exit codes: 0 ok, 1 a checkpoint is damaged
(`verify`: any of them), 2 bad usage, a bad flag or nothing to read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from resilient_jax.checkpoint.store import (
  META_FILE,
  META_ITEM,
  CheckpointError,
  load,
  meta_path,
  read_meta,
  step_folders,
)

from . import cli

USAGE = "usage: python -m launch.checkpoint {inspect,verify} DIR"


def _checkpoints(arg: str) -> list[tuple[int | None, Path]]:
  """The checkpoints DIR names, newest first: itself, or every step folder in it (or in its
  `checkpoints/`)."""
  path = Path(arg)
  if meta_path(path).exists():
    return [(None, path)]
  for root in (path, path / "checkpoints"):
    found = step_folders(root)
    if found:
      return list(reversed(found))
  raise FileNotFoundError(f"no committed checkpoint in {arg}")


def _has_meta(path: Path) -> None:
  """A step folder without metadata is a damaged checkpoint: its save commits all at once."""
  if not meta_path(path).exists():
    raise CheckpointError(f"{path}: no {META_ITEM}/{META_FILE} (damaged, or never committed)")


def _inspect(path: Path) -> None:
  _has_meta(path)
  meta = read_meta(path)
  layout, data = meta.get("layout", {}), meta.get("data", {})
  print(f"checkpoint {path}")
  print(f"  step {meta['step']}  (next data step {data.get('next_step')})")
  print(f"  saved from layout dp={layout.get('dp')} pp={layout.get('pp')} tp={layout.get('tp', 1)} "
        f"partition={layout.get('partition')} live_workers={layout.get('live_workers')}")
  total = meta.get("bytes")
  print(f"  {total / 2**20 if isinstance(total, (int, float)) else float('nan'):.2f} MiB in "
        f"{sum(len(g) for g in meta['entries'].values())} entries")
  for group, entries in meta["entries"].items():
    print(f"  {group}:")
    for name, info in sorted(entries.items()):
      try:
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(info["dtype"]).itemsize
        size = f"{nbytes:>12,d}"
      except TypeError:  # a dtype this numpy does not know
        size = f"{'?':>12s}"
      print(f"    {name:48s} {str(tuple(info['shape'])):>16s} {info['dtype']:8s} {size} B")


def _verify(found: list[tuple[int | None, Path]]) -> int:
  """Verifies each checkpoint, a line each (damage on stderr); 1 if any is damaged."""
  usable, damaged = None, 0
  for step, path in found:
    try:
      _has_meta(path)
      loaded = load(path)
    except CheckpointError as e:
      damaged += 1
      print(f"CORRUPT: {'' if step is None else f'step {step}: '}{e}", file=sys.stderr)
      continue
    usable = loaded.step if usable is None else usable
    n = len(loaded.params) + len(loaded.opt_state)
    print(f"OK: {path} (step {loaded.step}): {n} entries match their checksums")
  if len(found) > 1:
    print(f"{damaged} of {len(found)} checkpoints damaged; " + (
      f"a resume starts after step {usable}" if usable is not None else
      "none is usable: a resume starts from step 1"))
  return 1 if damaged else 0


def main(argv: list[str]) -> int:
  if len(argv) != 3 or argv[1] not in ("inspect", "verify"):
    print(USAGE, file=sys.stderr)
    return 2
  try:
    found = _checkpoints(argv[2])
    if argv[1] == "verify":
      return _verify(found)
    _inspect(found[0][1])
    return 0
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except CheckpointError as e:
    print(f"CORRUPT: {e}", file=sys.stderr)
    return 1


def run() -> None:
  """The `resilient-jax-checkpoint` console script: `main` as an absl program, like the
  launchers (`--help`, absl's logging flags; a bad flag is one line and exit 2)."""
  cli.run(main)


if __name__ == "__main__":
  run()
