"""Simulate resilient training at cluster scale: `python -m launch.simulate --config=... --out=DIR`.

Prints a table (relative throughput against concurrent failures per policy, then each policy
through a failure trace, then each policy's ETTR with its losses) and writes results.json,
sim_trace.png, sim_failures.png, sim_goodput.png and TensorBoard events (tb/) to --out;
progress lines are absl log lines (`--log_dir`, `--verbosity`, see `--helpfull`).
Exit codes: 0 done, 2 bad configuration, flags or input files (one line on stderr).
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from . import cli

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a configs/sim/*.py file.", lock_config=True
)
_OUT = flags.DEFINE_string("out", None, "Directory for results.json and the PNG plots.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {' '.join(argv[1:])} (flags are written --name=value)")

  from resilient_jax.sim import (
    PolicyUnavailableError,
    format_table,
    from_config_dict,
    run_simulation,
  )

  cfg = cli.load_config(_CONFIG, from_config_dict, "configs/sim/gpt3_6_7b.py")
  out = cli.writable_dir("--out", _OUT.value)
  try:
    results = run_simulation(cfg, out)  # progress: absl logging at INFO
  except (PolicyUnavailableError, ValueError) as e:
    # Bad input files (profile, trace CSV) and unavailable policies: one line, exit 2.
    cli.fail(cli.last_line(e))
  except OSError as e:
    cli.fail(f"--out={_OUT.value}: {e.strerror or e}")
  print(format_table(results))
  for name in ("results.json", "sim_trace.png", "sim_failures.png", "sim_goodput.png", "tb/"):
    print(f"  {_OUT.value.rstrip('/')}/{name}")
  log = cli.log_file()
  if log:
    print(f"log: {log}")


def run() -> None:
  """The `resilient-jax-simulate` console script (`python -m launch.simulate`)."""
  cli.run(main)


if __name__ == "__main__":
  run()
