"""The workdir's lease: at most one job ever goes on committing checkpoints to a workdir.

Two jobs can end up training one workdir: process 0 frozen past the heartbeat, the others exit 5,
the scheduler requeues the job, and the frozen process, let go, trains on alone. So every job
start takes `WORKDIR/lease` (process 0 alone: in a job only it commits checkpoints, and the
others follow its verdict through the coordination service, never reading the file), writing a
generation one above the last and a token of its own; every checkpoint commit first reads the
lease back (one small file, O(1) per commit), and a process that finds another job's token there
commits nothing and stops: `Superseded`, exit 7 (like a process declared dead, it was left
behind and the job goes on without it: do not requeue it).

Why no lock file: a lock whose holder died must be broken by its age, which on a shared
filesystem compares clocks of different hosts. The lease is written to a temporary file named
by its token and renamed into place, which is atomic on POSIX and NFS, so the last job to start
wins and every other finds out at its next commit (two starting at once: the loser at once,
reading the lease back). Its generation is for people reading logs, its token decides.

What it does not close: the window between a commit's check and orbax's rename of the finished
folder (milliseconds to a large checkpoint's write; the writer checks again just before its
commit), and a job with checkpointing off, which never commits, trains on to its end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilient_jax.exit_codes import EXIT_DECLARED_DEAD

LEASE_FILE = "lease"


class Superseded(RuntimeError):
  """A newer job took the workdir's lease: this one commits nothing more and stops."""

  exit_code = EXIT_DECLARED_DEAD


def read_lease(path: Path) -> dict[str, Any] | None:
  """The lease on disk (`generation`, `token`, `holder`, `since`), or None if there is none or
  it does not read (damaged)."""
  try:
    lease = json.loads(path.read_bytes())
  except (OSError, ValueError, RecursionError):
    return None
  ok = (isinstance(lease, dict) and isinstance(lease.get("generation"), int)
        and isinstance(lease.get("token"), str))
  return lease if ok else None


@dataclasses.dataclass(frozen=True)
class Lease:
  """This job's hold on a workdir (`take` it at the start, `check` before each commit)."""

  path: Path
  generation: int
  token: str
  log: Callable[[str], None] = dataclasses.field(default=lambda _: None, compare=False)

  @classmethod
  def take(cls, workdir: str | os.PathLike, log: Callable[[str], None] = lambda _: None
           ) -> Lease:
    """Writes a new generation of the lease into `workdir`.

    Raises:
      Superseded: another job took it at the same moment, and won.
    """
    path = Path(workdir) / LEASE_FILE
    before = read_lease(path)
    lease = cls(path, (before["generation"] if before else 0) + 1,
                f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}", log)
    lease._write()
    lease.check("start")
    if before:
      log(f"workdir lease: generation {lease.generation} ({path}); generation "
          f"{before['generation']} ({before.get('holder', '?')}) can no longer commit a "
          "checkpoint here")
    return lease

  def _write(self) -> None:
    tmp = self.path.with_name(f".{LEASE_FILE}.tmp-{self.token.rsplit(':', 1)[-1]}")
    body = {"generation": self.generation, "token": self.token,
            "holder": self.token.rsplit(":", 1)[0], "since": round(time.time(), 3)}
    try:
      with tmp.open("w") as f:
        f.write(json.dumps(body) + "\n")
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, self.path)
    finally:
      tmp.unlink(missing_ok=True)

  def check(self, what: str) -> None:
    """Raises `Superseded` unless the lease is still this job's (`what`: what it guards, for
    the message). A lease gone or damaged was not another job's doing (each writes it whole,
    by a rename): it is written again, with a log line."""
    now = read_lease(self.path)
    if now is None:
      self.log(f"{self.path} was missing or damaged; written again (generation "
               f"{self.generation})")
      self._write()
      return
    if now["token"] != self.token:
      raise Superseded(
        f"a newer job took over {self.path.parent} (lease generation {now['generation']}, "
        f"{now.get('holder', '?')}; this job holds {self.generation}): {what} not committed, "
        "stopping without writing there again")
