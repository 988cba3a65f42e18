"""How a process joins a `jax.distributed` job, and how it ends when the distributed runtime
aborts it: one line and a documented exit code instead of a C++ stack and 134.

Every wait here is bounded by `distributed.wait_timeout_s`: the probe of the coordinator's
address before JAX's own join, and that join (`initialization_timeout`). A join that outlasts
it ends in the client's fatal log (`client.h:80] Terminating process ...` and a 20-line C++
stack) written to stderr before the abort this module turns into an exit code; nothing in
Python runs between the two (the join holds the GIL). So the join can run with the process's
stderr in a file (`native_log_to`): the abort puts stderr back before its one line, which names
the file; a join that returns writes what the file caught to stderr as it came, and removes it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from resilient_jax.exit_codes import EXIT_WAIT_TIMEOUT, end_process
from resilient_jax.runtime.liveness import probe_address

_ABORT_HANDLER: Any = None
_REAL_STDERR: int | None = None
"""A duplicate of the process's stderr while `native_log_to` holds fd 2 (None otherwise)."""


@contextlib.contextmanager
def native_log_to(path: str | os.PathLike) -> Iterator[None]:
  """Runs the body with file descriptor 2 (what C++ logs to) writing to `path`.

  An abort inside the body (`exit_on_abort`) puts stderr back first and leaves the file for
  its line to name. Otherwise, at the end, what the file caught goes to stderr and the file is
  removed: a join that succeeds prints what it always printed. A file that cannot be created
  leaves stderr as it is.
  """
  global _REAL_STDERR
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  except OSError:
    fd = None
  if fd is None:
    yield
    return
  _REAL_STDERR = os.dup(2)
  os.dup2(fd, 2)
  os.close(fd)
  try:
    yield
  finally:
    sys.stderr.flush()
    restore_stderr()
    try:
      with open(path, "rb") as f:
        caught = f.read()
      os.unlink(path)
    except OSError:
      caught = b""
    if caught:
      os.write(2, caught)


def restore_stderr() -> None:
  """Puts back the stderr `native_log_to` moved to a file (nothing when it has not). Safe from
  a C-level signal handler (system calls only)."""
  global _REAL_STDERR
  saved, _REAL_STDERR = _REAL_STDERR, None
  if saved is not None:
    os.dup2(saved, 2)
    os.close(saved)


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
    restore_stderr()  # what the user sees from here on: the line below, or the bug's abort
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
  """Where process 0's coordination service listens: on the address the job names, never on
  every interface (JAX's default). An IP address is used as it is (loopback for `launch.local`:
  nothing from another host reaches it); a host name (SLURM's coordinator is the first node's
  name) is resolved, and its first address that is not loopback and belongs to this host is
  used. A name with no such address binds loopback: the one it resolves to here, or 127.0.0.1
  where it does not resolve (a name that is a loopback alias on its own host, `127.0.1.1 NAME`,
  then shuts the other hosts out and the job does not form within `distributed.wait_timeout_s`:
  name the coordinator by its IP address, or make the name resolve to it). None only without a
  coordinator (JAX's own detection names it)."""
  import ipaddress

  if not coordinator:
    return None
  host, port = coordinator.rsplit(":", 1)
  host = host.strip("[]")
  try:
    ipaddress.ip_address(host)
    return coordinator
  except ValueError:
    pass
  try:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except OSError:
    infos = []
  loopback = None
  for family, _, _, _, sockaddr in infos:
    ip = sockaddr[0]
    at = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
    if ipaddress.ip_address(ip).is_loopback:
      loopback = loopback or at
      continue
    try:  # one of this host's own addresses (process 0 runs on the coordinator's host)
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
    except OSError:
      continue
    return at
  return loopback or f"127.0.0.1:{port}"


def detected_job(timeout_s: int) -> tuple[str | None, int | None, int | None, list[int] | None]:
  """What `jax.distributed.initialize()` would detect from the cluster's environment (SLURM,
  TPU VMs, GKE, MPI): (coordinator, processes, process id, local device ids), None where
  nothing was found. Detected here, once, so that process 0 knows the coordinator's address
  before it starts the service and can bind it there (`bind_address`), and the others can wait
  for it with a bound (`await_coordinator`). `JAX_LOCAL_DEVICE_IDS` is read as JAX reads it."""
  from jax._src.clusters import ClusterEnv

  env_ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
  ids = [int(x) for x in env_ids.split(",")] if env_ids else None
  coordinator, n, pid, ids = ClusterEnv.auto_detect_unset_distributed_params(
    None, None, None, ids, None, timeout_s)
  return coordinator, n, pid, (list(ids) if ids is not None else None)


def join_arguments(cfg: Any, wait_s: int, kwargs: dict[str, Any]) -> tuple[str, int, int]:
  """Adds the job's coordinator, process count, id, device ids and the service's bind address
  to `kwargs` (`jax.distributed.initialize`'s): the configured ones, else the cluster's
  (`detected_job`; SLURM's coordinator is the first node's name). Returns (coordinator,
  processes, process id), "", 0 and -1 where neither says.

  Args:
    cfg: the job's `DistributedConfig`.
    wait_s: the bound on detecting them.
    kwargs: updated in place.
  """
  coordinator, num_processes, process_id = cfg.coordinator, cfg.num_processes, cfg.process_id
  if not coordinator:
    found, found_n, found_id, device_ids = detected_job(wait_s)
    coordinator = found or ""
    num_processes = num_processes or found_n or 0
    process_id = process_id if process_id >= 0 else (-1 if found_id is None else found_id)
    if device_ids is not None:
      kwargs["local_device_ids"] = device_ids
  if coordinator:
    kwargs["coordinator_address"] = coordinator
    kwargs["coordinator_bind_address"] = bind_address(coordinator)
  if num_processes:
    kwargs["num_processes"] = num_processes
  if process_id >= 0:
    kwargs["process_id"] = process_id
  return coordinator, num_processes, process_id
