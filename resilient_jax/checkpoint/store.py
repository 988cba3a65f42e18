"""Checkpoints on disk: written by orbax's `CheckpointManager`, checksummed, with fallback.

Layout of `<dir>/12/` (orbax's standard step folder: a plain `ocp.CheckpointManager(<dir>)`
lists and restores it; docs/checkpoints.md's "Checkpoint format" has the example):
  state/      orbax PyTree item, one OCDBT database, zarr v2, uncompressed:
              `{"params": {"blocks": {"3": {"mlp": {"fc": {"kernel": array}}}}, ...},
              "opt_state": {"0/mu/blocks.3.mlp.fc.kernel": array, ...}}`: parameters nested by
              NNX path, as `nnx.state(model, nnx.Param)` is; optimizer entries flat, by the
              universal keys of `universal.py`
  meta/metadata   orbax JSON item: step, the layout it was saved from, data position, config,
              and per-entry shape/dtype/CRC32 (names as above, flat), and `meta_sha256`, the
              metadata's own checksum: a load trusts nothing of it that does not match, nor a
              `step` other than its folder's
  _CHECKPOINT_METADATA   orbax's own step metadata
Older versions wrote `<dir>/step_00000012/` with `state/` and `meta.json` beside it: `load`,
`committed_steps`, `step_dir` and the CLI read both, so an older workdir resumes.

A save copies the state to the host (the only part training waits for); then one background
thread computes every array's CRC32 and finiteness in one pass, refuses a state holding an inf
or NaN (never written), and hands the rest to `CheckpointManager.save`: orbax writes into
`<dir>/12.orbax-checkpoint-tmp-*`, renames it to `12` when complete (so a half-written checkpoint
never has a final name; `remove_unfinished` clears such folders at start) and applies
`max_to_keep`. Loading (`reader.py`) reads entries in parallel and verifies each against its
checksum, and that it is finite, as its bytes arrive; a bad checkpoint is reported by name and
the previous one is used.

Why the manager's save is synchronous (`enable_async_checkpointing=False`) on our thread rather
than orbax's own async save: the checksum and finiteness pass must come before the write (a
non-finite state is never written at all) and must not run on the training thread (it takes
longer than the host copy), so a thread of ours runs first anyway, and it then writes too; the
training thread waits only for the host copy, as with orbax's async save.

Multi-process jobs: process 0 alone writes (the others hand it their stages' state,
`Trainer._save`), and any process may die at any time. Orbax's cross-process barriers
(`sync_global_processes` at save start/end, directory creation and deletion; the async
commit's `wait_at_barrier`) would wait for dead processes until their timeout, so the manager
runs with `MultiprocessingOptions(primary_host=me, active_processes={me})`: with one active
process that is this one, every orbax barrier is skipped (`multihost.should_skip_process_sync`,
`get_barrier_sync_fn`), and this process does the primary host's work (finalize, retention).
That needs `create=False` (orbax refuses to create the root with `active_processes`): the
writer creates it. The one other jax.distributed call in `CheckpointManager.save`,
`reached_preemption_sync_point`, compares the step with JAX's preemption sync manager's agreed
step under a lock (the agreement itself runs on that manager's thread);
`test_multiprocess.py::test_frozen_processes_then_preemption` saves through it with a process
declared dead. The wait for a save is bounded by our thread's join
(`CheckpointWriter.wait(timeout_s)`); a failed save leaves every committed checkpoint as it was
(a step saved again has its earlier copy set aside, and put back if the new one fails).

A manager is made per save (it costs about a millisecond): it lists the folder as it is then,
so orbax's retention never acts on a stale list, and `_retain` applies `keep` across both
layouts (orbax counts only its own folders).
"""

from __future__ import annotations

import dataclasses
import hashlib
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
from resilient_jax.checkpoint.lease import Superseded
from resilient_jax.exit_codes import EXIT_CHECKPOINT
from resilient_jax.observe.logs import hold_back_library_info, info

LEGACY_PREFIX = "step_"
"""Step folders of older versions: `step_00000012`."""
TMP_PREFIX = ".tmp-"
ORBAX_TMP = ".orbax-checkpoint-tmp"
"""orbax's unfinished step folders: `12.orbax-checkpoint-tmp-<time>`."""
STATE_ITEM, META_ITEM = "state", "meta"
META_FILE = "metadata"
"""The JSON item's file (`meta/metadata`); older versions wrote `meta.json` in the folder."""
FORMAT = "resilient_jax.universal.v1"
META_DIGEST = "meta_sha256"
"""The metadata's own checksum: sha256 of its canonical JSON without this field (`meta_digest`)."""


