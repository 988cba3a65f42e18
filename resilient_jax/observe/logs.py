"""Progress lines go through `absl.logging`, at INFO.

Code that reports progress (the trainer, the policy coordinator, the checkpoint reader, the
simulator) takes a `log` callable, a `Logger`. Its default is `info`, which logs the line
through absl, so the launchers' `--verbosity`, `--log_dir`, `--logtostderr` and
`--alsologtostderr` apply to every line. A caller may pass any other callable instead:
`lines.append` to capture the lines (the tests do), `print`, or `lambda _: None` for quiet.

absl shows INFO lines once flags are parsed by `absl.app.run` (the launchers). A script of
your own that calls `resilient_jax.train` shows them with
`absl.logging.set_verbosity(absl.logging.INFO)`, or with `log=print`. The launchers hold back
other libraries' INFO lines (`LibraryInfoFilter`) below `--verbosity=1`.
"""

from __future__ import annotations

import importlib.util
import logging as py_logging
import os
from collections.abc import Callable, Iterable

from absl import logging

Logger = Callable[[str], None]

LIBRARIES = ("orbax", "jax", "jaxlib", "flax", "grain", "tensorstore", "etils")
"""Libraries whose INFO lines `LibraryInfoFilter` holds back: orbax alone logs some twenty
lines per checkpoint save at INFO (through absl, like ours), jax its backend probing."""


def info(line: str) -> None:
  """Logs one progress line at INFO (the line as given: no %-formatting)."""
  logging.info("%s", line)


# absl names the file and line that logged; skipping this function names its caller
# (loop.py:571), not logs.py.
logging.ABSLLogger.register_frame_to_skip(__file__, "info")


class LibraryInfoFilter(py_logging.Filter):
  """Passes warnings and errors, this project's INFO lines, and `LIBRARIES`' INFO lines only
  at absl's debug verbosity (`--verbosity=1`): orbax logs some forty INFO lines per save.

  Lines are told apart by the file that logged them, since orbax logs through absl's logger
  as this project does.
  """

  def __init__(self, libraries: Iterable[str] = LIBRARIES):
    super().__init__()
    dirs = []
    for name in libraries:
      spec = importlib.util.find_spec(name)  # finds the package without importing it
      dirs.extend(os.path.realpath(d) + os.sep for d in (spec and
                                                          spec.submodule_search_locations or ()))
    self.dirs = tuple(dirs)
    self._theirs: dict[str, bool] = {}

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING or not self.dirs:
      return True
    theirs = self._theirs.get(record.pathname)
    if theirs is None:
      theirs = os.path.realpath(record.pathname).startswith(self.dirs)
      self._theirs[record.pathname] = theirs
    return not theirs or logging.get_verbosity() > logging.INFO


_held_back = False


def hold_back_library_info() -> None:
  """Puts `LibraryInfoFilter` on absl's logger, once per process (the launchers call it, and
  the checkpoint writer before its first save, so a script of your own gets it too)."""
  global _held_back
  if not _held_back:
    _held_back = True
    logging.get_absl_logger().addFilter(LibraryInfoFilter())
