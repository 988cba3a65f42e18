"""One compile of a program per cache folder, whichever processes need it at the same time.

The processes of a job that share the folder of kept programs (`compiled.set_cache_dir`: the
hosts of a cluster on a shared file system, or the processes of one host) need the same stage
programs at the same moment: every data-parallel replica of a stage starts by building them.
Each would compile them on its own. Instead the first to need a program claims it (a
`NAME.compiling` file, created exclusively), compiles it and keeps it; the others wait for the
kept file and load it. So a cold job compiles each stage's programs once, not once per process
that runs the stage.

Every wait is bounded and no claim outlives its holder:
- the holder touches its claim every `BEAT_S` while it compiles; a claim untouched for
  `STALE_S` is stale (its holder died or hung, on whatever host) and is taken over;
- a holder on this host that no longer runs (SIGKILLed mid-compile) is seen at once;
- whoever has waited `WAIT_S` in all compiles the program itself.
A folder where no claim can be made (read-only, full) changes nothing: each process compiles.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

BEAT_S = 1.0
"""How often a holder touches its claim while it compiles."""
STALE_S = 15.0
"""A claim untouched this long is stale."""
WAIT_S = 600.0
"""The longest a process waits for another's compile before compiling the program itself."""
_POLL_S = 0.05
_HOST = socket.gethostname()


def _holder(claim: str) -> tuple[str, int] | None:
  """The (host, pid) written in `claim`, or None if it cannot be read (gone, or being written)."""
  try:
    with open(claim) as f:
      host, pid = f.read().split()
    return host, int(pid)
  except (OSError, ValueError):
    return None


def _stale(claim: str) -> bool:
  """Whether `claim`'s holder is gone: not running on this host, or silent for `STALE_S`."""
  try:
    age = time.time() - os.stat(claim).st_mtime
  except OSError:
    return False  # released meanwhile: not stale, just gone
  holder = _holder(claim)
  if holder is not None and holder[0] == _HOST:
    try:
      os.kill(holder[1], 0)
    except ProcessLookupError:
      return True
    except PermissionError:  # another user's process: running
      pass
  return age > STALE_S


@contextlib.contextmanager
def _beating(claim: str) -> Iterator[None]:
  """Touches `claim` every `BEAT_S` until the block ends, then removes it."""
  done = threading.Event()

  def beat() -> None:
    while not done.wait(BEAT_S):
      with contextlib.suppress(OSError):
        os.utime(claim)

  thread = threading.Thread(target=beat, name="compile-claim", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()
    with contextlib.suppress(OSError):
      os.remove(claim)


def compile_once(path: str, read: Callable[[str], Any], compile_and_keep: Callable[[], Any],
                 wait_s: float = WAIT_S) -> tuple[Any, bool]:
  """The program kept at `path`: read if there, else compiled here or by another process.

  Args:
    path: where the compiled program is kept.
    read: `read(path)`: the kept program, or None while there is none.
    compile_and_keep: compiles the program and keeps it at `path`; its result is returned.
    wait_s: the longest wait for another process's compile.

  Returns:
    `(read(path), False)` when another process compiled it, `(compile_and_keep(), True)`
    when this one did.
  """
  claim = f"{path}.compiling"
  deadline = time.monotonic() + wait_s
  while True:
    kept = read(path)
    if kept is not None:
      return kept, False
    try:
      fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      if _stale(claim):
        with contextlib.suppress(OSError):
          os.remove(claim)  # a racing taker-over finds it gone: O_EXCL decides between them
        continue
      if time.monotonic() > deadline:
        return compile_and_keep(), True
      time.sleep(_POLL_S)
      continue
    except OSError:  # no claim possible here: compile without one
      return compile_and_keep(), True
    with os.fdopen(fd, "w") as f:
      f.write(f"{_HOST} {os.getpid()}\n")
    with _beating(claim):
      kept = read(path)  # kept between our read and our claim
      return (kept, False) if kept is not None else (compile_and_keep(), True)
