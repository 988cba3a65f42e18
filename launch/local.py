"""Run a multi-process job on this machine, optionally killing processes with SIGKILL.

  python -m launch.local --num_processes=4 --kill=3:2 -- \\
      --config=configs/gpt_tiny.py --workdir=/tmp/run --config.mesh.dp=2 --config.mesh.pp=2

starts 4 processes of `launch.train` on 127.0.0.1 (one worker each, `jax.distributed` with
process 0 hosting the coordination service), streams their output prefixed with `[pN]`, and
at the start of step 3 SIGKILLs process 2 from outside. `--kill=STEP:PROCESS[:WHERE]`,
comma-separated; WHERE picks the moment within the step: `start` (default, before the step's
first op), an op of that process such as `F1`, `B0` or `W3` (right after it was dispatched), or
`AR` (inside the gradient all-reduce, the peers already waiting in it). The victim stops at
that point and announces it; the launcher then kills it and appends the kill time to
`WORKDIR/kills.jsonl`, which the survivors use for `recovery.json`.

Exit code: 0 if every process that was not killed finished with 0, else the first non-zero
code among them (`launch/train.py` documents them; 5 means process 0 was lost). No process
outlives the launcher.
"""

from __future__ import annotations

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
from pathlib import Path

from absl import flags

from launch import cli

_NUM = flags.DEFINE_integer("num_processes", 2, "Processes to start (one worker each).")
_KILL = flags.DEFINE_string("kill", "", "STEP:PROCESS[:WHERE],... processes to SIGKILL.")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1; 0 picks a free one.")
_TIMEOUT = flags.DEFINE_integer("timeout", 1800, "Kill everything after this many seconds.")

_KILL_RE = re.compile(r"^(\d+):(\d+)(?::(start|AR|[FBW]\d+))?$")


def parse_kills(spec: str, num_processes: int) -> dict[int, tuple[int, str]]:
  """`STEP:PROCESS[:WHERE],...` -> {process: (step, where)}.

  Raises:
    ValueError: a malformed entry, an unknown process, or a process killed twice.
  """
  kills: dict[int, tuple[int, str]] = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    m = _KILL_RE.match(part)
    if not m:
      raise ValueError(f"--kill entry {part!r} is not STEP:PROCESS[:WHERE] (WHERE: start, AR, "
                       "or an op like F1, B0, W2)")
    step, proc, where = int(m.group(1)), int(m.group(2)), m.group(3) or "start"
    if step < 1 or proc >= num_processes:
      raise ValueError(f"--kill entry {part!r}: step must be >= 1 and process below "
                       f"--num_processes={num_processes}")
    if proc in kills:
      raise ValueError(f"--kill names process {proc} twice")
    kills[proc] = (step, where)
  return kills


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _workdir(train_args: list[str]) -> str:
  for i, a in enumerate(train_args):
    if a.startswith("--workdir="):
      return a.split("=", 1)[1]
    if a == "--workdir" and i + 1 < len(train_args):
      return train_args[i + 1]
  raise ValueError("the arguments after -- need --workdir=DIR (shared by all processes)")


def _stream(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
  for raw in iter(proc.stdout.readline, b""):
    line = raw.decode(errors="replace").rstrip("\n")
    with lock:
      print(f"{prefix}{line}", flush=True)


def launch(
  num_processes: int,
  train_args: list[str],
  kills: dict[int, tuple[int, str]],
  *,
  port: int = 0,
  timeout_s: float = 1800,
) -> int:
  """Runs the job; returns its exit code (see the module docstring)."""
  workdir = Path(_workdir(train_args)).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  kills_log = workdir / "kills.jsonl"
  kills_log.unlink(missing_ok=True)
  port = port or _free_port()
  pause_dir = Path(tempfile.mkdtemp(prefix="resilient_jax_pause_"))
  env_base = dict(os.environ)
  env_base.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env_base["PYTHONUNBUFFERED"] = "1"
  procs: list[subprocess.Popen] = []
  lock = threading.Lock()
  streams = []
  try:
    for i in range(num_processes):
      env = dict(env_base)
      env.pop("RESILIENT_JAX_PAUSE", None)
      if i in kills:
        step, where = kills[i]
        env["RESILIENT_JAX_PAUSE"] = f"{step}:{where}"
        env["RESILIENT_JAX_PAUSE_FILE"] = str(pause_dir / f"p{i}")
      cmd = [
        sys.executable, "-m", "launch.train", *train_args,
        "--config.distributed.enabled=true",
        f"--config.distributed.coordinator=127.0.0.1:{port}",
        f"--config.distributed.num_processes={num_processes}",
        f"--config.distributed.process_id={i}",
      ]
      p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
      procs.append(p)
      t = threading.Thread(target=_stream, args=(p, f"[p{i}] ", lock), daemon=True)
      t.start()
      streams.append(t)
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
      for i in sorted(set(kills) - killed):
        marker = pause_dir / f"p{i}"
        if marker.exists() and procs[i].poll() is None:
          procs[i].send_signal(signal.SIGKILL)
          now = time.time()
          killed.add(i)
          step, where = kills[i]
          with kills_log.open("a") as f:
            f.write(json.dumps({"process": i, "step": step, "at": where, "time": now}) + "\n")
          with lock:
            print(f"[launch] SIGKILLed process {i} at step {step} ({where})", flush=True)
      if time.monotonic() > deadline:
        with lock:
          print(f"[launch] timed out after {timeout_s:.0f}s; killing every process", flush=True)
        return 124
      time.sleep(0.02)
    for t in streams:
      t.join(timeout=5)
    codes = {i: p.returncode for i, p in enumerate(procs)}
    not_reached = sorted(set(kills) - killed)
    if not_reached:
      with lock:
        print(f"[launch] processes {not_reached} never reached their --kill point", flush=True)
    survivors = {i: c for i, c in codes.items() if i not in killed}
    failed = {i: c for i, c in survivors.items() if c != 0}
    summary = ", ".join(f"p{i}={'killed' if i in killed else c}" for i, c in codes.items())
    print(f"[launch] exit codes: {summary}", flush=True)
    return next(iter(failed.values())) if failed else 0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
    for f in pause_dir.iterdir():
      f.unlink()
    pause_dir.rmdir()


def main(argv: list[str]) -> None:
  train_args = argv[1:]
  if _NUM.value < 1:
    cli.fail(f"--num_processes must be >= 1, got {_NUM.value}")
  if not train_args:
    cli.fail("pass launch.train's arguments after --, e.g. -- --config=configs/gpt_tiny.py "
             "--workdir=/tmp/run")
  try:
    kills = parse_kills(_KILL.value, _NUM.value)
    _workdir(train_args)
  except ValueError as e:
    cli.fail(str(e))
  sys.exit(launch(_NUM.value, train_args, kills, port=_PORT.value, timeout_s=_TIMEOUT.value))


if __name__ == "__main__":
  cli.run(main)
