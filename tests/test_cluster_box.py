"""The faults a cluster makes, on a cluster on this machine (`launch/cluster_box.py`).

Hosts are network namespaces, each its own address on a private bridge; a real SLURM (one
slurmctld, a slurmd per host) runs the shipped `launch/slurm/train.sbatch`. Every fault is
injected from outside the job, as a cluster makes it: SLURM sets a node DOWN, a host's link is
cut or flaps. Each run is checked against the single-device run of the same steps (losses and
samples) and for the exit code and line the README's "What survives what" table promises.

A process is held at a step's start (`RESILIENT_JAX_PAUSE`, the hook `launch.local` kills
through) while the fault is made, so that it lands at the same point every run; the job is let
go at once, with the fault in place.

Needs root and the `slurm-wlm` and `munge` packages (`.ci/run` installs them); skipped with the
reason otherwise. One box of 3 hosts serves the module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cluster_box import ClusterBox, missing
from tests.helpers import LOSS_RTOL, ROOT, expected_digests, reference_for, tiny_config

pytestmark = pytest.mark.slow

WAIT_S = 300
"""Bound on every wait of these tests for a job (start-up and compiles on 2 busy cores)."""


@pytest.fixture(scope="module")
def box():
  why = missing(slurm=False)
  if why:
    pytest.skip(why)
  with ClusterBox(3, slurm=missing(slurm=True) is None) as b:
    yield b


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "RESILIENT_JAX_PAUSE"))}
  env.update(PYTHONPATH=ROOT, RESILIENT_JAX_CACHE=os.environ.get(
    "RESILIENT_JAX_CACHE", os.path.join(ROOT, ".jax_cache")), **extra)
  return env


def _wait(cond, what: str, timeout: float = WAIT_S, every: float = 0.05) -> None:
  deadline = time.monotonic() + timeout
  while not cond():
    if time.monotonic() > deadline:
      pytest.fail(f"{what}: not within {timeout}s")
    time.sleep(every)


def _rows(workdir: Path) -> list[dict]:
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x]


def assert_fault_free(workdir: Path, dp: int, steps: int) -> list[dict]:
  """The run's losses and samples are those of the single-device run of the same steps."""
  cfg = tiny_config(mesh__dp=dp, mesh__pp=1, train__steps=steps,
                    train__global_batch=8 * dp)
  ref_losses = reference_for(cfg)[0]
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
  assert [r["sample_digest"] for r in rows] == expected_digests(cfg)
  for r, loss in zip(rows, ref_losses, strict=True):
    assert r["loss"] == pytest.approx(float(loss), rel=LOSS_RTOL), r["step"]
  return rows


def _train_args(workdir: Path, dp: int, steps: int, heartbeat_s: int) -> list[str]:
  return ["--config=configs/gpt_tiny.py:runlocal", f"--workdir={workdir}",
          f"--config.mesh.dp={dp}", "--config.mesh.pp=1",
          f"--config.train.global_batch={8 * dp}", f"--config.train.steps={steps}",
          f"--config.distributed.heartbeat_timeout_s={heartbeat_s}",
          "--config.distributed.wait_timeout_s=60"]


