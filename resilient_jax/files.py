"""Output files that survive a crash: rewrites are atomic, append-only logs tolerate a torn end.

A process can die at any instruction (SIGKILL, a lost host, a full disk). A file rewritten in
place can then be left empty or half-written, and a JSON-lines log appended to can end in half
a line. So every rewrite goes to a temporary file in the same folder that is renamed over the
target (atomic on POSIX), and readers of append-only logs drop a torn last line, saying so.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

Logger = Callable[[str], None]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Replaces `path` with `text`: a reader sees the old content or the new, never a mix."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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


def read_jsonl(path: str | os.PathLike, log: Logger | None = None) -> list[Any]:
  """The rows of a JSON-lines file. A line that does not parse (a torn last line: its writer
  died mid-write) is dropped and reported through `log`."""
  path = Path(path)
  if not path.exists():
    return []
  rows = []
  for i, line in enumerate(path.read_text().splitlines()):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if log is not None:
        log(f"{path}: dropped line {i + 1}, which is not whole JSON (its writer stopped "
            f"mid-write): {line[:60]!r}")
  return rows


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
