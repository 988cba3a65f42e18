"""Published failure mixes: which share of a job's interruptions loses what, and for how long.

A mix is a tuple of `traces.Cause`; `traces.mix_trace` draws a trace from it at a job's
interruption rate. Hardware causes keep their unit out until a spare takes its place
(`hardware_repair_s`); transient causes (software, hangs, timeouts) until the process is
relaunched on the same hardware (`transient_repair_s`). Which unit a cause takes (a device, its
host, or a rack switch's hosts) is read off the component. docs/simulator.md states every
assumption with its source.

* `llama3`: Llama 3 405B's 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s
  (Llama Team, "The Llama 3 Herd of Models", 2024, Table 5; the counts, which sum to 419: the
  table's percentage for faulty GPUs, 30.1%, does not match its own count, 148 = 35.3%).
* `byterobust`: a mix shaped after the categories ByteRobust reports for its 9,600-GPU job
  (Wan et al., "Robust LLM Training Infrastructure at ByteDance", 2025): explicit GPU and host
  failures, network flaps that recover by themselves, user-space errors, hangs. The paper gives
  no shares this module could copy; the shares are this project's assumption (about two
  thirds hardware, the rest transient), stated as such.
"""

from __future__ import annotations

from collections.abc import Callable

from resilient_jax.sim.traces import Cause

__all__ = ["MIXES", "byterobust_mix", "llama3_mix"]

# (component, interruptions, scope, transient) from Llama 3's Table 5.
_LLAMA3 = (
  ("faulty GPU", 148, "device", False),
  ("GPU HBM3 memory", 72, "device", False),
  ("software bug", 54, "node", True),
  ("network switch/cable", 35, "switch", False),
  ("host maintenance", 32, "node", False),
  ("GPU SRAM memory", 19, "device", False),
  ("GPU system processor", 17, "device", False),
  ("NIC", 7, "device", False),
  ("NCCL watchdog timeout", 7, "node", True),
  ("silent data corruption", 6, "device", False),
  ("GPU thermal interface + sensor", 6, "device", False),
  ("SSD", 3, "node", False),
  ("power supply", 3, "node", False),
  ("server chassis", 2, "node", False),
  ("IO expansion board", 2, "node", False),
  ("dependency", 2, "node", True),
  ("CPU", 2, "node", False),
  ("system memory", 2, "node", False),
)

# ByteRobust's categories with assumed shares (see the module docstring).
_BYTEROBUST = (
  ("GPU unavailable / CUDA error", 50, "device", False),
  ("host hardware (disk, memory, power)", 14, "node", False),
  ("NIC or switch flap", 14, "switch", True),
  ("user-space error", 14, "node", True),
  ("job hang / NCCL timeout", 8, "node", True),
)


def _mix(rows, hardware_repair_s: float, transient_repair_s: float) -> tuple[Cause, ...]:
  return tuple(
    Cause(name, float(count), scope, transient_repair_s if transient else hardware_repair_s)
    for name, count, scope, transient in rows
  )


def llama3_mix(hardware_repair_s: float, transient_repair_s: float) -> tuple[Cause, ...]:
  """Llama 3 405B's unexpected interruptions by component (shares: counts out of 419)."""
  return _mix(_LLAMA3, hardware_repair_s, transient_repair_s)


def byterobust_mix(hardware_repair_s: float, transient_repair_s: float) -> tuple[Cause, ...]:
  """ByteRobust's failure categories, shares assumed (see the module docstring)."""
  return _mix(_BYTEROBUST, hardware_repair_s, transient_repair_s)


MIXES: dict[str, Callable[[float, float], tuple[Cause, ...]]] = {
  "llama3": llama3_mix,
  "byterobust": byterobust_mix,
}
"""Mixes by the name `trace.mix` gives."""
