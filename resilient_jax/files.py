"""Output files that survive a crash: rewrites are atomic, append-only logs tolerate a torn end.

A process can die at any instruction (SIGKILL, a lost host, a full disk). A file rewritten in
place can then be left empty or half-written, and a JSON-lines log appended to can end in half
a line. So every rewrite goes to a temporary file in the same folder that is renamed over the
target (atomic on POSIX), and readers of append-only logs drop a torn last line, saying so.

A damaged log never stops a run either: a line that is not UTF-8, not JSON or not a row of its
file (a stray `[]`) is set aside in `NAME.damaged` with one log line, and the run goes on with
the rows that read. Only a path of the wrong kind (a directory where `metrics.jsonl` belongs,
a file where the `checkpoints` folder does) stops it, before anything is written: one line,
exit 2, as for any unusable workdir, because moving someone's directory or file out of the way
is not the library's call.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from resilient_jax.exit_codes import EXIT_BAD_CONFIG

Logger = Callable[[str], None]

DAMAGED_SUFFIX = ".damaged"
"""Where `read_jsonl` sets aside the lines of `NAME` it cannot read: `NAME.damaged`."""
RUN_FILES = ("metrics.jsonl", "config.json", "recovery.json", "goodput.json", "schedule.txt",
             "lease")
"""Files a run rewrites or reads back in its workdir: each must be a file if it exists."""
RUN_DIRS = ("checkpoints",)
"""Folders a run reads back and writes in its workdir: each must be a folder if it exists. Any
run may save a checkpoint (preempted, `train.stop_after`), not only one that saves every few
steps, so a file there is refused for every run."""


class UnusableFile(ValueError):
  """A path the run must read or rewrite is not a readable file (a directory, no permission):
  a bad workdir, one line and exit 2."""

  exit_code = EXIT_BAD_CONFIG


def check_run_files(workdir: str | os.PathLike, names: Iterable[str] = RUN_FILES,
                    dirs: Iterable[str] = RUN_DIRS) -> None:
  """Raises `UnusableFile` if one of the workdir's `names` exists and is not a file, or one of
  its `dirs` exists and is not a directory (one stat each: run before anything is written, so
  a refused run changes nothing)."""
  for name in names:
    path = Path(workdir) / name
    if path.exists() and not path.is_file():
      raise UnusableFile(f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}"
                         ", not the file a run keeps there: move it out of the way")
  for name in dirs:
    path = Path(workdir) / name
    if path.exists() and not path.is_dir():
      raise UnusableFile(f"{path} is {'a file' if path.is_file() else 'not a directory'}, not "
                         "the folder a run keeps its checkpoints in: move it out of the way")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Replaces `path` with `text`: a reader sees the old content or the new, never a mix."""
  path = Path(path)
  # Unique per writer, so two hosts sharing the folder (the same pid) never share a temp file.
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  try:
    with tmp.open("w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
  write_text_atomic(path, json.dumps(value, indent=1, default=str) + "\n")


def read_jsonl(path: str | os.PathLike, log: Logger | None = None,
               valid: Callable[[Any], bool] | None = None, set_aside: bool = False) -> list[Any]:
  """The rows of a JSON-lines file.

  A torn last line (its writer died mid-write) is dropped. Any other line that does not read
  (not UTF-8, not JSON, or a value `valid` refuses) is damage, not a crash: it is dropped too,
  and with `set_aside` its bytes are appended to `NAME.damaged`. `log` gets one line for all.

  Raises:
    UnusableFile: `path` is not a regular file (a directory) or cannot be read.
  """
  path = Path(path)
  if not path.exists():
    return []
  check_run_files(path.parent, [path.name], dirs=())
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise UnusableFile(f"{path}: cannot read it ({e.strerror or e})") from None
  lines = raw.split(b"\n")
  rows, bad, torn = [], [], None
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    why = _unreadable(line, valid, rows)
    if why is None:
      continue
    if i == len(lines) - 1 and why == "not JSON":  # no newline after it: its writer stopped
      # inside it (a crash, not damage: not kept)
      torn = (i + 1, "not whole JSON (its writer stopped mid-write)", line)
    else:
      bad.append((i + 1, why, line))
  where = _set_aside(path, bad) if bad and set_aside else None
  if (bad or torn) and log is not None:
    log(_dropped(path, bad + ([torn] if torn else []), where))
  return rows


def _unreadable(line: bytes, valid: Callable[[Any], bool] | None, rows: list[Any]) -> str | None:
  """Appends the line's row to `rows`, or says why it is not one."""
  try:
    row = json.loads(line.decode("utf-8"))
  except UnicodeDecodeError:
    return "not UTF-8"
  except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
    return "not JSON"
  if valid is not None and not valid(row):
    return "not a row of this file"
  rows.append(row)
  return None


def _set_aside(path: Path, bad: list[tuple[int, str, bytes]]) -> str:
  """Appends the bad lines to `NAME.damaged`; says where they went."""
  aside = path.with_name(path.name + DAMAGED_SUFFIX)
  try:
    with aside.open("ab") as f:
      f.write(b"".join(line + b"\n" for _, _, line in bad))
  except OSError as e:
    return f"not kept: {aside} is not writable ({e.strerror or e})"
  return f"kept in {aside}"


def _dropped(path: Path, bad: list[tuple[int, str, bytes]], where: str | None) -> str:
  """The one log line for the lines `read_jsonl` dropped."""
  if len(bad) == 1 and where is None:
    n, why, line = bad[0]
    return f"{path}: dropped line {n}, which is {why}: {line[:60].decode(errors='replace')!r}"
  shown = "; ".join(f"line {n}: {why}" for n, why, _ in bad[:3]) + ("; ..." if len(bad) > 3
                                                                       else "")
  return f"{path}: dropped {len(bad)} unreadable line(s) ({shown})" + (f", {where}" if where
                                                                        else "")


OUTPUT_ORDER = ("metrics.jsonl", "recovery.json", "timeline.png", "timeline.json", "schedule.txt")


def run_outputs(workdir: str | os.PathLike, since: float) -> tuple[list[str], list[str]]:
  """The workdir's entries (hidden ones left out), as `(written, earlier)`: those written at or
  after `since` (a `time.time()`), so by the run that started then, and those left by an
  earlier run on the same workdir (e.g. a resumed run's timelines of steps it did not run).
  The main outputs come first, then the rest by name, numbers in order (step 4 before 11)."""
  names = sorted(
    (n for n in os.listdir(workdir) if not n.startswith(".")),
    key=lambda n: (OUTPUT_ORDER.index(n) if n in OUTPUT_ORDER else len(OUTPUT_ORDER),
                   [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", n)]),
  )
  written, earlier = [], []
  for name in names:
    (written if os.path.getmtime(os.path.join(workdir, name)) >= since else earlier).append(name)
  return written, earlier
