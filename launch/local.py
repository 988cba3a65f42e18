"""Run a multi-process job on this machine, optionally killing processes with SIGKILL.

  python -m launch.local --num_processes=2 --devices_per_process=4 --kill=3:1 -- \\
      --config=configs/gpt_tiny.py --workdir=/tmp/run --config.mesh.dp=2 --config.mesh.pp=4

starts 2 processes of `launch.train` on 127.0.0.1 (`jax.distributed`, process 0 hosting the
coordination service), each a host of 4 simulated CPU devices driving 4 workers (which ones:
`mesh.placement`, `resilient_jax/spec/placement.py`; `mesh.dp * mesh.pp * mesh.tp` must equal
processes x devices: with `--config.mesh.tp=2` a worker is a sub-mesh of 2 of them), streams
their output prefixed with `[pN]`, and at the start of step 3 SIGKILLs process 1 from outside:
its 4 workers are lost at once. `--kill=STEP:PROCESS[:WHERE]`,
comma-separated; WHERE picks the moment within the step: `start` (default, before the step's
first op), an op of that process such as `F1`, `B0`, `W3`, `BW0` (1F1B's and GPipe's fused
backward) or `FR2` (right after it was dispatched), or `AR` (inside the gradient all-reduce, the
peers already waiting in it), or `save` (as the step's checkpoint save begins, before the
process hands its state to process 0; the step must save one): the first of the process's
workers to reach it stops it. A kill
point none of that process's workers reaches in the configured schedule is an error before
anything starts. The victim stops at that point and announces it; the launcher then kills it
and appends the kill time to `WORKDIR/kills.jsonl`, which the survivors use for `recovery.json`.

`--stop` takes points the same way and freezes the process there with SIGSTOP instead (a hung
host: its ports stay open, only its heartbeat stops); `--stop_s=S` lets it go again (SIGCONT)
after S seconds, when it finds itself declared dead and exits 7 if the others went on without
it; with 0 it stays frozen and is killed once the others are done. `--term` takes one such
point: when that process reaches it, every running process gets SIGTERM (a preemption).

`--slow=STEP:DP.STAGE:FACTOR,...` makes worker (DP, STAGE)'s ops take FACTOR times as long
from STEP on (1 ends it), in whichever process holds it: a straggler, passed to every process as
`--config.faults.slow` (`resilient_jax/training/stragglers.py`).

`--relaunch=STEP:PROCESS` starts a process named in `--kill` (or `--stop`) again, with the same
command, when the job reaches step STEP: process 0 holds before that step (its admission already
decided, its timing not yet begun) until the new process has joined the job and announced
itself, while the other processes are inside the step waiting for process 0; the live processes
admit it at the next step boundary (before step STEP+1) and it trains from there with state
from a live peer (`resilient_jax/runtime/admission.py`). STEP must come after the kill and
before the last step; process 0 cannot be relaunched (its death ends the job) and takes no other
point then.

The arguments after `--` are `launch.train`'s (`python -m launch.train --help` lists them; absl's
logging flags there apply to every worker, e.g. `--log_dir=D`: one log file per process). They
are checked as `launch.train` reads them (`launch/cli.py`) before any process starts: a bad
flag, config, workdir or process count, or a `--port` another program holds, is one line on
stderr and exit 2.

Exit code: 0 if every process that was not killed finished with 0, or if process 0 did (the job
completed) and the others it went on without were declared dead (7) or ended by a signal (a
crash from outside, survived like a --kill); else the first other code among them
(`launch/train.py` documents them; 5 means a process lost the coordination service: process 0
was lost, or its host was cut off; a process ended by signal N counts as 128 + N). No process
outlives the launcher.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from absl import flags, logging

from resilient_jax.exit_codes import EXIT_DECLARED_DEAD, EXIT_OK
from resilient_jax.schedule.core import AR, COMPUTE_KINDS, Op

from . import cli

if TYPE_CHECKING:
  from resilient_jax.config import RunConfig
  from resilient_jax.schedule.plan import SlotProgram
  from resilient_jax.spec.model import ModelConfig

_NUM = flags.DEFINE_integer("num_processes", 2, "Processes (hosts) to start.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Simulated CPU devices per process: "
                                "each process drives that many / mesh.tp workers.")
_KILL = flags.DEFINE_string("kill", "", "STEP:PROCESS[:WHERE],... processes to SIGKILL.")
_STOP = flags.DEFINE_string("stop", "", "STEP:PROCESS[:WHERE][@SECONDS],... processes to SIGSTOP "
                            "(freeze), each let go after SECONDS (default --stop_s).")
_TERM = flags.DEFINE_string("term", "", "STEP:PROCESS[:WHERE]: when that process reaches that "
                            "point, SIGTERM every running process (a scheduler's preemption).")
_STOP_S = flags.DEFINE_float("stop_s", 0.0, "SIGCONT a --stop process after this many seconds; "
                             "0 leaves it frozen until the others are done.")
_RELAUNCH = flags.DEFINE_string("relaunch", "", "STEP:PROCESS: start a --kill/--stop process "
                                "again when the job reaches STEP (admitted before STEP+1).")
_SLOW = flags.DEFINE_string("slow", "", "STEP:DP.STAGE:FACTOR,... workers whose ops take FACTOR "
                            "x as long from STEP (passed on as --config.faults.slow).")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1; 0 picks a free one.")
_TIMEOUT = flags.DEFINE_integer("timeout", 1800, "Kill everything after this many seconds.")

# WHERE: the step's start, its checkpoint save, the gradient all-reduce, or a compute op of any
# kind a schedule has (F1, B0, W2, BW0, FR3): longest kind first, so that BW0 is not read as B.
_OP_KINDS = "|".join(sorted(COMPUTE_KINDS, key=len, reverse=True))
_KILL_RE = re.compile(rf"^(\d+):(\d+)(?::(start|save|{AR}|(?:{_OP_KINDS})\d+))?$")


def parse_kills(spec: str, num_processes: int, flag: str = "--kill"
                ) -> dict[int, tuple[int, str]]:
  """`STEP:PROCESS[:WHERE],...` (the value of `flag`) -> {process: (step, where)}.

  Raises:
    ValueError: a malformed entry, an unknown process, or a process named twice.
  """
  kills: dict[int, tuple[int, str]] = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    m = _KILL_RE.match(part)
    if not m:
      raise ValueError(f"{flag} entry {part} is not STEP:PROCESS[:WHERE] (WHERE: start, save, "
                       f"AR, or an op: {', '.join(k + '0' for k in COMPUTE_KINDS)}, ...)")
    step, proc, where = int(m.group(1)), int(m.group(2)), m.group(3) or "start"
    if step < 1 or proc >= num_processes:
      raise ValueError(f"{flag} entry {part}: step must be >= 1 and process below "
                       f"--num_processes={num_processes}")
    if proc in kills:
      raise ValueError(f"{flag} names process {proc} twice")
    kills[proc] = (step, where)
  return kills


def check_kills(kills: dict[int, tuple[int, str]], cfg: RunConfig, flag: str = "--kill",
                num_processes: int | None = None) -> None:
  """Checks that every kill point is reached by the run `cfg` when nothing has failed yet.

  Process `p` runs the workers `mesh.placement` puts on it (`placement.process_slots`); their
  ops are those of the plan the configured policy starts with, so this builds that plan (pure
  Python, no JAX). A later kill in a run that has already lost a process may find the plan
  re-routed.

  Raises:
    ValueError: a step past the run's last step, or an op the process does not run.
  """
  last = min(cfg.train.stop_after or cfg.train.steps, cfg.train.steps)
  procs = cfg.mesh.num_workers if num_processes is None else num_processes
  view = None
  for proc, (step, where) in sorted(kills.items()):
    entry = f"{flag} entry {step}:{proc}" + ("" if where == "start" else f":{where}")
    if step > last:
      raise ValueError(f"{entry}: the run ends after step {last}")
    if where == "start":
      continue
    if where == "save":
      every = cfg.checkpoint.every_steps
      if step != last and not (every and step % every == 0):
        raise ValueError(f"{entry}: step {step} saves no checkpoint (checkpoint.every_steps="
                         f"{every}, last step {last})")
      continue
    view = view or _FirstPlan(cfg, procs)
    nodes, mine = view.mine(proc)
    held = ", ".join(f"dp {n // cfg.mesh.pp} stage {n % cfg.mesh.pp}" for n in sorted(nodes))
    worker = f"process {proc} (worker{'s' if len(nodes) > 1 else ''} {held})"
    if where == AR:
      if AR not in view.points(proc):
        raise ValueError(f"{entry}: {worker} reduces its gradients with no other process, so "
                         "it never enters an all-reduce")
      continue
    ops = [op for p in mine for op in p.ops if op.kind in COMPUTE_KINDS]
    if where not in view.points(proc):
      raise ValueError(f"{entry}: {worker} does not run {where} under "
                       f"{view.program.name}; its ops are {_summary(ops)}")


def kill_points(cfg: RunConfig, num_processes: int | None = None) -> dict[int, list[str]]:
  """{process: the points inside a step, besides `start` and `save`, where it can be stopped
  under the plan the run starts with}: its compute ops, and `AR` where it all-reduces a
  gradient with another process. `benchmarks/soak.py` draws its kill points from these."""
  procs = cfg.mesh.num_workers if num_processes is None else num_processes
  view = _FirstPlan(cfg, procs)
  return {p: view.points(p) for p in range(procs)}


class _FirstPlan:
  """The plan a run starts with, seen by process: built the way the run builds it (pure
  Python, no JAX), with the workers `mesh.placement` puts on each process
  (`placement.process_slots`). A kill after a process was lost may find the plan re-routed."""

  def __init__(self, cfg: RunConfig, num_processes: int):
    from resilient_jax.policy.coordinator import RunCoordinator
    from resilient_jax.schedule.plan import step_program
    from resilient_jax.spec.placement import process_slots

    self.cfg = cfg
    self.slots = process_slots(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.placement, num_processes,
                               cfg.mesh.num_devices // num_processes, cfg.mesh.tp)
    coordinator = RunCoordinator(cfg, range(cfg.mesh.num_workers), log=lambda _: None)
    self.program = step_program(coordinator.plan)

  def mine(self, proc: int) -> tuple[set[int], list[SlotProgram]]:
    """The nodes of process `proc` and their slots' programs."""
    nodes = {n for n, (p, _) in self.slots.items() if p == proc}
    return nodes, [p for p in self.program.slots.values() if p.node in nodes]

  def points(self, proc: int) -> list[str]:
    nodes, mine = self.mine(proc)
    ops = [str(op) for p in mine for op in p.ops if op.kind in COMPUTE_KINDS]
    if any(_shares_parameters(a, b, self.cfg.model) for a in mine
           for b in self.program.slots.values() if b.node not in nodes):
      ops.append(AR)
    return list(dict.fromkeys(ops))