class CheckpointError(RuntimeError):
  """A checkpoint is missing, incomplete or corrupt; the message names the bad item."""

  exit_code = EXIT_CHECKPOINT


def _step_of(name: str) -> int | None:
  """The step of a committed step folder's name (`12`, or an older `step_00000012`)."""
  digits = name[len(LEGACY_PREFIX):] if name.startswith(LEGACY_PREFIX) else name
  return int(digits) if digits.isdigit() else None


def step_dir(root: Path, step: int) -> Path:
  """The folder of `step`'s checkpoint: the one on disk (orbax's `12` before an older
  `step_00000012`), else where a save writes it (`12`)."""
  new = Path(root) / str(step)
  if new.exists():
    return new
  old = Path(root) / f"{LEGACY_PREFIX}{step:08d}"
  return old if old.exists() else new


def meta_path(path: Path) -> Path:
  """A checkpoint folder's metadata file: `meta/metadata`, or `meta.json` in older ones."""
  old = Path(path) / "meta.json"
  return old if old.exists() else Path(path) / META_ITEM / META_FILE


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """`{"blocks.3.mlp.fc.kernel": a}` -> `{"blocks": {"3": {"mlp": {"fc": {"kernel": a}}}}}`:
  the tree of `nnx.state(model, nnx.Param)`, with string keys as orbax stores them."""
  out: dict[str, Any] = {}
  for name, value in flat.items():
    *parents, leaf = name.split(".")
    node = out
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return out


def _scan(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
  """(CRC32, finite) of every array in one pass over its bytes (`reader.checksum_and_finite`),
  arrays in parallel: zlib and numpy release the GIL on large buffers."""
  names = sorted(arrays, key=lambda k: -arrays[k].nbytes)
  with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    return dict(zip(names, pool.map(lambda k: reader.checksum_and_finite(arrays[k]), names),
                    strict=True))


def _local_only():
  import jax
  import orbax.checkpoint as ocp

  # One active process, this one: orbax skips every barrier (see the module docstring).
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def _state_handler():
  import orbax.checkpoint as ocp

  # No compression: parameters barely compress, and zstd made a cold restore of a 1.3 GB
  # checkpoint take 3.7x the raw read of its files (1.0x without).
  # The layout is pinned (one OCDBT database, zarr v2 arrays): `load` reads it directly.
  return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, use_compression=False,
                                     multiprocessing_options=_local_only())


def _checkpointer():
  """A checkpointer of the `state` item alone (`benchmarks/checkpoint.py` restores with it)."""
  import orbax.checkpoint as ocp

  return ocp.Checkpointer(_state_handler(), multiprocessing_options=_local_only())


def _manager(root: Path, keep: int):
  import orbax.checkpoint as ocp

  hold_back_library_info()
  local = _local_only()
  # The commit is the rename of the finished tmp folder (pinned: orbax would pick a "commit
  # file" written into the final folder on object stores, where a crash mid-save leaves a
  # final name on a partial checkpoint).
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep or None, create=False, enable_async_checkpointing=False,
    multiprocessing_options=local,
    temporary_path_class=ocp.path.atomicity.AtomicRenameTemporaryPath)
  return ocp.CheckpointManager(
    root.absolute(), options=options, item_names=(STATE_ITEM, META_ITEM),
    item_handlers={STATE_ITEM: _state_handler(),
                   META_ITEM: ocp.JsonCheckpointHandler(filename=META_FILE,
                                                        multiprocessing_options=local)})


def non_finite(scanned: Mapping[str, tuple[str, bool]]) -> list[str]:
  """Names of the arrays holding an inf or NaN, from `_scan`'s results."""
  return sorted(k for k, (_, finite) in scanned.items() if not finite)


def meta_digest(meta: Mapping[str, Any]) -> str:
  """sha256 (hex) of `meta`'s canonical JSON (sorted keys, no spaces), `META_DIGEST` left out."""
  body = {k: v for k, v in meta.items() if k != META_DIGEST}
  return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                        ).hexdigest()


def step_folders(root: str | Path) -> list[tuple[int, Path]]:
  """Every folder named as a step's (either layout), committed or not, by step."""
  root = Path(root)
  if not root.is_dir():
    return []
  found = ((_step_of(p.name), p) for p in root.iterdir())
  return sorted((step, p) for step, p in found if step is not None and p.is_dir())


