"""Checkpoints on disk: asynchronous, atomic, checksummed, with retention and fallback.

Layout of `<dir>/step_00000012/`:
  state/      orbax PyTree (uncompressed) `{"params": {name: array},
              "opt_state": {state key: array}}` — the universal layout of `universal.py`
  meta.json   step, the layout it was saved from, data position, config, and per-entry
              shape/dtype/CRC32

A save copies the state to the host (the only part training waits for), then a background
thread writes it into `<dir>/.tmp-step_.../`, writes `meta.json` last and renames the folder to
its final name. A half-written checkpoint therefore never has a final name, and `latest()`
never picks it (`remove_unfinished` clears such folders at start). A state holding an inf or NaN
is never written. Loading (`reader.py`) reads entries in parallel and verifies each against its
checksum, and that it is finite, as its bytes arrive; a bad checkpoint is reported by name and
the previous one is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax.checkpoint import reader
from resilient_jax.logs import info

PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT = "resilient_jax.universal.v1"


class CheckpointError(RuntimeError):
  """A checkpoint is missing, incomplete or corrupt; the message names the bad item."""


def step_dir(root: Path, step: int) -> Path:
  return root / f"{PREFIX}{step:08d}"


def _scan(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
  """(CRC32, finite) of every array in one pass over its bytes (`reader.checksum_and_finite`),
  arrays in parallel: zlib and numpy release the GIL on large buffers."""
  names = sorted(arrays, key=lambda k: -arrays[k].nbytes)
  with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    return dict(zip(names, pool.map(lambda k: reader.checksum_and_finite(arrays[k]), names),
                    strict=True))


def _checkpointer():
  import jax
  import orbax.checkpoint as ocp

  # Checkpoints hold host numpy arrays and are written and read by one process: in a
  # multi-process job orbax must not synchronise with the others (it would start a collective
  # over every process, including dead ones).
  me = jax.process_index()
  local = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
  # No compression: parameters barely compress, and zstd made a cold restore of a 1.3 GB
  # checkpoint take 3.7x the raw read of its files (1.0x without).
  # The layout is pinned (one OCDBT database, zarr v2 arrays): `load` reads it directly.
  return ocp.Checkpointer(
    ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, use_compression=False,
                                multiprocessing_options=local),
    multiprocessing_options=local,
  )


def non_finite(scanned: Mapping[str, tuple[str, bool]]) -> list[str]:
  """Names of the arrays holding an inf or NaN, from `_scan`'s results."""
  return sorted(k for k, (_, finite) in scanned.items() if not finite)


def committed_steps(root: str | Path) -> list[int]:
  """Steps with a committed (fully written and renamed) checkpoint, ascending."""
  root = Path(root)
  if not root.is_dir():
    return []
  steps = []
  for p in root.iterdir():
    if p.name.startswith(PREFIX) and (p / "meta.json").exists():
      try:
        steps.append(int(p.name[len(PREFIX):]))
      except ValueError:
        continue
  return sorted(steps)


@dataclasses.dataclass
class Loaded:
  step: int
  params: dict[str, np.ndarray]
  opt_state: dict[str, np.ndarray]
  meta: dict[str, Any]
  path: Path
  timings: dict[str, float] = dataclasses.field(default_factory=dict)
  """`wall_s` of the parallel read (`locate_s` of it finding the arrays); `read_s` (waiting for
  bytes) and `verify_s` (CRC32 and finiteness) summed over the workers; `direct` of `entries`
  read by the fast path."""


