"""The `faults` section of a run's configuration: the failures, rejoins, slowdowns, corruptions
and non-finite steps a run injects to rehearse them, parsed from their one-line specs and
checked before anything is built (`config.from_config_dict` reads the section through
`faults_section`; `config.RunConfig` checks the entries against the grid and the steps).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from resilient_jax.checks import ConfigError

_FAULT_RE = re.compile(r"^(\d+):(\+?)(\d+)\.(\d+)$")


@dataclasses.dataclass(frozen=True)
class Fault:
  """Worker `(dp, stage)` of the configured grid fails at the start of 1-based `step`, or with
  `rejoin` comes back then (a repaired device; it must have failed at an earlier step)."""

  step: int
  dp: int
  stage: int
  rejoin: bool = False

  def __str__(self) -> str:
    return f"{self.step}:{'+' if self.rejoin else ''}{self.dp}.{self.stage}"


def parse_faults(spec: str, key: str = "faults.schedule") -> tuple[Fault, ...]:
  """Parses `STEP:DP.STAGE` failures and `STEP:+DP.STAGE` rejoins, comma-separated, e.g.
  `3:1.1,6:+1.1` (worker (1, 1) fails at the start of step 3 and comes back at step 6).

  Raises:
    ConfigError: a malformed entry.
  """
  faults = []
  for part in filter(None, (p.strip() for p in spec.split(","))):
    m = _FAULT_RE.match(part)
    if not m:
      raise ConfigError(f"{key} entry {part!r} is neither STEP:DP.STAGE (a failure, "
                        "e.g. 2:1.1) nor STEP:+DP.STAGE (a rejoin, e.g. 5:+1.1)")
    step, plus, dp, stage = m.groups()
    faults.append(Fault(int(step), int(dp), int(stage), rejoin=bool(plus)))
  return tuple(faults)


def check_rejoins(events: Iterable[tuple[int, tuple[int, int], bool]]) -> None:
  """Checks that every rejoin `(step, worker, True)` is of a worker that failed at an earlier
  step and has not come back since, and that every failure `(step, worker, False)` is of a
  worker that is up (a second failure of a failed worker would be silently ignored).

  Raises:
    ConfigError: the first rejoin or failure that is not (one line, naming it).
  """
  down: dict[tuple[int, int], int] = {}  # worker -> the step it failed in
  # At one step, failures come before rejoins: a worker cannot fail and return in one step.
  for step, worker, rejoin in sorted(events, key=lambda e: (e[0], e[2])):
    d, s = worker
    if not rejoin:
      if worker in down:
        raise ConfigError(f"faults.schedule failure {step}:{d}.{s}: worker ({d}, {s}) already "
                          f"failed at step {down[worker]} and has not rejoined (add a rejoin "
                          f"STEP:+{d}.{s} between the two)")
      down[worker] = step
      continue
    failed = down.get(worker)
    if failed is None or failed >= step:
      raise ConfigError(f"faults.schedule rejoin {step}:+{d}.{s}: worker ({d}, {s}) has not "
                        f"failed before step {step}, so it cannot rejoin then")
    del down[worker]


_SLOW_RE = re.compile(r"^(\d+):(\d+)\.(\d+):([0-9]*\.?[0-9]+)$")


@dataclasses.dataclass(frozen=True)
class Slowdown:
  """From 1-based `step` on, every op of worker `(dp, stage)`'s device takes `factor` times as
  long (`faults.slow`; a later entry for the same worker replaces it, factor 1 ends it)."""

  step: int
  dp: int
  stage: int
  factor: float

  def __str__(self) -> str:
    return f"{self.step}:{self.dp}.{self.stage}:{self.factor:g}"


def parse_slowdowns(spec: str, key: str = "faults.slow") -> tuple[Slowdown, ...]:
  """Parses `STEP:DP.STAGE:FACTOR`, comma-separated, e.g. `3:1.0:2,8:1.0:1` (worker (1, 0)
  runs at half speed from step 3, at full speed again from step 8).

  Raises:
    ConfigError: a malformed entry or a factor below 1.
  """
  out = []
  for part in filter(None, (p.strip() for p in spec.split(","))):
    m = _SLOW_RE.match(part)
    if not m or float(m.group(4)) < 1:
      raise ConfigError(f"{key} entry {part!r} is not STEP:DP.STAGE:FACTOR with FACTOR >= 1 "
                        "(e.g. 3:1.0:2: worker (1, 0)'s ops take twice as long from step 3)")
    out.append(Slowdown(int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))))
  return tuple(out)


def slowdowns_at(slowdowns: Iterable[Slowdown], step: int) -> dict[tuple[int, int], float]:
  """`{(dp, stage): factor}` of the slowdowns in force at `step` (the latest entry of each
  worker at or before it), those at factor 1 left out."""
  latest: dict[tuple[int, int], Slowdown] = {}
  for f in slowdowns:
    w = (f.dp, f.stage)
    if f.step <= step and (w not in latest or f.step >= latest[w].step):
      latest[w] = f
  return {w: f.factor for w, f in latest.items() if f.factor > 1}


@dataclasses.dataclass(frozen=True)
class FaultsConfig:
  schedule: tuple[Fault, ...] = ()
  """Workers to fail at the start of a step (`STEP:DP.STAGE,...`): a device lost inside a live
  process, which loses that worker only (in a job every process applies the same schedule;
  `launch/local.py --kill` loses whole processes)."""
  nonfinite: tuple[tuple[int, int], ...] = ()
  """`STEP:STAGE,...`: that stage's gradients turn NaN at that step on every replica, in-process
  or in a job, to rehearse a diverging step (skipped, see `train.max_nonfinite_steps`)."""
  corrupt: tuple[Fault, ...] = ()
  """`STEP:DP.STAGE,...`: one bit of that worker's parameters flips after that step commits (in
  the process that holds it): silent data corruption, for `resilience.check_replicas_every`."""
  slow: tuple[Slowdown, ...] = ()
  """`STEP:DP.STAGE:FACTOR,...`: from that step on, that worker's ops take FACTOR times as long
  (1 ends it): a straggler, for `resilience.straggler_every` (`training/stragglers.py`)."""


def faults_section(raw: dict) -> dict:
  """The `faults` section of a config dict with its specs parsed (`from_config_dict`)."""
  spec = raw.get("schedule", "")
  raw["schedule"] = parse_faults(spec) if isinstance(spec, str) else tuple(spec)
  spec = raw.get("corrupt", "")
  raw["corrupt"] = parse_faults(spec, "faults.corrupt") if isinstance(spec, str) else tuple(spec)
  if any(f.rejoin for f in raw["corrupt"]):
    raise ConfigError("faults.corrupt entries are STEP:DP.STAGE (a bit flips in that worker's "
                      "parameters after that step), not rejoins")
  spec = raw.get("slow", "")
  raw["slow"] = parse_slowdowns(spec) if isinstance(spec, str) else tuple(spec)
  spec = raw.get("nonfinite", "")
  if isinstance(spec, str):
    pairs = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
      m = re.match(r"^(\d+):(\d+)$", part)
      if not m:
        raise ConfigError(f"faults.nonfinite entry {part!r} is not STEP:STAGE (e.g. 3:1)")
      pairs.append((int(m.group(1)), int(m.group(2))))
    spec = pairs
  raw["nonfinite"] = tuple(tuple(p) for p in spec)
  return raw
