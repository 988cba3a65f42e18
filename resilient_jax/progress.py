"""Progress lines for work that runs long without any other output.

A first step that compiles every stage program, a checkpoint restore and a simulator sweep can
each take tens of seconds on a small machine. `reporting` logs a line every few seconds while
such a block runs, and nothing when it ends sooner, so a quick run's output stays as it was.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

EVERY_S = 10.0


@contextlib.contextmanager
def reporting(
  log: Callable[[str], None], say: Callable[[float], str], every_s: float = EVERY_S
) -> Iterator[None]:
  """Calls `log(say(elapsed_s))` every `every_s` seconds until the block ends.

  Args:
    log: where the line goes.
    say: the line, given the seconds since the block began (reads live counters if it likes).
    every_s: seconds between lines; the first comes after `every_s`.
  """
  done = threading.Event()
  t0 = time.monotonic()

  def tick() -> None:
    while not done.wait(every_s):
      try:
        log(say(time.monotonic() - t0))
      except Exception:  # noqa: BLE001 - a progress line must never break the work it reports
        return

  thread = threading.Thread(target=tick, name="progress", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join(timeout=every_s)
