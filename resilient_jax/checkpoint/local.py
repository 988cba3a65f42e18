"""Local copies: the state a survivor writes when process 0 is lost, and the choice of the step
a relaunch resumes from (local copies and shared checkpoints together).

Why: process 0 hosts `jax.distributed`'s coordination service, so its loss ends every process
(exit 5), and a relaunch that resumes from the last periodic checkpoint loses up to
`checkpoint.every_steps` steps of the whole job, though the survivors held every stage's state
of the last committed step a moment before. So each survivor, as it ends, writes the state of
its own stages at its last committed step to `checkpoint.local_dir` (the local tier of
MaxText's emergency checkpoints), and the relaunch resumes from the newest step that every
stage can be read at, from those copies or from a shared checkpoint (`newest_common_step`).
Data-parallel replicas hold the same stage state, so one copy per stage suffices: the job writes
dp of them, and any survivor's will do.

Layout of `<local_dir>/process_<P>/<STEP>/`: `state.bin`, every array's C-order bytes one after
another, and `meta.json`: the step, the lease token of the job that wrote it (`lease.py`: a copy
from another job on this workdir, or from an older run at the same path, is refused), the data
and model sections of a checkpoint's metadata (`run_meta.checkpoint_meta`: a copy of another
model or sample order is refused), per entry its shape, dtype, byte offset and CRC32 (the
format's one checksum, `reader.checksum_and_finite`, checked as the bytes are read back), and
`meta_sha256` (`store.meta_digest`). A copy is written into a `.tmp-*` folder and renamed when
complete, so one cut short never has a final name; it is never written into the shared
`checkpoints/`, so no copy can damage a checkpoint there.

Why a flat file rather than orbax's format: its writer is a process whose coordination service
has gone. Orbax's save reaches into `jax.distributed` (its preemption sync point) and its own
machinery; one sequential write needs nothing but the disk, and a copy lives for one relaunch.

Costs, per process, when process 0 is lost: bytes = the state of the stages it holds (their
parameters and optimizer state, once per stage whatever replicas of it the process holds), never
anybody else's: nothing is gathered. Time = the device-to-host copy of those bytes + one CRC32
pass + one sequential write (1.4-2.3 ms per MiB on this machine's disk, flat from 16 to 256 MiB:
`benchmarks/local_copy.py`), bounded by `distributed.wait_timeout_s` (past it the process exits
without a copy). At the relaunch each process reads every copy's `meta.json` (a few kB each:
dp x pp of them in all) and its own stages' bytes once, verified as they are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax.checkpoint import reader
from resilient_jax.checkpoint.run_meta import check_resumable
from resilient_jax.checkpoint.store import META_DIGEST, CheckpointError, Loaded, meta_digest
from resilient_jax.config import ConfigError, RunConfig

FORMAT = "resilient_jax.local.v1"
PROCESS_PREFIX = "process_"
STATE_FILE, META_FILE = "state.bin", "meta.json"
TMP_PREFIX = ".tmp-"


def process_dir(local_dir: str | os.PathLike, process: int) -> Path:
  """Where `process` writes its copies."""
  return Path(local_dir) / f"{PROCESS_PREFIX}{process}"


def write_copy(local_dir: str | os.PathLike, process: int, step: int,
               state: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> Path:
  """Writes `process`'s copy of `step` (`state`: `{"params": {name: array}, "opt_state":
  {key: array}}` on the host) and removes its older copies; returns the copy's folder.

  Raises:
    CheckpointError: the state holds an inf or NaN (such a state is never written).
    OSError: the disk refused it (nothing is left under a final name).
  """
  root = process_dir(local_dir, process)
  root.mkdir(parents=True, exist_ok=True)
  tmp = root / f"{TMP_PREFIX}{step}-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()
  try:
    entries: dict[str, dict[str, Any]] = {g: {} for g in reader.GROUPS}
    offset = 0
    with (tmp / STATE_FILE).open("wb") as f:
      for group in reader.GROUPS:
        for name, value in sorted(state[group].items()):
          a = np.asarray(value)  # not ascontiguousarray: it makes a scalar 1-D
          crc, finite = reader.checksum_and_finite(a)
          if not finite:
            raise CheckpointError(f"the state of step {step} is not finite ({name}): not written")
          f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
          entries[group][name] = {"shape": list(a.shape), "dtype": str(a.dtype), "crc32": crc,
                                  "offset": offset}
          offset += a.nbytes
      f.flush()
      os.fsync(f.fileno())
    body = json.loads(json.dumps({"format": FORMAT, "step": step, "process": process, **meta,
                                  "entries": entries, "bytes": offset}))
    body[META_DIGEST] = meta_digest(body)
    (tmp / META_FILE).write_text(json.dumps(body))
    final = root / str(step)
    if final.exists():
      shutil.rmtree(final)
    tmp.rename(final)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  for old in root.iterdir():  # one copy a process: older ones, and unfinished ones of any step
    if old.name != str(step):
      shutil.rmtree(old, ignore_errors=True)
  return final


@dataclasses.dataclass(frozen=True)
class Copy:
  """One readable copy: its folder and verified metadata."""

  path: Path
  meta: dict[str, Any]

  @property
  def step(self) -> int:
    return self.meta["step"]

  @property
  def names(self) -> frozenset[tuple[str, str]]:
    """(group, name) of every entry it holds."""
    return frozenset((g, n) for g in reader.GROUPS for n in self.meta["entries"][g])


def _read_meta(path: Path) -> dict[str, Any]:
  """A copy's metadata, checked before anything trusts it (as `store.read_meta` checks a
  checkpoint's)."""
  try:
    meta = json.loads((path / META_FILE).read_bytes())
  except (OSError, ValueError, RecursionError) as e:
    raise CheckpointError(f"{path}: {META_FILE} unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CheckpointError(f"{path}: not a local copy")
  if meta.get(META_DIGEST) != meta_digest(meta):
    raise CheckpointError(f"{path}: {META_FILE} fails its checksum (edited or damaged)")
  if meta.get("step") != int(path.name):
    raise CheckpointError(f"{path}: {META_FILE} is not of step {path.name}")
  entries = meta.get("entries")
  ok = isinstance(entries, dict) and all(
    isinstance(entries.get(g), dict) and all(
      isinstance(i, dict) and isinstance(i.get("offset"), int) and isinstance(i.get("dtype"), str)
      and isinstance(i.get("shape"), list) and isinstance(i.get("crc32"), str)
      for i in entries[g].values()) for g in reader.GROUPS)
  if not ok:
    raise CheckpointError(f"{path}: {META_FILE} lacks its entries' offsets and checksums")
  return meta


def scan(local_dir: str | os.PathLike, accept: Callable[[dict[str, Any]], str],
         log: Callable[[str], None]) -> list[Copy]:
  """Every copy under `local_dir` (any process's folder this process can see) whose metadata
  verifies and that `accept` takes (it returns why not, or ""). Each damaged one is named in a
  log line; those refused are named by reason, one line each (the copies of an older job stay
  until their process writes its next one). Unfinished copies (`.tmp-*`) pass in silence."""
  found = []
  refused: dict[str, list[Path]] = {}
  for proc in sorted(Path(local_dir).glob(f"{PROCESS_PREFIX}*")):
    for path in sorted(proc.iterdir()) if proc.is_dir() else ():
      if not path.name.isdigit():
        continue
      try:
        meta = _read_meta(path)
      except CheckpointError as e:
        log(f"local copy skipped: {e}")
        continue
      why = accept(meta)
      if why:
        refused.setdefault(why, []).append(path)
        continue
      found.append(Copy(path, meta))
  for why, paths in refused.items():
    more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
    log(f"local copy {paths[0]}{more} refused: {why}")
  return found


def refusal(meta: Mapping[str, Any], token: str, cfg: RunConfig) -> str:
  """Why a copy cannot be resumed from by the run `cfg` ("" if it can): written by another job
  than the one whose lease `token` the workdir holds, or of another model or sample order
  (`run_meta.check_resumable`, as for a checkpoint)."""
  if meta.get("token") != token:
    return ("written by another job than the one that last held this workdir (an older run, "
            "or another workdir's)")
  try:
    check_resumable(cfg, Loaded(meta["step"], {}, {}, dict(meta), Path(".")))
  except ConfigError as e:
    return str(e).replace(" in .", "")
  except (KeyError, TypeError):
    return "its data or model section is damaged"
  return ""


def covered_steps(needs: Iterable[tuple[str, str]], holdings: Iterable[tuple[int, Iterable[
    tuple[str, str]]]]) -> set[int]:
  """The steps at which every entry of `needs` is held by some source.

  Args:
    needs: (group, name) of every entry one process's stages need.
    holdings: (step, entries held) of each source: a local copy, or a shared checkpoint (which
      holds every entry).
  """
  held: dict[int, set[tuple[str, str]]] = {}
  for step, names in holdings:
    held.setdefault(step, set()).update(names)
  need = set(needs)
  return {step for step, names in held.items() if need <= names}


def newest_common_step(covered: Mapping[int, Iterable[int]], at_most: int | None = None
                       ) -> int | None:
  """The newest step every process can be resumed at (`covered`: its steps, by process), at
  most `at_most`; None if there is none."""
  sets = [set(s) for s in covered.values()]
  common = set.intersection(*sets) if sets else set()
  common = {s for s in common if at_most is None or s <= at_most}
  return max(common) if common else None


def read_entries(copy: Copy, names: Iterable[tuple[str, str]]) -> dict[tuple[str, str],
                                                                        np.ndarray]:
  """The arrays `names` of `copy` that read back whole and match their CRC32 and are finite;
  a damaged entry is left out (the caller takes it from another source or none)."""
  with contextlib.suppress(ImportError):
    import ml_dtypes  # noqa: F401 - registers bfloat16 and friends with numpy
  out: dict[tuple[str, str], np.ndarray] = {}
  try:
    f = (copy.path / STATE_FILE).open("rb")
  except OSError:
    return out
  with f:
    for group, name in names:
      info = copy.meta["entries"][group].get(name)
      if info is None:
        continue
      try:
        a = np.empty(tuple(int(d) for d in info["shape"]), np.dtype(info["dtype"]))
        f.seek(info["offset"])
        if f.readinto(a.reshape(-1).view(np.uint8)) != a.nbytes:  # truncated
          continue
      except (OSError, TypeError, ValueError):
        continue
      crc, finite = reader.checksum_and_finite(a)
      if crc == info["crc32"] and finite:
        out[(group, name)] = a
  return out


def pick_resume(covered: Mapping[int, Iterable[int]], newest_shared: int, rows: int
                ) -> tuple[int | None, str]:
  """The step to resume from the local copies: the newest every process can be resumed at
  (`covered`, by process), if newer than the newest shared checkpoint and not past `rows` (the
  last step `metrics.jsonl` holds: the optimizer's schedule counts its rows); else None and why
  not (the shared checkpoint is resumed from)."""
  step = newest_common_step(covered, at_most=rows)
  if step is not None and step > newest_shared:
    return step, ""
  best = newest_common_step(covered)
  if best is not None and best > max(rows, newest_shared):
    return None, f"metrics.jsonl ends at step {rows}, before them"
  return None, "they hold no step newer than it of every stage"


def read_step(copies: Iterable[Copy], needs: Iterable[tuple[str, str]], step: int,
              log: Callable[[str], None] = lambda _: None,
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
  """Every entry of `needs` at `step` (`{name: array}` of the params, of the optimizer state),
  each from the first copy of that step that holds it whole: an entry damaged in one replica's
  copy is read from another's (`log` names the damaged ones). None if some entry is in none."""
  need = set(needs)
  got: dict[tuple[str, str], np.ndarray] = {}
  for copy in (c for c in copies if c.step == step):
    want = sorted(n for n in need - got.keys() if n in copy.names)
    if want:
      read = read_entries(copy, want)
      got.update(read)
      bad = [n for g, n in want if (g, n) not in read]
      if bad:
        log(f"local copy {copy.path}: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} "
            f"({bad[0]}{', ...' if len(bad) > 1 else ''}) failed its CRC32 check or read "
            "short: not loaded from it")
  if got.keys() != need:
    return None
  return ({n: a for (g, n), a in got.items() if g == "params"},
          {n: a for (g, n), a in got.items() if g == "opt_state"})