def parse_relaunch(spec: str, num_processes: int, last_step: int,
                   lost: dict[int, tuple[int, str]], busy: set[int]) -> tuple[int, int] | None:
  """`STEP:PROCESS` -> (step, process), or None for ''.

  Args:
    spec: the flag's value.
    num_processes: the job's processes.
    last_step: the run's last step.
    lost: {process: (step, where)} of `--kill` and `--stop`.
    busy: processes with a `--kill`/`--stop`/`--term` point (process 0 must not have one: it
      holds at STEP while the relaunched process joins).

  Raises:
    ValueError: a malformed value, or a relaunch that cannot happen as asked.
  """
  if not spec:
    return None
  m = re.match(r"^(\d+):(\d+)$", spec.strip())
  if not m:
    raise ValueError(f"--relaunch={spec} is not STEP:PROCESS (one process)")
  step, proc = int(m.group(1)), int(m.group(2))
  if proc >= num_processes:
    raise ValueError(f"--relaunch={spec}: process must be below --num_processes={num_processes}")
  if proc == 0:
    raise ValueError(f"--relaunch={spec}: process 0 hosts the coordination service; its death "
                     "ends the job, which then resumes from a checkpoint instead")
  if proc not in lost:
    raise ValueError(f"--relaunch={spec}: process {proc} is not named in --kill or --stop")
  if step <= lost[proc][0]:
    raise ValueError(f"--relaunch={spec}: step must come after process {proc} is lost (step "
                     f"{lost[proc][0]})")
  if step >= last_step:
    raise ValueError(f"--relaunch={spec}: the process is admitted before step {step + 1}, but "
                     f"the run ends after step {last_step}")
  if 0 in busy:
    raise ValueError(f"--relaunch={spec}: process 0 holds at step {step} for the relaunch, so "
                     "it takes no --kill, --stop or --term point")
  return step, proc


