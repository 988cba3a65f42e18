"""Soak: a 4-process job keeps training while its processes are SIGKILLed and relaunched, over and
over; at the end every step must equal the fault-free run.

  python benchmarks/soak.py --faults=1000 --seed=0 --minutes=60 --workdir=/tmp/soak [-- ARGS]

The job: 4 processes from `launch/local.py` (its `Job`), a 2x2 grid of the runlocal tiny GPT,
policy recycle, a checkpoint every `--every` steps, `train.steps` long enough for the faults;
ARGS after `--` are more of `launch.train`'s (e.g. `--config.pipeline.schedule=zb-h1` for split
B/W points). Fault i SIGKILLs a random non-zero process at a random point of step K_i and starts
it again, with the same command, when the job reaches step R_i = K_i + 1..3 (2..3 after a kill
in a checkpoint save, which the others notice in the next step only); it is admitted
before step R_i + 1 with its state from a live peer, and fault i+1 comes at step R_i + 1 or
later, so one process at most is down at a time.

Kill points are exact, not wall-clock kills classified afterwards: each process is started with
the pause points of its own future faults (`RESILIENT_JAX_PAUSE`, `training/faults.py`), stops
there and is killed while it waits, so every kind of point is hit as often as it is drawn,
however short (an all-reduce of the tiny model takes a millisecond: random wall-clock kills
would almost never land in one), and the schedule of a seed is the same on every machine. The
points: `start` (between steps), a compute op of the process (`F2`, `BW1`: mid-forward/backward,
the op just dispatched), `AR` (inside the gradient all-reduce, its peers waiting in it) and
`save` (a step that checkpoints, as the save begins: the process has not yet handed its stage's
state to process 0, which is waiting for it when the process holds the stage).

The relaunch is `launch.local --relaunch`'s: process 0 holds before step R_i until the new process
has announced itself (the others wait inside the step), so the admission step is the same every
run; the wait for the new process's start-up is therefore time the job does not train, and it
is in the wall time of the effective training time below.

`--minutes` stops injecting after that long and preempts the job (SIGTERM: every process stops
after the step in flight); what was reached is checked and reported. At the end the fault-free
run of the same config is trained in this process (`resilient_jax.training.loop.train`, as the tests
do) to the last committed step, and every step's sample digest must equal it and its loss
agree to the tests' `LOSS_RTOL`. Report: faults injected, recovered (the victim's failure was
followed by a committed step, and its relaunch was admitted and trained a committed step),
mean/p99 kill -> next committed step and relaunch -> admitted, effective training time
(`goodput.json`; computed the same way from `metrics.jsonl` when the job was preempted), waits
that hit their bound (exit code 6, heartbeat timeouts), tracebacks in the processes' output,
steps lost and re-run; one line
`soak: faults=N recovered=K ...` at the end. Exit code 1 if a fault was not recovered, a step
was lost, any digest or loss differs, a wait hit its bound, a process raised, hung or exited
with another code; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from launch import cli  # noqa: E402
from launch.local import Job, kill_points  # noqa: E402
from resilient_jax.exit_codes import EXIT_PREEMPTED, EXIT_WAIT_TIMEOUT  # noqa: E402
from resilient_jax.files import read_jsonl  # noqa: E402

NUM_PROCESSES = 4
FIRST_KILL = 3
"""The first fault's step: the steps before are the fault-free baseline of the throughput."""
LOSS_RTOL = 2e-6
"""The tests' bound (`tests/helpers.py`): float summation order differs between plans."""
STALL_S = 300.0
"""No committed step and no launcher event for this long: the job is hung (it ends the soak)."""


@dataclasses.dataclass
class Fault:
  """One injected fault: SIGKILL `process` at `where` of step `step`, relaunch at `relaunch`."""

  process: int
  step: int
  where: str
  relaunch: int
  killed_at: float | None = None
  relaunched_at: float | None = None
  joined_at: float | None = None
  missed: bool = False  # the process never reached its kill point


