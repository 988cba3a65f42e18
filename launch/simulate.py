"""Simulate resilient training at cluster scale: `python -m launch.simulate --config=... --out=DIR`.

Prints a table (relative throughput against concurrent failures per policy, then each policy
through a failure trace) and writes results.json, sim_trace.png and sim_failures.png to --out.
Exit codes: 0 done, 2 bad configuration, flags or input files (one line on stderr).
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a configs/sim/*.py file.", lock_config=True
)
_OUT = flags.DEFINE_string("out", None, "Directory for results.json and the PNG plots.")

EXIT_BAD_CONFIG = 2


def _fail(message: str, code: int = EXIT_BAD_CONFIG) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def _last_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[-1] if lines else type(e).__name__


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments {' '.join(argv[1:])}")
  if not _OUT.value:
    _fail("--out is required (e.g. --out=/tmp/sim)")

  from resilient_jax.sim import (
    PolicyUnavailableError,
    SimConfigError,
    format_table,
    from_config_dict,
    run_simulation,
  )

  try:
    # The config file is loaded lazily, on first access: its errors surface here.
    if _CONFIG.value is None:
      _fail("--config is required (e.g. --config=configs/sim/gpt3_6_7b.py)")
    cfg = from_config_dict(_CONFIG.value)
  except SimConfigError as e:
    _fail(str(e))
  except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
    _fail(f"--config: {_last_line(e)}")

  try:
    results = run_simulation(cfg, _OUT.value, log=lambda line: print(line, flush=True))
  except (PolicyUnavailableError, ValueError) as e:
    # Bad input files (profile, trace CSV) and unavailable policies: one line, exit 2.
    _fail(_last_line(e))
  except OSError as e:
    _fail(f"--out={_OUT.value}: {e.strerror or e}")
  print(format_table(results))
  for name in ("results.json", "sim_trace.png", "sim_failures.png"):
    print(f"  {_OUT.value.rstrip('/')}/{name}")


def run(argv: list[str] | None = None) -> None:
  """Parses flags (a bad flag or config override is a one-line error, exit 2), then runs."""
  argv = sys.argv if argv is None else argv
  try:
    remaining = flags.FLAGS(argv)
  except (flags.Error, FileNotFoundError, ValueError, TypeError, AttributeError, KeyError) as e:
    _fail(_last_line(e))
  main(remaining)


if __name__ == "__main__":
  run()