def _shares_parameters(a: SlotProgram, b: SlotProgram, model: ModelConfig) -> bool:
  """Whether two slots hold a parameter in common (then they all-reduce its gradient)."""
  (lo_a, hi_a), (lo_b, hi_b) = a.split[a.stage], b.split[b.stage]
  if max(lo_a, lo_b) < min(hi_a, hi_b):
    return True
  # The first stage holds the embeddings, the last the final norm and head; a tied head is
  # the token embedding, which the first and the last stage then share.
  ends_a = {e for e, yes in (("first", a.stage == 0), ("last", a.last)) if yes}
  ends_b = {e for e, yes in (("first", b.stage == 0), ("last", b.last)) if yes}
  tied = getattr(model, "tied_head", False)
  return bool(ends_a & ends_b) or (tied and bool(ends_a) and bool(ends_b))


def _summary(ops: list[Op]) -> str:
  """`F4..F7, BW4..BW7`: a worker's compute ops by kind."""
  by_kind: dict[str, list[int]] = {}
  for op in ops:
    by_kind.setdefault(op.kind, []).append(op.mb)
  parts = []
  for kind, mbs in by_kind.items():
    mbs = sorted(set(mbs))
    if len(mbs) > 2 and mbs[-1] - mbs[0] == len(mbs) - 1:  # a contiguous run
      parts.append(f"{kind}{mbs[0]}..{kind}{mbs[-1]}")
    else:
      parts.extend(f"{kind}{m}" for m in mbs)
  return ", ".join(parts)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def port_problem(port: int) -> str | None:
  """Why process 0's coordination service could not listen on 127.0.0.1:`port`, or None.

  A bind of our own, released at once: found here, a taken port is one line before any
  process starts. Found by process 0's gRPC server instead, it was a traceback or a SIGSEGV
  there, and the other processes waited out their join and printed C++ stacks. SO_REUSEADDR,
  as that server sets it: a port whose earlier connections linger in TIME_WAIT is free to it.
  """
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("127.0.0.1", port))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        return f"127.0.0.1:{port} is already taken by another program (pick another port, or " \
               "--port=0 for a free one)"
      return f"cannot listen on 127.0.0.1:{port} ({e.strerror or e})"
  return None