class Job:
  """One process per host (process k-1 on host k) of `launch.train`, joined at host 1's
  address; each held at the steps of `pause` until `release`."""

  def __init__(self, box: ClusterBox, workdir: Path, steps: int, heartbeat_s: int, pause: str):
    self.box, self.workdir = box, workdir
    workdir.mkdir()
    self.markers = [workdir / f"paused.{i}" for i in range(box.hosts)]
    self.logs = [workdir / f"out.{i}" for i in range(box.hosts)]
    self.procs = []
    for i in range(box.hosts):
      cmd = [sys.executable, "-m", "launch.train",
             *_train_args(workdir, box.hosts, steps, heartbeat_s),
             "--config.distributed.enabled=true",
             f"--config.distributed.coordinator={box.addr(1)}:7001",
             f"--config.distributed.num_processes={box.hosts}",
             f"--config.distributed.process_id={i}"]
      with self.logs[i].open("w") as out:
        self.procs.append(box.popen(
          i + 1, cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
          env=_env(RESILIENT_JAX_PAUSE=pause, RESILIENT_JAX_PAUSE_FILE=str(self.markers[i]))))

  def all_paused(self, may_end: tuple[int, ...] = ()) -> None:
    """Waits until every process is held at its step (those of `may_end` may have ended)."""
    def done(i: int) -> bool:
      return i in may_end and self.procs[i].poll() is not None

    _wait(lambda: all(m.exists() or done(i) for i, m in enumerate(self.markers)) or any(
      p.poll() is not None and i not in may_end for i, p in enumerate(self.procs)),
      "every process held at its step")
    assert all(p.poll() is None or i in may_end for i, p in enumerate(self.procs)), self.tail()

  def release(self) -> None:
    for m in self.markers:
      m.unlink(missing_ok=True)

  def codes(self) -> list[int]:
    _wait(lambda: all(p.poll() is not None for p in self.procs), "every process ended")
    return [p.returncode for p in self.procs]

  def out(self, i: int) -> str:
    return self.logs[i].read_text(errors="replace")

  def tail(self) -> str:
    return "\n".join(f"--- process {i}\n{self.out(i)[-2500:]}" for i in range(len(self.procs)))

  def close(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture
def job(box, tmp_path):
  jobs = []

  def start(**kw) -> Job:
    jobs.append(Job(box, tmp_path / "job", **kw))
    return jobs[-1]

  yield start
  for j in jobs:
    j.close()
  for k in range(1, box.hosts + 1):
    box.restore(k)


def _lost_service_line(i: int, box: ClusterBox, step: int | str, workdir: Path) -> str:
  """The line of process `i` losing the service (`step`: a number, or a pattern of one)."""
  return (rf"process {i}: (its distributed runtime )?lost the coordination service at "
          rf"{re.escape(box.addr(1))}:7001 \(process 0 lost, or this host cut off\); its "
          rf"stages' state of step {step} is in {re.escape(str(workdir))}/local/process_{i}/"
          rf"{step}; exiting with code 5")


def test_a_flap_rides_through_and_a_cut_worker_host_is_left_behind(box, job):
  """dp=3 on 3 hosts. Host 2's link flaps (down 2 s, up) as step 2 starts: the processes ride
  through it (the heartbeat timeout is 6 s; the coordinator watchdog needs two failed 2 s
  probes). Host 3's link is cut as step 4 starts, its process alive: processes 0 and 1 find it
  silent within the heartbeat timeout, re-route its micro-batches and train to the end with the
  fault-free losses and samples; process 2 loses the coordination service, writes its stage's
  state of step 3 (the last committed) and exits 5, committing nothing. While held at step 2,
  every socket the job listens on is bound to its host's address, none to all interfaces."""
  j = job(steps=6, heartbeat_s=6, pause="2:start,4:start")
  j.all_paused()
  for k in range(1, box.hosts + 1):
    listening = [addr for addr, proc in box.listeners(k) if "train" in proc or "python" in proc]
    assert listening, box.listeners(k)
    for addr in listening:  # 10.77.0.k:PORT, or [::ffff:10.77.0.k]:PORT (the service)
      assert re.fullmatch(rf"(\[::ffff:)?{re.escape(box.addr(k))}\]?:\d+", addr), (k, addr)
  box.cut(2)
  j.release()
  time.sleep(2.0)
  box.restore(2)
  j.all_paused(may_end=(1,))  # step 4
  box.cut(3)
  j.release()
  codes = j.codes()
  # The flap: ridden through, or (when one of JAX's own heartbeat calls to the service falls in
  # it and outlives its deadline) the flapped process ends as a cut-off one does. Never a hang.
  assert codes[0] == 0 and codes[1] in (0, 5) and codes[2] == 5, j.tail()
  rows = assert_fault_free(j.workdir, dp=3, steps=6)
  live = [r["live_workers"] for r in rows]
  left = ["process_2"]
  if codes[1] == 0:
    assert live == [3, 3, 3, 2, 2, 2], rows
  else:
    assert live == sorted(live, reverse=True) and live[0] == 3 and live[-1] == 1, rows
    assert re.search(_lost_service_line(1, box, r"\d+", j.workdir), j.out(1)), j.tail()
    left = ["process_1", "process_2"]
  assert re.search(r"process 0: no heartbeat from process 2 for 6s: dead", j.out(0)), j.tail()
  assert re.search(_lost_service_line(2, box, 3, j.workdir), j.out(2)), j.tail()
  assert sorted(p.name for p in (j.workdir / "local").iterdir()) == left


def test_process_0_cut_off_goes_on_alone_and_the_others_exit_5(box, job):
  """dp=3 on 3 hosts; host 1's link (process 0's: the coordination service) is cut as step 3
  starts. The one outcome: process 0 keeps the job (whoever reaches the service is in it),
  finds the others silent, re-routes to its own worker and trains every step to the end with
  the fault-free losses; the others, cut off from the service, each write their stage's state
  of step 2 and exit 5 (never 6), committing nothing. No committed step is lost, one side
  commits."""
  j = job(steps=5, heartbeat_s=3, pause="3:start")
  j.all_paused()
  box.cut(1)
  j.release()
  assert j.codes() == [0, 5, 5], j.tail()
  rows = assert_fault_free(j.workdir, dp=3, steps=5)
  assert [r["live_workers"] for r in rows] == [3, 3, 1, 1, 1], rows
  for i in (1, 2):
    assert re.search(_lost_service_line(i, box, 2, j.workdir), j.out(i)), j.tail()
    assert (j.workdir / "local" / f"process_{i}" / "2" / "meta.json").exists()


# ------------------------------------------------------------------------------------ SLURM


def _sbatch(box: ClusterBox, workdir: Path, *args: str, nodes: tuple[int, ...] = (1, 2),
            **env: str) -> str:
  """Submits the shipped script to `nodes`; its output goes to WORKDIR.out (.rejoin.out for a
  job with REJOIN_PROCESS)."""
  out = f"{workdir}.rejoin.out" if "REJOIN_PROCESS" in env else f"{workdir}.out"
  options = [a for a in args if not a.startswith("--config")]  # sbatch's own (--time=...)
  args = tuple(a for a in args if a.startswith("--config"))
  proc = subprocess.run(
    ["sbatch", "--parsable", "--gpus-per-node=0", f"-N{len(nodes)}",
     "-w" + ",".join(box.node(k) for k in nodes), f"--output={out}", *options,
     "launch/slurm/train.sbatch", *args],
    cwd=ROOT, env={**_env(**env), **{"SLURM_CONF": box.env()["SLURM_CONF"]}},
    capture_output=True, text=True, timeout=30)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout.strip().split(";")[0]


def _job_state(box: ClusterBox, job_id: str) -> dict[str, str]:
  out = box.scontrol("show", "job", job_id, check=False)
  return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _job_ended(box: ClusterBox, job_id: str) -> None:
  _wait(lambda: _job_state(box, job_id).get("JobState") not in ("PENDING", "RUNNING",
                                                                 "COMPLETING"),
        f"job {job_id}'s end", every=0.25)


def _task_pids(box: ClusterBox, k: int) -> list[str]:
  """The `launch.train` processes in host k."""
  pids = subprocess.run(["ip", "netns", "pids", box.ns(k)], capture_output=True,
                        text=True).stdout.split()
  out = []
  for pid in pids:
    try:
      if b"launch.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
        out.append(pid)
    except OSError:
      pass
  return out


def test_sbatch_trains_through_a_node_set_down_and_the_node_back_rejoins(box, tmp_path):
  """The shipped SLURM script on 2 CPU nodes (`sbatch --gpus-per-node=0`, DP=2 GPUS_PER_NODE=1,
  the config given after the script name): JAX's SLURM detection forms the job, the
  coordination service listens on the first node's address, and with node 2 set DOWN as step 3
  starts (SLURM kills its task) process 0 re-routes and trains on with the fault-free losses, in
  the same job and step (`srun --no-kill`). Node 2 back (resumed while process 0 holds at step
  5's boundary), the same script submitted to it with REJOIN_PROCESS=1 starts process 1 again:
  admitted before step 6, it trains steps 6 and 7 with process 0. Both jobs end COMPLETED, exit
  0 (process 0's code: the task SLURM killed does not count)."""
  if not box.slurm:
    pytest.skip(missing(slurm=True))
  workdir = tmp_path / "slurm"
  held, joined = tmp_path / "held", tmp_path / "joined"
  settings = dict(DP="2", PP="1", TP="1", GPUS_PER_NODE="1", WORKDIR=str(workdir),
                  PYTHON=sys.executable)
  args = ["--config=configs/gpt_tiny.py:runlocal", *_train_args(workdir, 2, 7, 6)[4:]]
  job_id = _sbatch(box, workdir, *args, **settings, RESILIENT_JAX_PAUSE="3:start,5:boundary",
                   RESILIENT_JAX_PAUSE_FILE=str(held))
  rejoin_id = None
  try:
    _wait(lambda: held.exists() or _job_state(box, job_id).get("JobState") not in
          ("PENDING", "RUNNING"), "the job held at step 3", every=0.25)
    out = Path(f"{workdir}.out")
    assert held.exists(), (_job_state(box, job_id).get("JobState"),
                           out.read_text(errors="replace")[-3000:] if out.exists() else "")
    service = [a for a, p in box.listeners(1) if "train" in p or "python" in p]
    assert any(a.endswith(f"{box.addr(1)}]:{61440 + int(job_id) % 4096}") for a in service), \
      service  # the service on node 1's address, not [::]
    box.scontrol("update", f"nodename={box.node(2)}", "state=down", "reason=test")
    _wait(lambda: not _task_pids(box, 2), "SLURM ending node 2's task")
    held.unlink()
    _wait(lambda: held.exists() or _job_state(box, job_id).get("JobState") != "RUNNING",
          "the job held at step 5's boundary", every=0.25)
    box.resume(box.node(2))
    _wait(lambda: "idle" in subprocess.run(["sinfo", "-h", "-n", box.node(2), "-o", "%t"],
                                           env=box.env(), capture_output=True, text=True).stdout,
          "node 2 back", every=0.25)
    rejoin_id = _sbatch(box, workdir, *args, nodes=(2,), **settings, REJOIN_PROCESS="1",
                        RESILIENT_JAX_PAUSE="0:joined", RESILIENT_JAX_PAUSE_FILE=str(joined))
    _wait(lambda: joined.exists() or _job_state(box, rejoin_id).get("JobState") not in
          ("PENDING", "RUNNING"), "process 1 announced again", every=0.25)
    joined.unlink(missing_ok=True)
    held.unlink()
    _job_ended(box, job_id)
    _job_ended(box, rejoin_id)
    out = Path(f"{workdir}.out").read_text(errors="replace")
    again = Path(f"{workdir}.rejoin.out").read_text(errors="replace")
    for j, text in ((job_id, out), (rejoin_id, again)):
      state = _job_state(box, j)
      assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    # srun's own code is 137 (the task SLURM killed), and it says "Force Terminated" once
    # process 0 has finished; the job's code is process 0's.
    assert re.search(r"tasks exited with task\.0:0 .*the job's code is 0", out), out[-4000:]
    assert re.search(r"process 1: admitted before step 6; process 1 received its parameters "
                     r"and optimizer state from process 0", again), again[-4000:]
    rows = assert_fault_free(workdir, dp=2, steps=7)
    assert [r["live_workers"] for r in rows] == [2, 2, 1, 1, 1, 2, 2], rows
  finally:
    for j in (job_id, rejoin_id):
      if j:
        subprocess.run(["scancel", j], env=box.env(), capture_output=True)
    box.resume(box.node(2))


def test_sbatch_process_0_node_down_then_the_same_job_again_resumes(box, tmp_path):
  """Node 1 (process 0's: the coordination service, and the batch script's) set DOWN as step 3
  starts: SLURM kills the batch script with it and the job ends FAILED, not requeued (a job
  that keeps its allocation through node failures, `#SBATCH --no-kill`, is not requeued when
  its batch host fails); process 1 writes its stage's state of step 2, the last committed, and
  exits 5. Submitting the same job again on the same WORKDIR resumes after step 2 from that copy
  and ends with the fault-free losses: no committed step lost."""
  if not box.slurm:
    pytest.skip(missing(slurm=True))
  workdir = tmp_path / "slurm0"
  marker = tmp_path / "paused"
  settings = dict(DP="2", PP="1", TP="1", GPUS_PER_NODE="1", WORKDIR=str(workdir),
                  PYTHON=sys.executable)
  args = ["--config=configs/gpt_tiny.py:runlocal", *_train_args(workdir, 2, 5, 3)[4:]]
  job_id = _sbatch(box, workdir, *args, **settings, RESILIENT_JAX_PAUSE="3:start",
                   RESILIENT_JAX_PAUSE_FILE=str(marker))
  try:
    _wait(lambda: marker.exists() or _job_state(box, job_id).get("JobState") not in
          ("PENDING", "RUNNING"), "the job held at step 3", every=0.25)
    box.scontrol("update", f"nodename={box.node(1)}", "state=down", "reason=test")
    marker.unlink()
    _job_ended(box, job_id)
    _wait(lambda: not _task_pids(box, 2), "process 1's end")
    assert _job_state(box, job_id)["JobState"] == "FAILED"
    assert (workdir / "exits" / f"{job_id}.0" / "task.1").read_text().strip() == "5"
    assert (workdir / "local" / "process_1" / "2" / "meta.json").exists()
  finally:
    subprocess.run(["scancel", job_id], env=box.env(), capture_output=True)
    box.resume(box.node(1))
  _wait(lambda: "idle" in subprocess.run(["sinfo", "-h", "-n", box.node(1), "-o", "%t"],
                                         env=box.env(), capture_output=True, text=True).stdout,
        "node 1 back", every=0.25)
  again = _sbatch(box, workdir, *args, **settings)
  try:
    _job_ended(box, again)
    out = Path(f"{workdir}.out").read_text(errors="replace")
    assert _job_state(box, again)["JobState"] == "COMPLETED", out[-4000:]
    assert re.search(r"resuming after step 2, the newest step every stage can be read at: the "
                     r"local copies", out), out[-4000:]
    rows = assert_fault_free(workdir, dp=2, steps=5)
    assert [r["live_workers"] for r in rows] == [2] * 5, rows
  finally:
    subprocess.run(["scancel", again], env=box.env(), capture_output=True)


def test_sbatch_time_limit_warning_checkpoints_and_the_requeued_job_resumes(box, tmp_path):
  """The time limit's warning (`sbatch --signal=TERM@60`): held at step 3, the job's limit is
  cut to 1 minute so the warning is due; SLURM signals the step, both tasks finish step 3,
  checkpoint it and exit 9, and the script requeues the job. Released (its limit back to 10
  minutes, and its begin time, which SLURM puts 2 minutes off, to now), the requeued job
  resumes from step 3's checkpoint and ends COMPLETED, exit 0, with the fault-free losses."""
  if not box.slurm:
    pytest.skip(missing(slurm=True))
  workdir = tmp_path / "limit"
  held = tmp_path / "held"
  job_id = _sbatch(box, workdir, "--time=10", "--signal=TERM@60",
                   "--config=configs/gpt_tiny.py:runlocal", *_train_args(workdir, 2, 5, 3)[4:],
                   DP="2", PP="1", TP="1", GPUS_PER_NODE="1", WORKDIR=str(workdir),
                   PYTHON=sys.executable, RESILIENT_JAX_PAUSE="3:start",
                   RESILIENT_JAX_PAUSE_FILE=str(held))
  out = Path(f"{workdir}.out")
  try:
    _wait(lambda: held.exists() or _job_state(box, job_id).get("JobState") not in
          ("PENDING", "RUNNING"), "the job held at step 3", every=0.25)
    box.scontrol("update", f"jobid={job_id}", "timelimit=1")
    _wait(lambda: "CANCELLED AT" in out.read_text(errors="replace"), "the warning signal",
          every=0.25)  # slurmstepd's line as it signals the step
    held.unlink()
    _wait(lambda: _job_state(box, job_id).get("JobState") == "PENDING", "the requeue",
          every=0.25)
    box.scontrol("update", f"jobid={job_id}", "timelimit=10")
    # It starts again once its first run's credential expired (the box's cred_expire=15 s;
    # SLURM's default, 120 s, holds a requeued job that long). Started sooner (`starttime=now`),
    # slurmd refused it: "Killing non-startable batch job: Job credential revoked".
    _wait(lambda: _job_state(box, job_id).get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT",
                                                               "CANCELLED"), "the requeued job",
          every=0.25)
    text = out.read_text(errors="replace")
    state = _job_state(box, job_id)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0",
                                                                        "1"), (
      text[-3000:] + box.log_text("slurmctld")[-3000:])
    assert re.search(r"restart 0: tasks exited with task\.0:9 task\.1:9 .*the job's code is 9",
                     text), text[-4000:]
    assert re.search(r"restored step 3 from \S+/checkpoints/3", text), text[-4000:]
    rows = assert_fault_free(workdir, dp=2, steps=5)
    assert [r["live_workers"] for r in rows] == [2] * 5
  finally:
    subprocess.run(["scancel", job_id], env=box.env(), capture_output=True)
