"""What every entry point in `launch/` shares: bad input is one line on stderr and exit 2.

Config files behind `ml_collections.config_flags` load lazily, so their errors can surface while
flags are parsed or on first access; both paths end here with the most specific line of the
error rather than a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from absl import flags

EXIT_BAD_CONFIG = 2

# What flag parsing and config loading raise for bad input (absl, ml_collections, the file).
INPUT_ERRORS = (flags.Error, OSError, ValueError, TypeError, AttributeError, KeyError)


def fail(message: str, code: int = EXIT_BAD_CONFIG) -> NoReturn:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def last_line(e: BaseException) -> str:
  """The most specific line of an error message (config loaders nest their causes)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[-1] if lines else type(e).__name__


def run(main: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
  """Parses flags (a bad flag or config override is a one-line error, exit 2), then `main`."""
  argv = sys.argv if argv is None else argv
  try:
    remaining = flags.FLAGS(argv)
  except INPUT_ERRORS as e:
    fail(last_line(e))
  main(remaining)