def plan_faults(n: int, seed: int, every: int, points: dict[int, list[str]]) -> list[Fault]:
  """The seed's schedule of `n` faults (see the module docstring)."""
  rng = random.Random(seed)
  faults = []
  earliest = FIRST_KILL
  for _ in range(n):
    proc = rng.randrange(1, NUM_PROCESSES)
    kinds = ["start", "op", "AR", "save"]
    kind = rng.choice(kinds)
    if kind == "save":
      step = -(-earliest // every) * every  # the first checkpoint step from `earliest`
      where = "save"
    else:
      step = earliest + rng.randrange(2)
      ops = [p for p in points[proc] if p != "AR"]
      where = {"start": "start", "AR": "AR", "op": rng.choice(ops) if ops else "start"}[kind]
    # A process killed as it saves has done its part of the step: the others find it dead in
    # the next step, which must not be the relaunch step, where process 0 holds before anyone
    # noticed (its hold would count as detection time).
    relaunch = step + rng.randint(2 if where == "save" else 1, 3)
    faults.append(Fault(proc, step, where, relaunch))
    earliest = relaunch + 1
  return faults


def pause_points(faults: list[Fault], proc: int, after: int = 0) -> list[str]:
  """Process `proc`'s kill points of the faults after step `after` (one launch's pauses)."""
  return [f"{f.step}:{f.where}" for f in faults if f.process == proc and f.step > after]


def run_job(args: argparse.Namespace, train_args: list[str], faults: list[Fault],
            log: Any) -> tuple[dict[int, int | None], float, bool, bool]:
  """Runs the job through `faults`; returns (exit codes, wall seconds, preempted, hung)."""
  job = Job(NUM_PROCESSES, train_args, args.workdir, out=log)
  gen = dict.fromkeys(range(NUM_PROCESSES), 0)  # launches of each process so far - 1
  by_relaunch = {f.relaunch: f for f in faults}
  deadline = time.monotonic() + args.minutes * 60 if args.minutes else float("inf")
  preempted = hung = False
  metrics_path = Path(args.workdir) / "metrics.jsonl"
  last_progress, last_size = time.monotonic(), -1
  committed = 0  # the last committed step
  t0 = time.time()
  try:
    job.start(0, ",".join(f"{f.relaunch}:boundary" for f in faults), "p0")
    for p in range(1, NUM_PROCESSES):
      job.start(p, ",".join(pause_points(faults, p)), f"p{p}.0")
    done = 0  # faults whose relaunch was admitted (or that were missed)
    while any(job.alive(p) for p in job.procs):
      now = time.monotonic()
      over = now > deadline
      if over and not preempted and _between_faults(faults, job, committed):
        preempted = True
        say(f"[soak] --minutes={args.minutes} reached after {done} fault(s): preempting the job")
        for proc in job.procs.values():
          if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
      for p in range(1, NUM_PROCESSES):  # a victim waiting at its kill point
        marker = f"p{p}.{gen[p]}"
        at = job.paused(marker)
        if at is None or at["at"] == "joined" or not job.alive(p):
          continue
        fault = next((f for f in faults if f.process == p and f.step == at["step"]
                      and f.where == at["at"] and f.killed_at is None), None)
        if fault is None or over:  # past --minutes: no more kills, it goes on
          job.marker(marker).unlink(missing_ok=True)
          continue
        fault.killed_at = time.time()
        job.record(p, fault.step, fault.where, "SIGKILL", fault.killed_at)  # before the kill:
        job.procs[p].send_signal(signal.SIGKILL)  # the survivors read it when they detect it
        job.procs[p].wait()
        job.marker(marker).unlink(missing_ok=True)
        last_progress = now
      held = job.paused("p0")
      if held is not None and held["at"] == "boundary":
        fault = by_relaunch.get(held["step"])
        if fault is None or fault.killed_at is None:  # (past --minutes: not killed)
          if fault is not None and not over:
            fault.missed = True  # never reached its point: nothing to relaunch
            done += 1
            say(f"[soak] process {fault.process} never reached {fault.step}:{fault.where}")
          job.marker("p0").unlink(missing_ok=True)
        elif fault.relaunched_at is None:
          p = fault.process
          gen[p] += 1
          fault.relaunched_at = time.time()
          job.record(p, fault.relaunch, "start", "relaunch", fault.relaunched_at)
          points = ["0:joined", *pause_points(faults, p, after=fault.relaunch)]
          job.start(p, ",".join(points), f"p{p}.{gen[p]}")
          last_progress = now
        else:
          p = fault.process
          joined = job.paused(f"p{p}.{gen[p]}")
          if (joined is not None and joined["at"] == "joined") or not job.alive(p):
            fault.joined_at = time.time()
            job.marker(f"p{p}.{gen[p]}").unlink(missing_ok=True)
            job.marker("p0").unlink(missing_ok=True)
            done += 1
            last_progress = now
            if done % 10 == 0 or done == len(faults):
              say(f"[soak] {done}/{len(faults)} fault(s) injected and relaunched "
                  f"({time.time() - t0:.0f}s)")
      size = metrics_path.stat().st_size if metrics_path.exists() else 0
      if size != last_size:
        last_size, last_progress = size, now
        committed = _last_step(metrics_path) if size else 0
      elif now - last_progress > STALL_S:
        hung = True
        say(f"[soak] no committed step or launcher event for {STALL_S:.0f}s: the job is hung; "
            "killing every process")
        break
      time.sleep(0.02)
    codes = {p: proc.poll() for p, proc in sorted(job.procs.items())}
  finally:
    job.close()
  return codes, time.time() - t0, preempted, hung


def say(line: str) -> None:
  """The soak's own progress line, on stdout (the processes' output goes to the log file)."""
  print(line, flush=True)


def _between_faults(faults: list[Fault], job: Job, committed: int) -> bool:
  """Whether no fault is under way: every process runs, and every relaunched process was
  admitted (before the step after its relaunch step) and trained a committed step."""
  under_way = any(f.killed_at is not None and (f.joined_at is None or committed <= f.relaunch)
                  for f in faults)
  return not under_way and all(job.alive(p) for p in job.procs)


def _last_step(metrics_path: Path) -> int:
  """The step of the last complete line of `metrics.jsonl` (0: none yet)."""
  with metrics_path.open("rb") as f:
    f.seek(max(0, f.seek(0, 2) - 4096))
    lines = f.read().split(b"\n")
  for line in reversed(lines[:-1]):  # the last element: after the last newline
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError):
      continue
  return 0


