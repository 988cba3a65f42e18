"""How a process joins a `jax.distributed` job, and how it ends when the distributed runtime
aborts it: one line and a documented exit code instead of a C++ stack and 134.

Every wait here is bounded by `distributed.wait_timeout_s`: the probe of the coordinator's
address before JAX's own join, and that join (`initialization_timeout`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from resilient_jax.exit_codes import EXIT_WAIT_TIMEOUT, end_process
from resilient_jax.runtime.liveness import probe_address

_ABORT_HANDLER: Any = None


def exit_on_abort(code: int, why: str | Callable[[], str],
                  only_if: Callable[[], bool] | None = None) -> None:
  """Turns SIGABRT into exit `code`, with one line saying `why` (or what it returns then);
  with `only_if`, only when that holds at the abort (else the abort goes on: a bug shown as
  one).

  The distributed client's own error handler aborts the process from a C++ thread: when the
  coordination service goes away (often before the cluster's watchdog notices), and when
  joining the job outlasts its deadline. That would exit with 134 and a C++ stack rather than
  the documented code. Python's `signal` module cannot intercept it (its handlers run later, on
  the main thread), so a C-level handler is installed through ctypes.
  """
  global _ABORT_HANDLER
  import ctypes
  import signal

  handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

  def on_abort(signum: int) -> None:
    if only_if is not None and not only_if():
      default_on_abort()
      os.abort()
    text = why() if callable(why) else why
    end_process(code, f"{text}; exiting with code {code}")

  _ABORT_HANDLER = handler_type(on_abort)
  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = [ctypes.c_int, handler_type]
  libc.signal(signal.SIGABRT, _ABORT_HANDLER)


def default_on_abort() -> None:
  """SIGABRT aborts again (undoes `exit_on_abort`)."""
  import ctypes
  import signal

  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
  libc.signal(signal.SIGABRT, None)  # SIG_DFL


def await_coordinator(address: str, wait_s: float, who: str) -> None:
  """Returns once something accepts connections at `address` (process 0's coordination
  service); past `wait_s`, ends this process with one line and `EXIT_WAIT_TIMEOUT`: a wrong or
  unreachable address is told as such, before JAX's own wait (which would end in an abort and a
  C++ stack) begins."""
  deadline = time.monotonic() + wait_s
  while probe_address(address) is not False:
    if time.monotonic() > deadline:
      end_process(EXIT_WAIT_TIMEOUT, f"{who}: nothing answers at the coordinator address "
                  f"{address} after {wait_s:.0f}s (distributed.wait_timeout_s): is it right, and "
                  f"is process 0 up? exiting with code {EXIT_WAIT_TIMEOUT}")
    time.sleep(0.1)


def bind_address(coordinator: str) -> str | None:
  """Where process 0's coordination service listens: on the address the job names when that is
  an IP address (loopback for `launch.local`: nothing from another host reaches it), rather
  than JAX's default of every interface; None (the default) for a host name, which could
  resolve to a loopback alias on its own host and shut the other hosts out."""
  import ipaddress

  if not coordinator:
    return None
  host = coordinator.rsplit(":", 1)[0].strip("[]")
  try:
    ipaddress.ip_address(host)
  except ValueError:
    return None
  return coordinator
