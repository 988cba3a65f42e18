"""Checkpoints on disk: asynchronous, atomic, checksummed, with retention and fallback.

Layout of `<dir>/step_00000012/`:
  state/      orbax PyTree (uncompressed) `{"params": {name: array},
              "opt_state": {state key: array}}` — the universal layout of `universal.py`
  meta.json   step, the layout it was saved from, data position, config, and per-entry
              shape/dtype/CRC32

A save copies the state to the host (the only part training waits for), then a background
thread writes it into `<dir>/.tmp-step_.../`, writes `meta.json` last and renames the folder to
its final name. A half-written checkpoint therefore never has a final name, and `latest()`
never picks it. Loading verifies every entry against its checksum; a bad checkpoint is reported
by name and the previous one is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT = "resilient_jax.universal.v1"


class CheckpointError(RuntimeError):
  """A checkpoint is missing, incomplete or corrupt; the message names the bad item."""


def step_dir(root: Path, step: int) -> Path:
  return root / f"{PREFIX}{step:08d}"


def _crc(a: np.ndarray) -> str:
  return f"{zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF:08x}"


def _crcs(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
  """CRC32 of every array, in parallel: zlib releases the GIL on large buffers."""
  names = sorted(arrays, key=lambda k: -arrays[k].nbytes)
  with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    return dict(zip(names, pool.map(lambda k: _crc(arrays[k]), names), strict=True))


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
  return ocp.Checkpointer(
    ocp.PyTreeCheckpointHandler(use_compression=False, multiprocessing_options=local),
    multiprocessing_options=local,
  )


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


def read_meta(path: Path) -> dict[str, Any]:
  try:
    meta = json.loads((path / "meta.json").read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: meta.json unreadable ({e})") from None
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{path}: unknown format {meta.get('format')!r}")
  return meta


def load(path: str | Path) -> Loaded:
  """Reads and verifies one checkpoint folder.

  Raises:
    CheckpointError: missing files, a missing entry, or an entry whose checksum, shape or
      dtype differs from meta.json (the message names it).
  """
  import orbax.checkpoint as ocp

  path = Path(path)
  meta = read_meta(path)
  as_numpy = {g: {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in meta["entries"][g]}
              for g in ("params", "opt_state")}
  try:
    tree = _checkpointer().restore(
      (path / "state").absolute(), args=ocp.args.PyTreeRestore(restore_args=as_numpy)
    )
  except Exception as e:  # orbax/tensorstore raise many types for damaged files
    raise CheckpointError(f"{path}: state unreadable ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
  for group in ("params", "opt_state"):
    stored = tree.get(group, {})
    for name, info in meta["entries"][group].items():
      if name not in stored:
        raise CheckpointError(f"{path}: {group} entry {name!r} is missing")
      a = stored[name] = np.asarray(stored[name])
      if list(a.shape) != info["shape"] or str(a.dtype) != info["dtype"]:
        raise CheckpointError(f"{path}: {group} entry {name!r} has shape {a.shape} {a.dtype}, "
                              f"expected {info['shape']} {info['dtype']}")
    crcs = _crcs({k: stored[k] for k in meta["entries"][group]})
    for name, info in sorted(meta["entries"][group].items()):
      if crcs[name] != info["crc32"]:
        raise CheckpointError(f"{path}: {group} entry {name!r} fails its checksum")
  return Loaded(meta["step"], {k: np.asarray(v) for k, v in tree["params"].items()},
                {k: np.asarray(v) for k, v in tree["opt_state"].items()}, meta, path)


def load_latest(root: str | Path, log: Callable[[str], None] = print) -> Loaded | None:
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

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is committed."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      err, self._error = self._error, None
      raise CheckpointError(f"a background checkpoint save failed: {err}") from err

  def _write(self, step: int, host: dict, meta: dict) -> None:
    t0 = self.clock()
    tmp = self.root / f"{TMP_PREFIX}{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
    try:
      tmp.mkdir(parents=True)
      tree = {g: {k: np.asarray(v) for k, v in host[g].items()} for g in ("params", "opt_state")}
      _checkpointer().save((tmp / "state").absolute(), tree)
      entries = {}
      for g, arrays in tree.items():
        crcs = _crcs(arrays)
        entries[g] = {k: {"shape": list(a.shape), "dtype": str(a.dtype), "crc32": crcs[k]}
                      for k, a in arrays.items()}
      meta = {"format": FORMAT, "step": step, **meta, "entries": entries,
              "bytes": int(sum(a.nbytes for g in tree.values() for a in g.values()))}
      (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
      final = step_dir(self.root, step)
      if final.exists():
        shutil.rmtree(final)
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
