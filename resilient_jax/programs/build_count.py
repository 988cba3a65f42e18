"""Counting what gets built: `OnEachDevice` programs compiled, loaded, read from disk, and
every XLA compilation, per owner (a training run, a benchmark) and thread.

Growth: one listener call per XLA compilation; a count per counter counting in that thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import jax

from resilient_jax.observe.records import Built


@dataclasses.dataclass
class BuildCounter:
  """What one owner (a training run, a benchmark) saw built while it counted (`counting`):
  `OnEachDevice` programs compiled, loaded from another device's compile, and read from disk;
  `xla`: every XLA compilation, JAX's persistent cache reads included (any jitted or eager
  program).

  `build_s`: seconds spent building `OnEachDevice` programs (lowering, compiling, loading);
  `other_xla_s`: seconds of XLA compilation outside them (eager ops, plain `jax.jit`s).

  Programs are shared by everything in the process (a second run builds nothing), so what a
  counter sees is what its owner's thread caused to be built while it counted.
  """

  compiled: int = 0
  loaded: int = 0
  from_disk: int = 0
  xla: int = 0
  build_s: float = 0.0
  other_xla_s: float = 0.0

  @contextlib.contextmanager
  def counting(self) -> Iterator[BuildCounter]:
    """Counts what this thread builds inside the block (counters nest: each one counts)."""
    stack = _counters()
    stack.append(self)
    try:
      yield self
    finally:
      stack.remove(self)

  def built(self) -> Built:
    """What it has counted so far (differences of two are what happened between them)."""
    return Built(self.build_s + self.other_xla_s, self.compiled, self.from_disk, self.loaded,
                 self.xla)


local = threading.local()  # per thread: the counters counting, and whether a build is running


def _counters() -> list[BuildCounter]:
  if not hasattr(local, "counters"):
    local.counters = []
  return local.counters


def count(field: str, amount: float = 1) -> None:
  for c in _counters():
    setattr(c, field, getattr(c, field) + amount)


def _count_xla(event: str, duration_s: float, **_: Any) -> None:
  if event == "/jax/core/compile/backend_compile_duration":  # `jax._src.dispatch`'s name
    count("xla")
    if not getattr(local, "building", False):  # a build times itself whole
      count("other_xla_s", duration_s)


jax.monitoring.register_event_duration_secs_listener(_count_xla)