def percentile(xs: list[float], q: float) -> float:
  """The q-th percentile (nearest rank) of `xs`."""
  xs = sorted(xs)
  return xs[min(len(xs) - 1, max(0, -(-len(xs) * q // 100) - 1))] if xs else float("nan")


def check(args: argparse.Namespace, cfg: Any, faults: list[Fault], wall_s: float,
          codes: dict[int, int | None], preempted: bool, hung: bool, log_path: Path) -> int:
  """Compares the job with the fault-free run, prints the report; returns the exit code."""
  from resilient_jax.training.api import train

  workdir = Path(args.workdir)
  metrics = read_jsonl(workdir / "metrics.jsonl")
  recovery = json.loads((workdir / "recovery.json").read_text()) \
    if (workdir / "recovery.json").exists() else []
  last = max((r["step"] for r in metrics), default=0)
  lost = sorted(set(range(1, last + 1)) - {r["step"] for r in metrics})
  ref_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_after=last))
  print(f"[soak] training the fault-free reference to step {last} in this process", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    ref = train(ref_cfg, tmp, log=lambda _: None).metrics if last else []
  digests = sum(m["sample_digest"] != r["sample_digest"] for m, r in zip(metrics, ref,
                                                                           strict=False))
  rel = [abs(m["loss"] - r["loss"]) / max(abs(r["loss"]), 1e-30) for m, r in zip(metrics, ref,
                                                                                    strict=False)]
  losses = sum(x > LOSS_RTOL for x in rel)

  failures = {round(e["killed_at"], 6): e for e in recovery
              if e.get("kind") != "rejoin" and "killed_at" in e}
  rejoins = {round(e["relaunched_at"], 6): e for e in recovery
             if e.get("kind") == "rejoin" and "relaunched_at" in e}
  injected = [f for f in faults if f.killed_at is not None]
  recovered, kill_to_step, relaunch_to_admit, relaunch_to_step = [], [], [], []
  for f in injected:
    fail = failures.get(round(f.killed_at, 6))
    back = rejoins.get(round(f.relaunched_at, 6)) if f.relaunched_at is not None else None
    if fail and "kill_to_next_step_s" in fail:
      kill_to_step.append(fail["kill_to_next_step_s"])
    if back and "recovered_at" in back:
      relaunch_to_admit.append(back["detected_at"] - back["relaunched_at"])
      relaunch_to_step.append(back["relaunch_to_next_step_s"])
    if fail and "kill_to_next_step_s" in fail and back and "recovered_at" in back:
      recovered.append(f)
  kinds: dict[str, int] = {}
  for f in injected:
    k = f.where if f.where in ("start", "AR", "save") else "op"
    kinds[k] = kinds.get(k, 0) + 1
  goodput_path = workdir / "goodput.json"
  if goodput_path.exists():
    run = json.loads(goodput_path.read_text())["run"]
    effective, rerun = run["effective_fraction"], run["steps_rerun"]
    where_eff = "goodput.json"
  else:  # preempted: goodput.py's formula over the committed steps, wall time of the job
    effective = sum(r.get("step_time_s", 0.0) for r in metrics) / max(wall_s, 1e-9)
    # Every failure in recovery.json was detected inside a step, which was attempted again.
    rerun = sum(e.get("kind") != "rejoin" for e in recovery)
    where_eff = "metrics.jsonl (no goodput.json: the job was preempted)"
  text = log_path.read_text(errors="replace")
  bound_hits = text.count(f"exiting with code {EXIT_WAIT_TIMEOUT}") \
    + text.count("no heartbeat from process")
  tracebacks = text.count("Traceback")  # a process that raised what it should have handled
  bad_codes = {p: c for p, c in codes.items() if c not in (0, EXIT_PREEMPTED if preempted else 0)}
  missed = sum(f.missed for f in faults)
  n, k = len(injected), len(recovered)
  print(f"[soak] faults planned {len(faults)}, injected {n} (start {kinds.get('start', 0)}, "
        f"mid-F/B op {kinds.get('op', 0)}, all-reduce {kinds.get('AR', 0)}, checkpoint save "
        f"{kinds.get('save', 0)}), kill point never reached {missed}")
  print(f"[soak] steps {last} in {wall_s / 60:.1f} min; exit codes {codes}"
        + (" (preempted by --minutes)" if preempted else "") + (" HUNG" if hung else ""))
  print(f"[soak] effective training time {effective:.1%} of the wall time (from {where_eff}); "
        f"steps re-run {rerun}; max relative loss difference {max(rel, default=0.0):.2e}")
  summary = (
    f"soak: faults={n} recovered={k} ({100 * k / max(n, 1):.1f}%) "
    f"kill_to_step_mean={_mean(kill_to_step):.2f}s p99={percentile(kill_to_step, 99):.2f}s "
    f"relaunch_to_admitted_mean={_mean(relaunch_to_admit):.2f}s "
    f"p99={percentile(relaunch_to_admit, 99):.2f}s "
    f"relaunch_to_step_mean={_mean(relaunch_to_step):.2f}s "
    f"effective={effective:.1%} waits_at_bound={bound_hits} tracebacks={tracebacks} "
    f"steps={last} steps_lost={len(lost)} "
    f"steps_rerun={rerun} digest_diffs={digests} loss_diffs={losses}"
  )
  print(summary, flush=True)
  ok = (k == n and not lost and not digests and not losses and len(ref) == len(metrics)
        and not bad_codes and not hung and not bound_hits and not tracebacks)
  record("soak", {"faults": n, "recovered": k, "minutes": round(wall_s / 60, 1), "steps": last,
                  "kill_to_step_mean_s": round(_mean(kill_to_step), 2),
                  "kill_to_step_p99_s": round(percentile(kill_to_step, 99), 2),
                  "relaunch_to_admitted_mean_s": round(_mean(relaunch_to_admit), 2),
                  "relaunch_to_step_mean_s": round(_mean(relaunch_to_step), 2),
                  "effective": round(effective, 3), "steps_lost": len(lost),
                  "digest_diffs": digests, "loss_diffs": losses, "passed": ok})
  return 0 if ok else 1


def _mean(xs: list[float]) -> float:
  return statistics.fmean(xs) if xs else float("nan")


class _Parser(argparse.ArgumentParser):
  """Bad flags: one `error:` line and exit code 2 (no usage block)."""

  def error(self, message: str) -> None:  # type: ignore[override]
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  extra: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, extra = argv[:i], argv[i + 1:]
  ap = _Parser(description=__doc__.splitlines()[0])
  ap.add_argument("--faults", type=int, default=1000, help="faults to inject (>= 1)")
  ap.add_argument("--seed", type=int, default=0, help="the schedule's random seed")
  ap.add_argument("--minutes", type=float, default=0.0,
                  help="stop injecting and preempt the job after this long (0: no limit)")
  ap.add_argument("--workdir", default="", help="the job's workdir (default: a new temp dir)")
  ap.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
  ap.add_argument("--heartbeat_s", type=int, default=10,
                  help="distributed.heartbeat_timeout_s: a killed process must be found by its "
                  "refused port, well before a silent heartbeat")
  args = ap.parse_args(argv)
  if args.faults < 1 or args.minutes < 0 or args.every < 1 or args.heartbeat_s < 1:
    ap.error("--faults, --every and --heartbeat_s must be >= 1 and --minutes >= 0")
  if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
    # The job would resume the run found there: its faults before that step never happen and
    # its earlier steps are another run's.
    ap.error(f"--workdir={args.workdir} is not empty: give a new or empty directory")
  from resilient_jax import configure_jax

  configure_jax(NUM_PROCESSES)  # the fault-free reference: the same 2x2 grid in this process
  args.workdir = str(Path(args.workdir or tempfile.mkdtemp(prefix="soak_")).absolute())
  base = ["--config=configs/gpt_tiny.py:runlocal", f"--workdir={args.workdir}",
          "--config.mesh.dp=2", "--config.mesh.pp=2", "--config.resilience.policy=recycle",
          f"--config.checkpoint.every_steps={args.every}",
          f"--config.distributed.heartbeat_timeout_s={args.heartbeat_s}"]
  cfg, _ = cli.parse_train_args(["launch.train", *base, *extra])
  faults = plan_faults(args.faults, args.seed, args.every, kill_points(cfg, NUM_PROCESSES))
  steps = faults[-1].relaunch + 3
  train_args = [*base, f"--config.train.steps={steps}", *extra]
  cfg, _ = cli.parse_train_args(["launch.train", *train_args])
  Path(args.workdir).mkdir(parents=True, exist_ok=True)
  log_path = Path(args.workdir) / "soak.log"
  print(f"[soak] {args.faults} fault(s) over {steps} steps (seed {args.seed}); the processes' "
        f"output: {log_path}", flush=True)
  with log_path.open("w") as log:
    codes, wall_s, preempted, hung = run_job(args, train_args, faults, log)
  with (Path(args.workdir) / "soak_faults.jsonl").open("w") as f:
    for fault in faults:
      f.write(json.dumps(dataclasses.asdict(fault)) + "\n")
  return check(args, cfg, faults, wall_s, codes, preempted, hung, log_path)


if __name__ == "__main__":
  sys.exit(main())