def simulated_devices_env(env: dict[str, str], devices: int) -> dict[str, str]:
  """`env` with XLA_FLAGS simulating `devices` CPU devices (any other count there replaced)."""
  flags_ = [f for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
  return {**env, "XLA_FLAGS": " ".join([*flags_,
                                        f"--xla_force_host_platform_device_count={devices}"])}


def worker_args(train_args: list[str], num_processes: int, process: int, port: int) -> list[str]:
  """`launch.train`'s arguments for one process of the job."""
  return [
    *train_args,
    "--config.distributed.enabled=true",
    f"--config.distributed.coordinator=127.0.0.1:{port}",
    f"--config.distributed.num_processes={num_processes}",
    f"--config.distributed.process_id={process}",
  ]


def _stream(proc: subprocess.Popen, prefix: str, lock: threading.Lock, out: TextIO) -> None:
  """Relays a process's output, each line prefixed: its own absl lines (and errors), as they
  are; the launcher's own lines are absl lines of its own."""
  for raw in iter(proc.stdout.readline, b""):
    line = raw.decode(errors="replace").rstrip("\n")
    with lock:
      print(f"{prefix}{line}", file=out, flush=True)


class Job:
  """The processes of one local job: starts them (each with its pause points), relays their
  output, and records the kills and relaunches in `WORKDIR/kills.jsonl`. `launch` drives one
  through a fixed list of events; `benchmarks/soak.py` through a long random schedule.

  Args:
    num_processes: processes (hosts) of the job.
    train_args: `launch.train`'s arguments, the same for every process.
    workdir: the `--workdir` of `train_args` (created).
    port: the coordinator's port; 0 picks a free one.
    devices_per_process: simulated CPU devices of each process.
    out: where the processes' output goes (prefixed `[pN] `).
  """

  def __init__(self, num_processes: int, train_args: list[str], workdir: str | os.PathLike, *,
               port: int = 0, devices_per_process: int = 1, out: TextIO | None = None):
    self.num_processes = num_processes
    self.train_args = train_args
    self.workdir = Path(workdir).absolute()
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.kills_log = self.workdir / "kills.jsonl"
    if self.kills_log.exists():  # an earlier job's: kept, apart from this job's kills
      n = 1
      while (self.workdir / f"kills.{n}.jsonl").exists():
        n += 1
      self.kills_log.rename(self.workdir / f"kills.{n}.jsonl")
    self.port = port or _free_port()
    self.pause_dir = Path(tempfile.mkdtemp(prefix="resilient_jax_pause_"))
    env = simulated_devices_env(dict(os.environ), devices_per_process)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RESILIENT_JAX_PAUSE", None)
    self.env = env
    self.out = out
    self.lock = threading.Lock()
    self.procs: dict[int, subprocess.Popen] = {}
    self.streams: list[threading.Thread] = []
    self.handed_on = False
    """The launcher handed a SIGTERM on to every running process (`_hand_on`)."""

  def start(self, i: int, pause: str | None = None, marker: str | None = None
            ) -> subprocess.Popen:
    """Starts (or starts again) process `i`; `pause`: its `RESILIENT_JAX_PAUSE` points, which it
    announces in the marker file `marker` (default `p{i}`; see `paused`)."""
    env = dict(self.env)
    if pause:
      env["RESILIENT_JAX_PAUSE"] = pause
      env["RESILIENT_JAX_PAUSE_FILE"] = str(self.marker(marker or f"p{i}"))
    cmd = [sys.executable, "-m", f"{__package__}.train",
           *worker_args(self.train_args, self.num_processes, i, self.port)]
    # Its own process group: a terminal's Ctrl-C reaches the launcher alone, which hands it on
    # once (two signals would stop a process at once instead of after its step).
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         process_group=0)
    t = threading.Thread(target=_stream, args=(p, f"[p{i}] ", self.lock,
                                               self.out or sys.stdout), daemon=True)
    t.start()
    self.streams.append(t)
    self.procs[i] = p
    return p

  def marker(self, name: str) -> Path:
    """The pause marker file `name`: it exists while its process waits at a pause point."""
    return self.pause_dir / name

  def paused(self, name: str) -> dict[str, Any] | None:
    """What the process waiting on marker `name` wrote ({time, step, at}), or None."""
    try:
      text = self.marker(name).read_text()
    except FileNotFoundError:
      return None
    try:
      return json.loads(text)
    except ValueError:  # caught half-written: it is read again on the next turn
      return None

  def alive(self, i: int) -> bool:
    return i in self.procs and self.procs[i].poll() is None

  def record(self, i: int, step: int, where: str, what: str, now: float | None = None) -> None:
    """Appends a kill (`what`: SIGKILL, SIGSTOP) or a relaunch to `kills.jsonl`, which the
    survivors read for `recovery.json`."""
    with self.kills_log.open("a") as f:
      f.write(json.dumps({"process": i, "step": step, "at": where,
                          "time": time.time() if now is None else now, "signal": what}) + "\n")

  def say(self, fmt: str, *args: Any) -> None:
    """A line of the launcher's own (absl's log), kept apart from the processes' lines."""
    with self.lock:
      logging.info(fmt, *args)

  def close(self) -> None:
    """Kills every process still running, waits for all, removes the pause markers."""
    for p in self.procs.values():
      if p.poll() is None:
        p.kill()
    for p in self.procs.values():
      p.wait()
    for t in self.streams:
      t.join(timeout=5)
    for f in self.pause_dir.iterdir():
      f.unlink()
    self.pause_dir.rmdir()


