"""Progress lines for work that runs long without any other output.

A first step that compiles every stage program, a checkpoint restore and a simulator sweep can
each take tens of seconds on a small machine. `reporting` logs a line every few seconds while
such a block runs, and nothing when it ends sooner, so a quick run's output stays as it was.

Every step runs inside such a block, so entering one must cost next to nothing: blocks are
entries in a table that one watcher thread per process (started on first use) reads, not a
thread each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator

EVERY_S = 10.0


@dataclasses.dataclass
class _Block:
  log: Callable[[str], None]
  say: Callable[[float], str]
  every_s: float
  began: float
  due: float


_lock = threading.Lock()  # held while a line is made and logged, so none follows a block's end
_blocks: dict[int, _Block] = {}
_tokens = itertools.count()
_wake = threading.Event()
_watcher: threading.Thread | None = None


def _watch() -> None:
  while True:
    with _lock:
      now = time.monotonic()
      for token, block in list(_blocks.items()):
        if block.due <= now:
          block.due = now + block.every_s
          try:
            block.log(block.say(now - block.began))
          except Exception:  # noqa: BLE001 - a progress line must never break the work
            _blocks.pop(token, None)
      due = min((b.due for b in _blocks.values()), default=None)
      _wake.clear()
    _wake.wait(None if due is None else max(due - time.monotonic(), 0.0))


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
  global _watcher
  token = next(_tokens)
  now = time.monotonic()
  with _lock:
    _blocks[token] = _Block(log, say, every_s, now, now + every_s)
    if _watcher is None:
      _watcher = threading.Thread(target=_watch, name="progress", daemon=True)
      _watcher.start()
  _wake.set()  # the watcher recomputes when to wake
  try:
    yield
  finally:
    with _lock:
      _blocks.pop(token, None)