def committed_steps(root: str | Path) -> list[int]:
  """Steps with a committed (fully written and renamed) checkpoint, ascending; either
  layout."""
  return sorted({step for step, p in step_folders(root) if meta_path(p).exists()})


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
  """A checkpoint folder's metadata, checked before anything trusts it.

  Raises:
    CheckpointError: unreadable (a non-UTF-8 byte too), another format, its checksum fails, its
      `step` is not its folder's (`12/` holding step 7 would silently skip a step), or it lacks
      what a load needs: a damaged checkpoint, so `load_latest` falls back.
  """
  file = meta_path(path)
  rel = file.relative_to(path)
  try:
    meta = json.loads(file.read_bytes())
  except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
    raise CheckpointError(f"{path}: {rel} unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    fmt = meta.get("format") if isinstance(meta, dict) else None
    raise CheckpointError(f"{path}: unknown format {fmt!r}")
  # Checkpoints written before the checksum have none: they load as they always did (backward
  # compatible), checked only by the field tests below.
  if META_DIGEST in meta and meta[META_DIGEST] != meta_digest(meta):
    raise CheckpointError(f"{path}: {rel} fails its checksum (edited or damaged)")
  step, folder = meta.get("step"), _step_of(path.name)
  if not isinstance(step, int) or isinstance(step, bool):
    raise CheckpointError(f"{path}: {rel} has no step")
  if folder is not None and step != folder:
    raise CheckpointError(f"{path}: {rel} says step {step}, but its folder is step {folder}'s")
  if not all(isinstance(meta.get(k, {}), dict) for k in ("layout", "data", "model")):
    raise CheckpointError(f"{path}: {rel} has a damaged layout, data or model section")
  # A load trusts these fields to size and check every array: a damaged metadata is a corrupt
  # checkpoint (fall back), not a KeyError halfway through the load.
  entries = meta.get("entries")
  for group in reader.GROUPS:
    infos = entries.get(group) if isinstance(entries, dict) else None
    if not isinstance(infos, dict) or not all(_entry_info(i) for i in infos.values()):
      raise CheckpointError(f"{path}: {rel} lacks the {group} entries' shapes and checksums")
  return meta


def _entry_info(info: Any) -> bool:
  """Whether an entry's metadata has a shape (ints), a dtype and a CRC32 (strings)."""
  return (isinstance(info, dict) and isinstance(info.get("shape"), list)
          and all(isinstance(d, int) and d >= 0 for d in info["shape"])
          and isinstance(info.get("dtype"), str) and isinstance(info.get("crc32"), str))


def load(path: str | Path, workers: int | None = None) -> Loaded:
  """Reads and verifies one checkpoint folder, entries in parallel.

  Args:
    path: the checkpoint folder (`.../12`, or an older `.../step_00000012`).
    workers: arrays read and verified at once (default `reader.default_workers()`).

  Raises:
    CheckpointError: missing files, a missing entry, or an entry whose checksum, shape or
      dtype differs from the metadata, or that holds an inf/NaN (the message names it).
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
  """The newest checkpoint that verifies; each newer one is named and skipped, with why (a
  log line each: corrupt, non-finite, damaged metadata, a step folder without metadata)."""
  root = Path(root)
  committed = committed_steps(root)
  newest = committed[-1] if committed else None
  for step, path in reversed(step_folders(root)):
    if not meta_path(path).exists() and (newest is None or step > newest):
      log(f"checkpoint folder {path} has no {META_ITEM}/{META_FILE} (damaged, or never "
          "committed): skipped")
  for step in reversed(committed):
    try:
      return load(step_dir(root, step))
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
    self.waited_s: list[float] = []
    """Per save: how long of `blocked_s` was waiting for the previous save."""
    self.write_s: list[float] = []
    """Per save: how long the background write took."""
    self.fence: Callable[[int], None] | None = None
    """Called with the step just before each commit; what it raises (`lease.Superseded`: a
    newer job took the workdir) stops the commit."""

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
    self.waited_s.append(self.clock() - t0)
    host = jax.device_get({"params": dict(params), "opt_state": dict(opt_state)})
    self.blocked_s.append(self.clock() - t0)
    self._thread = threading.Thread(target=self._write, args=(step, host, dict(meta)),
                                    name=f"checkpoint-{step}", daemon=False)
    self._thread.start()

  def busy(self) -> bool:
    """Whether a save is still being written (a new `save` would wait for it)."""
    return self._thread is not None and self._thread.is_alive()

  def wait(self, timeout_s: float | None = None) -> bool:
    """Blocks until the save in flight (if any) is committed.

    Returns:
      False if it was still running after `timeout_s` (it goes on in the background).

    Raises:
      CheckpointError: the save failed (its checkpoint was not committed).
      Superseded: the fence stopped its commit (a newer job took the workdir).
    """
    if self._thread is not None:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        return False
      self._thread = None
    if self._error is not None:
      err, self._error = self._error, None
      if isinstance(err, Superseded):
        raise err  # not a failed write: its own exit code
      raise CheckpointError(f"a background checkpoint save failed: {err}") from err
    return True

  def remove_unfinished(self) -> list[str]:
    """Removes the folders of saves that never committed (their writer died: orbax's
    `*.orbax-checkpoint-tmp-*`, or an older version's `.tmp-*`); returns their names. Call
    before the first save."""
    if not self.root.is_dir():
      return []
    stale = sorted(p for p in self.root.iterdir() if _unfinished(p.name))
    for p in stale:
      shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]

  def _write(self, step: int, host: dict, meta: dict) -> None:
    import orbax.checkpoint as ocp

    t0 = self.clock()
    final = self.root / str(step)
    aside = None
    try:
      tree = {g: {k: np.asarray(v) for k, v in host[g].items()} for g in reader.GROUPS}
      scanned = {g: _scan(arrays) for g, arrays in tree.items()}
      bad = non_finite(scanned["params"]) + non_finite(scanned["opt_state"])
      if bad:
        raise CheckpointError(f"the state of step {step} is not finite ({', '.join(bad[:3])}"
                              f"{', ...' if len(bad) > 3 else ''}): not written")
      entries = {}
      for g, arrays in tree.items():
        entries[g] = {k: {"shape": list(a.shape), "dtype": str(a.dtype),
                          "crc32": scanned[g][k][0]} for k, a in arrays.items()}
      meta = {"format": FORMAT, "step": step, **meta, "entries": entries,
              "bytes": int(sum(a.nbytes for g in tree.values() for a in g.values()))}
      meta = json.loads(json.dumps(meta))  # as a load reads it back, to checksum that
      meta[META_DIGEST] = meta_digest(meta)
      if self.fence is not None:
        self.fence(step)  # the last check before the commit; raising here touches nothing
      self.root.mkdir(parents=True, exist_ok=True)
      if final.exists():
        # A step saved again (redone after its checkpoint failed to load): orbax refuses an
        # existing step, so the old copy is set aside until the new one has committed.
        aside = self.root / f"{TMP_PREFIX}old-{step}-{uuid.uuid4().hex[:8]}"
        final.rename(aside)
      # A manager per save: it lists the folder as it is now (a step set aside, folders
      # removed by hand), so retention never acts on a stale list.
      with _manager(self.root, self.keep) as manager:
        manager.save(step, force=True, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.PyTreeSave({"params": nest(tree["params"]),
                                           "opt_state": tree["opt_state"]}),
          META_ITEM: ocp.args.JsonSave(meta)}))
      if not meta_path(final).exists():
        raise CheckpointError(f"orbax did not commit {final}")
      self._retain()
    except BaseException as e:  # reported on the next save or wait
      self._error = e
      for p in self.root.iterdir() if self.root.is_dir() else ():
        if p.name.startswith(f"{step}{ORBAX_TMP}"):
          shutil.rmtree(p, ignore_errors=True)
      if aside is not None and not final.exists():
        aside.rename(final)  # the failed save leaves what was there
        aside = None
    finally:
      if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
      self.write_s.append(self.clock() - t0)

  def _retain(self) -> None:
    """Retention across both layouts (orbax's `max_to_keep` counts only its own folders, so a
    resumed older workdir would keep its `step_*` ones forever): the newest `keep` steps stay;
    an older `step_*` folder of a step saved again is removed."""
    steps = committed_steps(self.root)
    old = set(steps[:-self.keep] if self.keep > 0 else [])
    for p in self.root.iterdir():
      step = _step_of(p.name)
      if step is None:
        continue
      superseded = p.name.startswith(LEGACY_PREFIX) and (self.root / str(step)).exists()
      if step in old or superseded:
        shutil.rmtree(p, ignore_errors=True)


def _unfinished(name: str) -> bool:
  return name.startswith(TMP_PREFIX) or ORBAX_TMP in name