def launch(
  num_processes: int,
  train_args: list[str],
  kills: dict[int, tuple[int, str]],
  workdir: str | os.PathLike,
  *,
  stops: dict[int, tuple[int, str]] | None = None,
  stop_s: float | dict[int, float] = 0.0,
  term: dict[int, tuple[int, str]] | None = None,
  relaunch: tuple[int, int] | None = None,
  port: int = 0,
  timeout_s: float = 1800,
  devices_per_process: int = 1,
) -> int:
  """Runs the job; returns its exit code (see the module docstring).

  Args:
    num_processes: processes (hosts) to start.
    train_args: `launch.train`'s arguments, the same for every process.
    kills: `parse_kills`'s result.
    stops: processes to freeze (SIGSTOP) instead, at points given the same way.
    stop_s: how long a frozen process stays frozen (then SIGCONT), or that per process; 0: until
      every other process has ended (then it is killed).
    term: {process: point}: when it reaches the point, every running process gets SIGTERM.
    relaunch: `parse_relaunch`'s (step, process): start that process again at that step.
    workdir: the `--workdir` of `train_args` (created).
    port: the coordinator's port; 0 picks a free one.
    timeout_s: kill everything after this long (exit code 124).
    devices_per_process: simulated CPU devices of each process.
  """
  job = Job(num_processes, train_args, workdir, port=port,
            devices_per_process=devices_per_process)
  procs = job.procs
  stops = stops or {}
  events = {**{i: (*e, "kill") for i, e in kills.items()},
            **{i: (*e, "stop") for i, e in stops.items()},
            **{i: (*e, "term") for i, e in (term or {}).items()}}
  termed: set[int] = set()
  relaunched: dict[int, str] = {}  # process -> "started" (not yet announced) or "joined"
  asked: list[int] = []  # signals the launcher received (SIGTERM, SIGINT)
  previous = _catch(asked)

  try:
    for i in range(num_processes):
      pause = f"{events[i][0]}:{events[i][1]}" if i in events else None
      if relaunch is not None and i == 0:
        pause = f"{relaunch[0]}:boundary"
      job.start(i, pause)
    killed: set[int] = set()
    frozen: dict[int, float] = {}  # process -> when to let it go (inf: never)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for i, p in procs.items()
              if frozen.get(i, 0.0) != float("inf")):
      for i in sorted(set(events) - killed - set(frozen) - termed):
        marker = job.marker(f"p{i}")
        if marker.exists() and procs[i].poll() is None and events[i][2] == "term":
          termed.add(i)
          for j, q in procs.items():
            if q.poll() is None and j not in frozen:
              q.send_signal(signal.SIGTERM)
          marker.unlink()
          job.say("[launch] SIGTERM to every running process (process %d at step %d, %s)",
                  i, events[i][0], events[i][1])
        elif marker.exists() and procs[i].poll() is None:
          step, where, action = events[i]
          # Recorded first: the survivors may look for the kill as soon as they detect it.
          job.record(i, step, where, "SIGKILL" if action == "kill" else "SIGSTOP")
          procs[i].send_signal(signal.SIGKILL if action == "kill" else signal.SIGSTOP)
          if action == "kill":
            killed.add(i)
          else:
            hold = stop_s.get(i, 0.0) if isinstance(stop_s, dict) else stop_s
            frozen[i] = time.monotonic() + hold if hold > 0 else float("inf")
            marker.unlink()  # once let go, it goes on from where it stopped
          job.say("[launch] %s process %d at step %d (%s)",
                  "SIGKILLed" if action == "kill" else "SIGSTOPped", i, step, where)
      if asked and _hand_on(asked, job, frozen):
        return 128 + asked[-1]  # asked twice: every process was killed
      if relaunch is not None:
        _relaunch_step(relaunch, job, relaunched, killed, frozen,
                       lambda i: job.start(i, "0:joined", f"p{i}.joined"))
      for i, when in sorted(frozen.items()):
        if time.monotonic() >= when:
          frozen[i] = float("nan")  # let go once
          procs[i].send_signal(signal.SIGCONT)
          job.say("[launch] SIGCONT to process %d", i)
      if time.monotonic() > deadline:
        job.say("[launch] timed out after %.0fs; killing every process", timeout_s)
        return 124
      time.sleep(0.02)
    still_frozen = [i for i, when in frozen.items() if when == float("inf")]
    for i in still_frozen:  # the others are done: a frozen process is not coming back
      procs[i].kill()
      procs[i].wait()
      killed.add(i)
    for t in job.streams:
      t.join(timeout=5)
    codes = {i: p.returncode for i, p in sorted(procs.items())}
    not_reached = sorted(set(events) - killed - set(frozen) - termed - set(relaunched))
    if not_reached:
      with job.lock:
        logging.warning("[launch] processes %s never reached their --kill/--stop point",
                        not_reached)
    summary = ", ".join(f"p{i}={'killed' if i in killed else _code(c)}"
                        + (" (relaunched)" if i in relaunched else "") for i, c in codes.items())
    print(f"[launch] exit codes: {summary}", flush=True)  # the job's result: on stdout, always
    return job_exit_code(codes, killed | set(frozen))
  finally:
    job.close()
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def job_exit_code(codes: dict[int, int], injected: set[int]) -> int:
  """The launcher's exit code for a job whose processes ended with `codes` (`Popen.returncode`:
  negative for a signal), `injected` the processes it killed or froze itself.

  0 when every other process finished with 0, or when process 0 did (the job completed) and the
  others that did not were ones it went on without: declared dead (7), or ended by a signal (a
  crash the job survived, as a --kill is). Else the first other code; a process ended by
  signal N as 128 + N, as a shell says it (`sys.exit` of a negative code gave 247 for SIGKILL).
  """
  completed = codes.get(0) == EXIT_OK
  for i, c in codes.items():
    if i in injected or c == EXIT_OK or (completed and (c == EXIT_DECLARED_DEAD or c < 0)):
      continue
    return 128 - c if c < 0 else c
  return EXIT_OK