def read_meta(path: Path) -> dict[str, Any]:
  try:
    meta = json.loads((path / "meta.json").read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: meta.json unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    fmt = meta.get("format") if isinstance(meta, dict) else None
    raise CheckpointError(f"{path}: unknown format {fmt!r}")
  # A load trusts these fields to size and check every array: a damaged meta.json is a corrupt
  # checkpoint (fall back), not a KeyError halfway through the load.
  entries = meta.get("entries")
  for group in reader.GROUPS:
    infos = entries.get(group) if isinstance(entries, dict) else None
    if not isinstance(infos, dict) or not all(
        isinstance(i, dict) and {"shape", "dtype", "crc32"} <= i.keys() for i in infos.values()):
      raise CheckpointError(f"{path}: meta.json lacks the {group} entries' shapes and checksums")
  return meta


def load(path: str | Path, workers: int | None = None) -> Loaded:
  """Reads and verifies one checkpoint folder, entries in parallel.

  Args:
    path: the checkpoint folder (`.../step_00000012`).
    workers: arrays read and verified at once (default `reader.default_workers()`).

  Raises:
    CheckpointError: missing files, a missing entry, or an entry whose checksum, shape or
      dtype differs from meta.json, or that holds an inf/NaN (the message names it).
  """
  path = Path(path)
  meta = read_meta(path)
  try:
    entries, timings = reader.read_verified(path, meta, workers)
  except reader.StateUnreadable as e:
    raise CheckpointError(f"{path}: {e}") from None
  for group in reader.GROUPS:
    bad = sorted((e for e in entries if e.group == group and e.error), key=lambda e: e.name)
    if bad:
      # A damaged entry is named before values that are merely non-finite; those are counted.
      first = next((e for e in bad if e.error != reader.NON_FINITE), bad[0])
      more = len(bad) - 1 if first.error == reader.NON_FINITE else 0
      raise CheckpointError(f"{path}: {group} entry {first.name!r} {first.error}"
                            + (f" (and {more} more)" if more else ""))
  timings |= {"read_s": sum(e.read_s for e in entries),
             "verify_s": sum(e.verify_s for e in entries),
             "direct": float(sum(e.direct for e in entries)), "entries": float(len(entries))}
  tree = {g: {e.name: e.array for e in entries if e.group == g} for g in reader.GROUPS}
  return Loaded(meta["step"], tree["params"], tree["opt_state"], meta, path, timings)


def load_latest(root: str | Path, log: Callable[[str], None] = info) -> Loaded | None:
  """The newest checkpoint that verifies; corrupt ones are reported and skipped."""
  for step in reversed(committed_steps(root)):
    try:
      return load(step_dir(Path(root), step))
    except CheckpointError as e:
      log(f"checkpoint at step {step} is unusable: {e}; falling back to the previous one")
  return None


class CheckpointWriter:
  """Writes checkpoints in the background, one at a time.

  Args:
    root: the checkpoints folder.
    keep: how many committed checkpoints to keep (oldest deleted first); 0 keeps all.
    clock: time source (tests inject a fake one).
  """

  def __init__(self, root: str | Path, keep: int = 3, clock: Callable[[], float] = time.monotonic):
    self.root = Path(root)
    self.keep = keep
    self.clock = clock
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.blocked_s: list[float] = []
    """Per save: how long the caller was blocked (waiting for the previous save + host copy)."""
    self.write_s: list[float] = []
    """Per save: how long the background write took."""

  def save(self, step: int, params: Mapping[str, Any], opt_state: Mapping[str, Any],
           meta: Mapping[str, Any]) -> None:
    """Copies the state to the host and writes it in the background.

    Raises:
      CheckpointError: the previous background save failed (its checkpoint was not committed;
        the ones before it are intact).
    """
    import jax

    t0 = self.clock()
    self.wait()
    host = jax.device_get({"params": dict(params), "opt_state": dict(opt_state)})
    self.blocked_s.append(self.clock() - t0)
    self._thread = threading.Thread(target=self._write, args=(step, host, dict(meta)),
                                    name=f"checkpoint-{step}", daemon=False)
    self._thread.start()

  def wait(self, timeout_s: float | None = None) -> bool:
    """Blocks until the save in flight (if any) is committed.

    Returns:
      False if it was still running after `timeout_s` (it goes on in the background).

    Raises:
      CheckpointError: the save failed (its checkpoint was not committed).
    """
    if self._thread is not None:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        return False
      self._thread = None
    if self._error is not None:
      err, self._error = self._error, None
      raise CheckpointError(f"a background checkpoint save failed: {err}") from err
    return True

  def remove_unfinished(self) -> list[str]:
    """Removes the folders of saves that never committed (their writer died); returns their
    names. Call before the first save."""
    if not self.root.is_dir():
      return []
    stale = sorted(p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX))
    for p in stale:
      shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]

  def _write(self, step: int, host: dict, meta: dict) -> None:
    t0 = self.clock()
    tmp = self.root / f"{TMP_PREFIX}{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
    try:
      tree = {g: {k: np.asarray(v) for k, v in host[g].items()} for g in ("params", "opt_state")}
      scanned = {g: _scan(arrays) for g, arrays in tree.items()}
      bad = non_finite(scanned["params"]) + non_finite(scanned["opt_state"])
      if bad:
        raise CheckpointError(f"the state of step {step} is not finite ({', '.join(bad[:3])}"
                              f"{', ...' if len(bad) > 3 else ''}): not written")
      tmp.mkdir(parents=True)
      _checkpointer().save((tmp / "state").absolute(), tree)
      entries = {}
      for g, arrays in tree.items():
        entries[g] = {k: {"shape": list(a.shape), "dtype": str(a.dtype),
                          "crc32": scanned[g][k][0]} for k, a in arrays.items()}
      meta = {"format": FORMAT, "step": step, **meta, "entries": entries,
              "bytes": int(sum(a.nbytes for g in tree.values() for a in g.values()))}
      (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
      final = step_dir(self.root, step)
      if final.exists():  # a step saved again (a redone step): set the old copy aside first
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
      tmp.rename(final)  # the commit: atomic on one filesystem
      self._retain()
    except BaseException as e:  # reported on the next save or wait
      self._error = e
      shutil.rmtree(tmp, ignore_errors=True)
    finally:
      self.write_s.append(self.clock() - t0)

  def _retain(self) -> None:
    if self.keep <= 0:
      return
    for step in committed_steps(self.root)[: -self.keep]:
      shutil.rmtree(step_dir(self.root, step), ignore_errors=True)