def _code(returncode: int) -> str:
  """A process's end for the summary line: its exit code, or the signal that ended it."""
  if returncode >= 0:
    return str(returncode)
  try:
    return signal.Signals(-returncode).name
  except ValueError:
    return f"signal {-returncode}"


def _catch(asked: list[int]) -> dict[int, Any]:
  """SIGTERM and SIGINT to the launcher are recorded in `asked` (handed on by `_hand_on`);
  returns the handlers replaced (none off the main thread)."""
  if threading.current_thread() is not threading.main_thread():
    return {}
  return {s: signal.signal(s, lambda signum, _: asked.append(signum))
          for s in (signal.SIGTERM, signal.SIGINT)}


def _hand_on(asked: list[int], job: Job, frozen: dict[int, float]) -> bool:
  """A scheduler's SIGTERM (or Ctrl-C) to the launcher is the job's preemption: every running
  process gets one SIGTERM and stops after the step in flight, with a checkpoint (exit 9). A
  second signal kills them all; returns whether it did."""
  if len(asked) > 1:
    job.say("[launch] %s again: killing every process", signal.Signals(asked[-1]).name)
    return True
  if not job.handed_on:
    job.handed_on = True
    for i, p in job.procs.items():
      if p.poll() is None and i not in frozen:
        p.send_signal(signal.SIGTERM)
    job.say("[launch] %s: SIGTERM to every running process (each stops after the step in "
            "flight, with a checkpoint; a second signal kills them)",
            signal.Signals(asked[0]).name)
  return False


def _relaunch_step(
  relaunch: tuple[int, int], job: Job, relaunched: dict[int, str], killed: set[int],
  frozen: dict[int, float], start: Callable[[int], subprocess.Popen],
) -> None:
  """One turn of the `--relaunch` state machine: once process 0 holds at the relaunch step,
  starts the process again (killing a frozen predecessor first); once the new process has
  announced itself to the job (or died trying), lets both go on."""
  step, i = relaunch
  procs = job.procs
  held = job.marker("p0")
  if i not in relaunched:
    if not held.exists() or procs[0].poll() is not None:
      return
    if procs[i].poll() is None:  # frozen (--stop) or not yet killed: it is replaced now
      procs[i].kill()
      procs[i].wait()
    frozen.pop(i, None)
    killed.discard(i)
    job.marker(f"p{i}").unlink(missing_ok=True)  # its predecessor's kill point: done with
    start(i)
    relaunched[i] = "started"
    job.record(i, step, "start", "relaunch")
    job.say("[launch] relaunched process %d at step %d", i, step)
    return
  announced = job.marker(f"p{i}.joined")
  if relaunched[i] == "started" and (announced.exists() or procs[i].poll() is not None):
    relaunched[i] = "joined"
    announced.unlink(missing_ok=True)
    held.unlink(missing_ok=True)


def main(argv: list[str]) -> None:
  num, train_args = _NUM.value, argv[1:]
  if num < 1:
    cli.fail(f"--num_processes must be >= 1, got {num}")
  if not 0 <= _PORT.value <= 65535:
    cli.fail(f"--port={_PORT.value} is not a port (0..65535; 0 picks a free one)")
  taken = _PORT.value and port_problem(_PORT.value)
  if taken:  # before the workdir is made or any process starts
    cli.fail(f"--port={_PORT.value}: {taken}")
  if _TIMEOUT.value < 1:
    cli.fail(f"--timeout must be >= 1 (seconds), got {_TIMEOUT.value}")
  if not train_args:
    cli.fail("pass launch.train's arguments after --, e.g. -- --config=configs/gpt_tiny.py "
             "--workdir=/tmp/run")
  try:
    kills = parse_kills(_KILL.value, num)
    holds = {}
    for part in filter(None, (p.strip() for p in _STOP.value.split(","))):
      point, _, secs = part.partition("@")
      proc = int(point.split(":")[1]) if point.count(":") >= 1 and \
        point.split(":")[1].isdigit() else -1
      try:
        holds[proc] = float(secs) if secs else _STOP_S.value
      except ValueError:
        raise ValueError(f"--stop entry {part}: {secs} is not a number of seconds") from None
    stops = parse_kills(",".join(p.partition("@")[0] for p in _STOP.value.split(",")), num,
                        flag="--stop")
    term = parse_kills(_TERM.value, num, flag="--term")
    both = sorted((set(kills) & set(stops)) | (set(term) & (set(kills) | set(stops))))
    if both:
      raise ValueError(f"--kill, --stop and --term name process {both[0]} twice")
  except ValueError as e:
    cli.fail(str(e))
  if _STOP_S.value < 0 or any(s < 0 for s in holds.values()):
    cli.fail("--stop_s and --stop's @SECONDS must be >= 0")
  if _SLOW.value:  # checked with the rest of the config, below
    train_args = [*train_args, f"--config.faults.slow={_SLOW.value}"]
  port = _PORT.value or _free_port()
  # Every process's arguments as launch.train will read them (process 0's stand for all: they
  # differ only in the id), so a mistake is one line here rather than one per process later.
  cfg, workdir = cli.parse_train_args(["launch.train", *worker_args(train_args, num, 0, port)])
  from resilient_jax.spec.placement import process_slots

  devices = _DEVICES.value
  if devices < 1:
    cli.fail(f"--devices_per_process must be >= 1, got {devices}")
  try:
    process_slots(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.placement, num, devices, cfg.mesh.tp)
  except ValueError as e:
    cli.fail(f"--num_processes={num} --devices_per_process={devices}: {e}")
  try:
    last = min(cfg.train.stop_after or cfg.train.steps, cfg.train.steps)
    relaunch = parse_relaunch(_RELAUNCH.value, num, last, {**kills, **stops},
                              set(kills) | set(stops) | set(term))
    check_kills(kills, cfg, num_processes=num)
    check_kills(stops, cfg, flag="--stop", num_processes=num)
    check_kills(term, cfg, flag="--term", num_processes=num)
  except ValueError as e:
    cli.fail(str(e))
  sys.exit(launch(num, train_args, kills, workdir, stops=stops, stop_s=holds, term=term,
                  relaunch=relaunch, port=port, timeout_s=_TIMEOUT.value,
                  devices_per_process=devices))


def run() -> None:
  """The `resilient-jax-local` console script (`python -m launch.local`)."""
  cli.run(main)


if __name__ == "__main__":
  run()
