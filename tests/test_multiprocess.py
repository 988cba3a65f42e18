"""Real processes, real SIGKILL: multi-process runs against in-process runs of the same failures.

Most tests start 4 processes with `launch/local.py` (2x2 grid, one worker each; where a test
needs no more, 2 processes of two workers each, to keep the suite's CPU down; heartbeat 10 s:
a killed process must be found dead by its refused port, not by a silent heartbeat) and kills
some from outside at a chosen point. The in-process run injects the same failure at
the same point (`FaultEvent`); both re-run the interrupted step on the survivors with the same
samples, so digests must be equal and losses equal up to float summation order.
"""

import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

from launch.local import parse_kills
from resilient_jax.checkpoint import store
from resilient_jax.schedule.core import AR, F, Op
from resilient_jax.training.api import train
from resilient_jax.training.faults import FaultEvent
from tests.helpers import (
  LOSS_RTOL,
  ROOT,
  events_jsonl,
  expected_digests,
  reference_for,
  tiny_config,
)
from tests.test_tensorboard import assert_losses_match, texts

# Real processes take most of the suite's time: `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

STEPS = 5
RESUME_STEPS = 8
"""The issue's job for the loss of process 0: killed at step 7, checkpoints every 5 steps."""
HEARTBEAT_S = 10
GRID = ["--config.mesh.dp=2", "--config.mesh.pp=2"]


def _train_args(workdir, *extra):
  return [
    "--config=configs/gpt_tiny.py:runlocal",
    f"--workdir={workdir}",
    *GRID,
    f"--config.train.steps={STEPS}",
    f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}",
    *extra,
  ]


def run_local(workdir, *flags, extra=(), timeout=300, processes=4):
  """The 2x2 grid on `processes` processes (4: a worker each; 2: two workers each)."""
  devices = 4 // processes
  cmd = [sys.executable, "-m", "launch.local", f"--num_processes={processes}",
         f"--devices_per_process={devices}", *flags, "--", *_train_args(workdir, *extra)]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


_STAGE_PER_PROCESS = "--config.mesh.placement=stage"
"""Two processes of two workers each, process 1 holding both workers of stage 1: killing it
loses the whole stage."""


def read_rows(path):
  return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def in_process(tmp_path, faults=()):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=STEPS)
  return train(cfg, tmp_path / "in_process", faults=list(faults), log=lambda _: None).metrics


@functools.cache
def fault_free(steps: int = STEPS) -> tuple[dict, ...]:
  """The in-process run without failures (every test compares against the same one)."""
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=steps)
  with tempfile.TemporaryDirectory() as tmp:
    return tuple(train(cfg, tmp, log=lambda _: None).metrics)


def assert_same_run(multi, single, *, workers=True):
  """Same samples and losses every step (and the same live workers, unless `workers` is
  False: a policy that re-lays out the job runs the same training on other workers)."""
  assert [r["step"] for r in multi] == list(range(1, len(single) + 1))
  for m, s in zip(multi, single, strict=True):
    assert m["sample_digest"] == s["sample_digest"], m["step"]
    if workers:
      assert m["live_workers"] == s["live_workers"], m["step"]
    assert m["loss"] == pytest.approx(s["loss"], rel=2e-6), m["step"]


def tail(proc):
  return (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize(
  "kill, faults",
  [
    # Two stages, two steps: process 1 in the middle of a forward/backward of step 3, then
    # process 2 inside step 4's all-reduce, its peer already waiting there. Kills at the start
    # of a step: every policy's test below and the whole-stage tests.
    ("3:1:F1,4:2:AR", [FaultEvent(3, (0, 1), Op(F, 1)), FaultEvent(4, (1, 0), Op(AR))]),
  ],
  ids=["mid-forward-then-in-all-reduce"],
)
def test_sigkill_matches_in_process_run(tmp_path, kill, faults):
  """Step 3 is also measured for stragglers (`resilience.straggler_every=3`, a threshold no
  worker reaches): its ops are waited for one by one, and one computed from the killed
  process's data fails as it settles, which must end the attempt, not the process."""
  workdir = tmp_path / "multi"
  proc = run_local(workdir, f"--kill={kill}", extra=[
    "--config.resilience.straggler_every=3", "--config.resilience.straggler_threshold=50"])
  assert proc.returncode == 0, tail(proc)
  killed = parse_kills(kill, 4)
  assert "exit codes: p0=0" in proc.stdout
  assert all(f"p{p}=killed" in proc.stdout for p in killed)
  assert_same_run(read_rows(workdir / "metrics.jsonl"), in_process(tmp_path, faults))
  recovery = json.loads((workdir / "recovery.json").read_text())
  assert sorted(e["process"] for e in recovery) == sorted(killed)
  for e in recovery:
    assert e["step"] == killed[e["process"]][0]
    # A SIGKILLed process's ports refuse connections at once: it is found dead that way, not
    # by the heartbeat timeout, and the re-run of the step compiles nothing (the times it took
    # are in recovery.json, measured by benchmarks/recovery.py, not asserted here).
    p = e["process"]
    assert f"process {p} refuses connections: dead" in proc.stdout, tail(proc)
    assert f"no heartbeat from process {p}" not in proc.stdout, tail(proc)
    assert e["kill_to_detect_s"] > 0 and e["xla_compiles"] == 0, e
  # Each failure was planned by every survivor, and process 0 published its decision's digest
  # (`policy/shared.py`); every other survivor checked its plan against it (p2 and p3 after
  # the first, p3 after the second).
  lines = proc.stdout.splitlines()
  planned = [x[:4] for x in lines if "its digest published" in x]
  followed = sorted(x[:4] for x in lines if "checks its plan against process 0's digest" in x)
  assert planned == ["[p0]", "[p0]"] and followed == ["[p2]", "[p3]", "[p3]"], tail(proc)
  # Process 0's TensorBoard events: every step's loss, each failure and recovery as text.
  assert_losses_match(workdir, read_rows(workdir / "metrics.jsonl"))
  assert [s for s, _ in texts(workdir / "tb", "failure")] == [3, 4]
  assert [s for s, _ in texts(workdir / "tb", "recovery")] == [3, 4]


@pytest.mark.parametrize("tp, pp, lost_device, lost_at_kill, relaunch, live", [
  (1, 4, "1.2", (4, 5, 7), "", [8, 7, 4, 4, 4]),
  (2, 2, "1.1", (2,), "4:1", [4, 3, 2, 2, 4]),
], ids=["one-device-workers", "tp2-sub-meshes-relaunched"])
def test_sigkill_of_a_host_loses_all_its_workers(tmp_path, tp, pp, lost_device, lost_at_kill,
                                                 relaunch, live):
  """One process per host: 2 processes x 4 simulated devices run a dp=2 grid that fills them
  (pipeline placement: process 1 drives pipeline 1), with pp=4 stages of one device each or
  pp=2 stages of a sub-mesh of tp=2 devices each. At step 2 a device of process 1 is lost
  (`faults.schedule`, applied by every process): only its worker goes, process 1 runs on with
  its others, its pipeline's micro-batches crossing to process 0 for the lost stage (so
  activations and their gradients move between the processes' sub-meshes). SIGKILLed at the
  start of step 3, process 1 takes its remaining workers with it at once; process 0 re-routes
  their micro-batches. With tp=2 it is then relaunched and admitted before step 5, taking its
  tensor-parallel state from process 0 piece by piece. Every step trains the fault-free
  samples to the single-device losses."""
  workdir = tmp_path / "multi"
  args = [a for a in _train_args(workdir) if a not in GRID]
  flags = [f"--relaunch={relaunch}"] if relaunch else []
  proc = subprocess.run(
    [sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=4",
     "--kill=3:1", *flags, "--", *args, "--config.mesh.dp=2", f"--config.mesh.pp={pp}",
     f"--config.mesh.tp={tp}", f"--config.faults.schedule=2:{lost_device}"],
    cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, tail(proc)
  p1 = "0 (relaunched)" if relaunch else "killed"
  assert f"exit codes: p0=0, p1={p1}" in proc.stdout, tail(proc)
  grid = "2x4 (dp x pp)" if tp == 1 else "2x2x2 (dp x pp x tp)"
  assert f"training {grid} on 2 processes" in proc.stdout, tail(proc)
  cfg = tiny_config(mesh__dp=2, mesh__pp=pp, train__steps=STEPS)
  multi = read_rows(workdir / "metrics.jsonl")
  assert [r["sample_digest"] for r in multi] == expected_digests(cfg)
  np.testing.assert_allclose([r["loss"] for r in multi], reference_for(cfg)[0], rtol=LOSS_RTOL)
  assert [r["live_workers"] for r in multi] == live
  recovery = json.loads((workdir / "recovery.json").read_text())
  # Worker (1, s) is node 1 * pp + s; the one that lost a device went at step 2.
  assert sorted((e["node"], e["process"], e["step"]) for e in recovery
                if e.get("kind") != "rejoin") == [(n, 1, 3) for n in lost_at_kill]
  rejoins = [(e["nodes"], e["step"], sorted(e["state_from"])) for e in recovery
             if e.get("kind") == "rejoin"]
  assert rejoins == ([([2, 3], 5, ["0"])] if relaunch else []), recovery
  assert proc.stdout.count("refuses connections: dead") == 1, tail(proc)


def test_a_pipeline_that_returns_to_a_process(tmp_path):
  """2 processes x 2 devices, each process holding a whole pipeline of a dp=2 pp=2 grid. At
  step 2 a device of process 1 is lost (`faults.schedule`) and Oobleck re-templates the 3 live
  workers as one 3-stage pipeline whose stages go process 0, process 1, process 0 again, so
  each process has a worker waiting for the other's activations or gradients while its other
  worker's ops are queued. That deadlocked (every process exited 6) when a device's queue could
  hold a computation waiting on a transfer from the other process (`runtime/inbox.py`). Every
  step trains the fault-free samples to the single-device losses.

  It is also the suite's Oobleck job (layers a survivor lacks copied from the other process)
  and its deferred saves: a save due while the previous one is written waits for the first
  free step (`checkpoint.if_busy=defer`: process 0 decides, the holders follow). The other
  policies' jobs: recycle's SIGKILLs in `test_sigkill_matches_in_process_run`, Bamboo's in
  `test_a_relaunched_process_rejoins[bamboo]`, restart's restore inside the job in
  `test_losing_a_whole_stage_restores_inside_the_job`; `auto` picks among these (its switches
  are carried out in-process: `test_policies.py`)."""
  workdir = tmp_path / "multi"
  proc = subprocess.run(
    [sys.executable, "-m", "launch.local", "--num_processes=2", "--devices_per_process=2", "--",
     *_train_args(workdir), "--config.faults.schedule=2:1.1",
     "--config.resilience.policy=oobleck", "--config.distributed.wait_timeout_s=60",
     "--config.checkpoint.every_steps=1", "--config.checkpoint.if_busy=defer"],
    cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, tail(proc)
  assert "exit codes: p0=0, p1=0" in proc.stdout, tail(proc)
  assert (workdir / "checkpoints" / str(STEPS)).is_dir(), tail(proc)  # the last is never put off
  # The re-templated pipeline's stages, in order, on nodes of process 0, 1, 0 (pipeline
  # placement, 2 workers per process: nodes 0 and 1 are process 0's).
  after = (workdir / "schedule.txt").read_text().strip().split("\n\n")[1]
  nodes = [int(n) for n in re.findall(r"^  s\d .* on node (\d+) \|", after, re.M)]
  assert [n // 2 for n in nodes] == [0, 1, 0], after
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=STEPS)
  multi = read_rows(workdir / "metrics.jsonl")
  assert [r["sample_digest"] for r in multi] == expected_digests(cfg)
  np.testing.assert_allclose([r["loss"] for r in multi], reference_for(cfg)[0], rtol=LOSS_RTOL)
  assert [r["live_workers"] for r in multi] == [4, 3, 3, 3, 3]


_SUB_MESH_TRANSFERS = """
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
from resilient_jax.config import DistributedConfig
from resilient_jax.model.sharding import abstract_mesh, target, worker_mesh
from resilient_jax.runtime.cluster import Cluster

pid = int(sys.argv[1])
cl = Cluster(DistributedConfig(enabled=True, coordinator=sys.argv[2], num_processes=2,
                               process_id=pid, wait_timeout_s=60))
local = sorted(jax.local_devices(), key=lambda d: d.id)
subs = [target(worker_mesh(local[:2])), target(worker_mesh(local[2:]))]  # replicated over each
x = np.arange(32, dtype=np.float32).reshape(8, 4)
whole = jax.ShapeDtypeStruct(x.shape, x.dtype)
split = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(abstract_mesh(2), P("tp")))
if pid == 0:
  replicated = jax.device_put(x, subs[0])  # an activation on a sub-mesh
  pieces = jax.device_put(x, NamedSharding(subs[1].mesh, P("tp")))  # tensor-parallel state
  cl.offer(1, [replicated])
  cl.offer(2, [pieces], [split])
  cl.offer(3, [pieces])  # whole: gathered (a checkpoint's state for process 0)
else:
  got = [cl.pull(0, 1, [whole], subs[1])[0], cl.pull(0, 2, [split], subs[0])[0],
         cl.pull(0, 3, [whole])[0]]
  assert cl.wait(got, "the pulls", [0]) is None
  want = [subs[1], NamedSharding(subs[0].mesh, P("tp")), SingleDeviceSharding(local[0])]
  for i, (a, sharding) in enumerate(zip(got, want)):
    assert a.sharding == sharding, (i, a.sharding)
    assert np.array_equal(np.asarray(a), x), i
  print("pieces:", [s.data.shape for s in got[1].addressable_shards], flush=True)
  cl.kv_set("pulled", True)

# A reduction over 4 workers of 2 devices, 2 in each process (dp=4 pp=1 tp=2): their gradients
# (split over their sub-meshes) summed on both of this process's workers.
from resilient_jax.model.sharding import where_key
from resilient_jax.runtime.multiprocess import ProcessLayout, ProcessTransport

transport = ProcessTransport(cl, ProcessLayout.of(4, 1, "pipeline", 2, 4, devices_per_worker=2))
nodes = [0, 1, 2, 3]
transport.begin(1, 0, nodes)
members = tuple(sorted((transport.device(n) for n in nodes), key=where_key))
grads = {transport.device(n): {"w": jax.device_put(np.full((4, 2), n + 1.0, np.float32),
                                                   NamedSharding(transport.placement(n), P("tp")))}
         for n in nodes if transport.is_local(n)}
assert len(grads) == 2
sent, received = cl.bytes_offered, cl.bytes_pulled
summed = transport.reduce(0, nodes, members, grads)
assert not transport.doomed, transport.doomed
# A ring over the 2 member processes: each sends and receives 2 (P - 1) / P = 1 buffer of its
# stage's gradients (one float32 [4, 2]: 32 bytes), in 2 chunks; one whole buffer between the
# two workers here: the bytes the simulator's cost model prices (`ring.two_level`).
from resilient_jax.schedule import ring
plan = ring.two_level(8, (2, 2), spread=False)
want = plan.process_network_bytes
assert want == 32 and (cl.bytes_offered - sent, cl.bytes_pulled - received) == (want, want)
assert sorted(summed, key=where_key) == sorted(grads, key=where_key)
for g in summed.values():
  assert np.array_equal(np.asarray(g["w"]), np.full((4, 2), 10.0)), g
assert transport.device_bytes() == (plan.device_bytes,) * 2 == (32, 32)
# Spread (GPUs' and TPUs' way): each of the 2 workers sums half and runs that half's ring with
# its peer in the other process, then they swap totals: half a buffer each way per phase on
# each device, and the process's network bytes as one ring's.
transport.spread = True
transport.begin(2, 0, nodes)
sent, received = cl.bytes_offered, cl.bytes_pulled
summed = transport.reduce(0, nodes, members, grads)
assert not transport.doomed, transport.doomed
for g in summed.values():
  assert np.array_equal(np.asarray(g["w"]), np.full((4, 2), 10.0)), g
plan = ring.two_level(8, (2, 2))
assert transport.device_bytes() == (plan.device_bytes,) * 2 == (32, 32), transport.device_bytes()
want = plan.process_network_bytes
assert (cl.bytes_offered - sent, cl.bytes_pulled - received) == (want, want) == (32, 32)
print("reduced", flush=True)
if pid == 0:
  cl.await_key("pulled", 1, "the pulls")
cl.finish(0)
"""


def test_transfers_keep_sub_mesh_layouts():
  """Arrays cross processes in the layout the receiver keeps them in (`Cluster.offer`,
  `pull`): an array replicated over a sub-mesh as one replica, copied over the receiver's
  sub-mesh; a tensor-parallel split piece by piece onto the receiver's sub-mesh split the same
  way; a split array asked for whole gathered onto one device. Then a gradient reduction whose
  members are sub-meshes, two in each process: a ring, whose bytes it counts."""
  from launch.local import _free_port, simulated_devices_env

  address = f"127.0.0.1:{_free_port()}"
  env = simulated_devices_env(dict(os.environ), 4)
  procs = [subprocess.Popen([sys.executable, "-c", _SUB_MESH_TRANSFERS, str(p), address],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for p in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, (out + err)[-3000:]
  assert "pieces: [(4, 4), (4, 4)]" in outs[1][0]
  assert all("reduced" in out for out, _ in outs)


def test_frozen_processes_then_preemption(tmp_path):
  """SIGSTOP (a hung host: ports open, heartbeat stopped). Process 0, which also hosts the
  coordination service, frozen in step 2 for less than the heartbeat timeout: everyone waits
  and goes on. Process 3 frozen in step 4 inside the gradient all-reduce (its gradients
  offered, its peer's not yet pulled), beyond the timeout: the others abandon what they waited
  on from it, declare it dead and re-run the step without it, exactly as if it had crashed
  there; let go later, it finds itself declared dead and leaves (7, or 5 once the job is over).
  Meanwhile, in step 4, the scheduler preempts the job (SIGTERM to every running process): all
  finish step 4, checkpoint it and exit 9; the run resumed from that checkpoint (here
  in-process, on the full grid) trains exactly what a run without the preemption did."""
  workdir = tmp_path / "multi"
  proc = run_local(workdir, "--stop=2:0:F1@1,4:3:AR@8", "--term=4:1:F1",
                   extra=["--config.distributed.heartbeat_timeout_s=3"])
  assert proc.returncode == 9, tail(proc)
  assert "exit codes: p0=9, p1=9, p2=9" in proc.stdout, tail(proc)
  assert "stopping after step 4" in proc.stdout, tail(proc)
  multi = read_rows(workdir / "metrics.jsonl")
  assert [r["attempts"] for r in multi] == [1, 1, 1, 2]
  assert [p.name for p in (workdir / "checkpoints").iterdir()] == ["4"]
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=STEPS)
  resumed = train(cfg, workdir, log=lambda _: None).metrics
  reference = in_process(tmp_path, [FaultEvent(4, (1, 1), Op(AR))])
  assert_same_run(resumed, reference, workers=False)
  assert [r["live_workers"] for r in resumed] == [4, 4, 4, 3, 4]


def test_process_0_frozen_past_the_heartbeat_ends_every_process_with_exit_5(tmp_path):
  """Process 0 hosts the coordination service. Frozen in step 2 past the heartbeat timeout,
  the others' runtime gives up on it and they leave with 5 (requeue); let go, it must not train
  on alone (it did in one run of four, while the requeued job would train the same workdir): it
  knows it went without a heartbeat for longer than the timeout and leaves with 5 too, one line,
  whichever it notices first (the runtime's abort, or its peers gone). No checkpoint past the
  freeze is committed."""
  workdir = tmp_path / "multi"
  proc = run_local(workdir, "--stop=2:0:F1@7", processes=2,
                   extra=["--config.distributed.heartbeat_timeout_s=3",
                          "--config.checkpoint.every_steps=1"])
  assert proc.returncode == 5, tail(proc)
  assert "exit codes: p0=5, p1=5" in proc.stdout, tail(proc)
  assert "[p0] process 0 (the coordination service) stalled for " in proc.stdout, tail(proc)
  saved = workdir / "checkpoints"
  assert all(int(p.name) < 2 for p in saved.iterdir()) if saved.exists() else True, tail(proc)


def test_tied_head_and_a_nan_step_across_processes(tmp_path):
  """The tied embedding lives on stage 0 and the last stage, here on different processes (two
  processes, one stage each): its gradient is summed over the workers of both, before and
  after worker (1, 1) is lost at the start of step 3 (`faults.schedule`; SIGKILLs are the
  other tests'). Stage 1's gradients turn NaN in step 2 (`faults.nonfinite`): every stage of
  every process skips that step, the other steps train what the in-process run with the same
  NaN does, and every checkpoint written (each step) is finite. The coordination service is
  left with the last two steps' keys (`distributed.kv_keep_steps=2`)."""
  workdir = tmp_path / "multi"
  proc = run_local(workdir, processes=2, extra=[
    _STAGE_PER_PROCESS, "--config.faults.schedule=3:1.1",
    "--config.model.tied_head=true", "--config.faults.nonfinite=2:1",
    "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=0",
    "--config.distributed.kv_keep_steps=2"])
  assert proc.returncode == 0, tail(proc)
  # Agreements and hand-over marks of older steps were deleted as the run went.
  assert "coordination service: keys of step(s) 4, 5 kept" in proc.stdout, tail(proc)
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=STEPS, model__tied_head=True,
                    faults__nonfinite="2:1")
  single = train(cfg, tmp_path / "in_process", faults=[FaultEvent(3, (1, 1))],
                 log=lambda _: None).metrics
  multi = read_rows(workdir / "metrics.jsonl")
  assert_same_run(multi, single)
  assert [bool(r.get("skipped")) for r in multi] == [False, True, False, False, False]
  assert not math.isfinite(multi[1]["grad_norm"]) and math.isfinite(multi[2]["grad_norm"])
  steps = sorted((workdir / "checkpoints").iterdir())
  assert sorted(p.name for p in steps) == [str(s) for s in range(1, STEPS + 1)]
  for path in steps:  # `load` rejects a checkpoint holding a non-finite value
    assert store.load(path).params


# Recycle's rejoin in a job (state from a live peer, back to the fault-free plan) is also
# `test_sigkill_of_a_host_loses_all_its_workers[tp2-sub-meshes-relaunched]`'s; its own case here
# (process 3, the data-parallel peer, as the source) went to keep the suite under its CPU budget.
@pytest.mark.parametrize("policy, plan, source", [("bamboo", "bamboo", "0")])
def test_a_relaunched_process_rejoins(tmp_path, policy, plan, source):
  """Process 1 is SIGKILLed at the start of step 3 and started again, with the same command,
  when the job reaches step 5: it joins the job and announces itself while step 5 is in flight
  (process 0 holds just before it, the others wait inside it), which leaves step 5 as it was;
  it is admitted before step 6 with its stage's parameters and optimizer state from a live peer
  over the transfer server (not from a checkpoint: there is none): recycle's from process 3, its
  data-parallel peer, Bamboo's from process 0, whose replica of stage 1 ran it meanwhile (and
  which takes its replica back from the returned process). The policy takes it back on the
  fault-free plan, and every step trains what the fault-free run does."""
  workdir = tmp_path / "multi"
  steps = 6
  proc = run_local(workdir, "--kill=3:1", "--relaunch=5:1",
                   extra=[f"--config.train.steps={steps}", "--config.checkpoint.every_steps=0",
                          f"--config.resilience.policy={policy}"])
  assert proc.returncode == 0, tail(proc)
  assert "exit codes: p0=0, p1=0 (relaunched), p2=0, p3=0" in proc.stdout, tail(proc)
  assert f"process(es) 1 relaunched and admitted before step 6, now {plan} on 4 live workers" \
    in proc.stdout, tail(proc)
  assert "no heartbeat from process" not in proc.stdout, tail(proc)
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=steps, resilience__policy=policy)
  ref = train(cfg, tmp_path / "in_process", log=lambda _: None)
  multi = read_rows(workdir / "metrics.jsonl")
  assert [r["step"] for r in multi] == list(range(1, steps + 1))  # no step lost
  for m, s in zip(multi, ref.metrics, strict=True):
    assert m["sample_digest"] == s["sample_digest"], m["step"]
    assert m["loss"] == pytest.approx(s["loss"], rel=2e-6), m["step"]
  assert [r["live_workers"] for r in multi] == [4, 4, 3, 3, 3, 4]
  # After the rejoin the plan is the fault-free one again.
  plans = (workdir / "schedule.txt").read_text().strip().split("\n\n")
  assert plans[-1] == plans[0] == ref.coordinator.plan_text() != plans[1]
  # It arrived (was relaunched and announced itself) while step 5 ran, before step 5 committed.
  relaunch = [r for r in read_rows(workdir / "kills.jsonl") if r["signal"] == "relaunch"]
  rejoin = next(e for e in json.loads((workdir / "recovery.json").read_text())
                if e.get("kind") == "rejoin")
  assert relaunch[0]["time"] < rejoin["announced_at"] < multi[4]["time"] < rejoin["recovered_at"]
  assert rejoin["process"] == 1 and rejoin["step"] == 6 and rejoin["generation"] == 1
  assert rejoin["relaunch_to_next_step_s"] > 0 and rejoin["xla_compiles"] == 0
  # What moved is one stage's parameters and optimizer state (recycle: the optimizer's step
  # count, the same in every stage, comes from process 0, the lowest that holds it).
  interp = ref.interpreter
  slot = next(s for s, p in interp.step_program.slots.items() if p.stage == 1)
  prog = interp.program(slot)
  state = [*interp.params[slot].values(), *prog.opt_entries(interp.opt_state[slot]).values()]
  assert rejoin["bytes"] == sum(x.nbytes for x in state)
  assert max(rejoin["state_from"], key=rejoin["state_from"].get) == source
  assert re.search(rf"stage=1\) of process 1: its parameters and optimizer state came from "
                   rf".*process {source} "
                   r"\(.* over the transfer server", proc.stdout), tail(proc)
  goodput = json.loads((workdir / "goodput.json").read_text())
  back = next(e for e in goodput["events"] if e["kind"] == "rejoin")
  assert back["step"] == 6 and back["nodes"] == [1] and back["bytes_copied"] == rejoin["bytes"]
  assert back["state_from"] == {"1": rejoin["state_from"]}


def test_killing_process_0_ends_every_process_with_exit_5_then_resumes(tmp_path):
  """The issue's job on two processes of a pipeline each (four cost the suite 16 s more of
  CPU): a checkpoint every 5 steps; process 0, which hosts the coordination service, is
  SIGKILLed at the start of step 7. The other writes its stages' state of step 6 to its local
  folder and exits 5, and the job relaunched on the same workdir resumes after step 6 (not from
  step 5's checkpoint, which may even still have been in flight), with the fault-free losses.
  Stages assembled from several processes' copies, damaged and stale copies:
  `test_local_copies.py`.

  It is also the suite's straggler job (`training/stragglers.py`): worker (1, 0), on process 1,
  runs 10x slower from step 2 (`launch.local --slow`), and every step is measured. Each process
  times its own workers; process 0 gathers the times, finds (1, 0) slower than its stage peer
  on process 0 after steps 2 and 3 and publishes the speeds; both re-plan alike from step 4
  (process 1 checks its plan against process 0's digest), and the re-weighted steps train the
  fault-free losses. The relaunched job starts afresh at full speed (step 7 compiles, so one
  measured step is too few to find it again)."""
  workdir = tmp_path / "multi"
  flags = ["--config.checkpoint.every_steps=5", f"--config.train.steps={RESUME_STEPS}",
           "--config.resilience.straggler_every=1", "--config.resilience.straggler_steps=2",
           "--config.resilience.straggler_threshold=3"]
  proc = run_local(workdir, "--kill=7:0", "--slow=2:1.0:10", extra=flags, processes=2)
  assert proc.returncode == 5, tail(proc)
  assert "p0=killed, p1=5" in proc.stdout, tail(proc)
  # Only its own line: op times on shared cores may read another worker slow for a step.
  found = [e for e in events_jsonl(workdir, "speeds")
           if [1, 0] in [[d, s] for d, s, _ in e["speeds"]] + e["recovered"]]
  assert [(e["step"], e["recovered"]) for e in found] == [(4, [])], tail(proc)
  [(_, _, speed)] = [x for x in found[0]["speeds"] if x[:2] == [1, 0]]
  assert speed < 1, found
  assert re.search(r"\[p1\] .*checks its plan against process 0's digest step/4/plan/",
                   proc.stdout), tail(proc)
  rows = read_rows(workdir / "metrics.jsonl")
  assert [r["schedule"] for r in rows] == ["1f1b"] * 3 + ["adaptive"] * 3, rows
  assert all("1.0" in rows[s - 1]["straggler_ratios"] for s in (2, 3)), rows
  # The survivor saw the coordination service go (its watchdog, or JAX's own abort of the
  # process), not a heartbeat timeout, and wrote its stages' state of the last committed step;
  # its last line says what it knows (it cannot tell process 0's loss from its own cut) and
  # where the copy went.
  assert "no heartbeat from process 0" not in proc.stdout, tail(proc)
  assert re.search(r"\[p1\] .*process 1: wrote its stages' state of step 6 to ",
                   proc.stdout + proc.stderr), tail(proc)
  assert re.search(r"\[p1\] process 1: (its distributed runtime )?lost the coordination service "
                   r"at 127\.0\.0\.1:\d+ \(process 0 lost, or this host cut off\); its stages' "
                   rf"state of step 6 is in {re.escape(str(workdir))}/local/process_1/6; exiting "
                   r"with code 5\n", proc.stdout), tail(proc)
  # The launcher returned only after every process exited; none is left. Their joins
  # returned, so no join log (`Cluster`'s `join_log`) is kept.
  out = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True)
  assert out.stdout.strip() == ""
  assert not list(workdir.glob("join.*.log"))
  kills = (workdir / "kills.jsonl").read_text()
  proc = run_local(workdir, extra=flags, processes=2)
  assert proc.returncode == 0, tail(proc)
  assert re.search(r"resuming after step 6, the newest step every stage can be read at: the "
                   r"local copies", proc.stdout + proc.stderr), tail(proc)
  assert re.search(r"restored step 6 from .*/local ", proc.stdout + proc.stderr), tail(proc)
  # The first job's kills stay, apart: this job killed nothing.
  assert (workdir / "kills.1.jsonl").read_text() == kills and "SIGKILL" in kills
  assert not (workdir / "kills.jsonl").exists()
  assert_same_run(read_rows(workdir / "metrics.jsonl"), fault_free(RESUME_STEPS))


def test_losing_a_whole_stage_ends_every_survivor_with_exit_3(tmp_path):
  """Both workers of stage 1 die (their process is killed) and restores are off: the survivor
  exits 3 (not 5 for losing the store of process 0 before it read the outcome)."""
  proc = run_local(tmp_path / "multi", "--kill=3:1", processes=2,
                   extra=[_STAGE_PER_PROCESS, "--config.resilience.restore_on_stage_loss=false"])
  assert proc.returncode == 3, tail(proc)
  assert "exit codes: p0=3, p1=killed" in proc.stdout, tail(proc)
  assert "every worker of stage 1 has failed" in proc.stdout, tail(proc)


def test_losing_a_whole_stage_restores_inside_the_job(tmp_path):
  """Both workers of stage 1 die: the survivor restores the latest checkpoint onto the grid it
  can form, inside the same job, and finishes as the in-process run of the same failures."""
  workdir = tmp_path / "multi"
  ckpt = [_STAGE_PER_PROCESS, "--config.checkpoint.every_steps=1"]
  proc = run_local(workdir, "--kill=3:1", extra=ckpt, processes=2)
  assert proc.returncode == 0, tail(proc)
  assert "exit codes: p0=0, p1=killed" in proc.stdout, tail(proc)
  assert "restored step 2" in proc.stdout, tail(proc)
  multi = read_rows(workdir / "metrics.jsonl")
  assert_same_run(multi, fault_free(), workers=False)
  assert [m["live_workers"] for m in multi] == [4, 4, 2, 2, 2]  # dp=1 x pp=2 on the survivors


def test_slurm_rehearsal_uses_auto_detection(tmp_path):
  """2 processes (one task per node, 2 simulated devices each) given only SLURM_* variables
  find each other through `jax.distributed.initialize()`'s SLURM detection and train."""
  import socket

  from launch.local import simulated_devices_env

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  workdir = tmp_path / "slurm"
  procs = []
  for i in range(2):
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1",
               SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID="0",
               JAX_COORDINATOR_PORT=str(port), TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "launch.train",
           *_train_args(workdir, "--config.distributed.enabled=true")]
    env = simulated_devices_env(env, 2)
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:]
  assert "on 2 processes" in outs[0]
  assert_same_run(read_rows(workdir / "metrics.jsonl"), fault_free())


@pytest.mark.parametrize(
  "spec, message",
  [
    ("3", "not STEP:PROCESS"),
    ("3:9", "below --num_processes=4"),
    ("3:1,4:1", "twice"),
    ("3:1:X2", "not STEP:PROCESS"),
  ],
)
def test_bad_kill_spec_is_a_one_line_error(tmp_path, spec, message):
  proc = subprocess.run(
    [sys.executable, "-m", "launch.local", "--num_processes=4", f"--kill={spec}", "--",
     *_train_args(tmp_path)],
    cwd=ROOT, capture_output=True, text=True, timeout=60,
  )
  assert proc.returncode == 2
  assert message in proc.stderr and "Traceback" not in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1


def test_a_grid_that_does_not_fill_the_job_exits_2(tmp_path):
  """A one-process job on a host of 2 devices cannot hold a 2x2 grid: the trainer's rule
  (`placement.process_slots`) in one line, exit 2."""
  from launch.local import _free_port, simulated_devices_env

  proc = subprocess.run(
    [sys.executable, "-m", "launch.train", *_train_args(tmp_path),
     "--config.distributed.enabled=true", f"--config.distributed.coordinator=127.0.0.1:"
     f"{_free_port()}", "--config.distributed.num_processes=1",
     "--config.distributed.process_id=0"],
    cwd=ROOT, capture_output=True, text=True, timeout=60,
    env=simulated_devices_env(dict(os.environ), 2))
  assert proc.returncode == 2, tail(proc)
  assert "error: mesh.dp * mesh.pp = 2 * 2 = 4 workers (one device each) must fill the job's 1 " \
         "processes x 2 devices = 2 exactly" in proc.stderr, tail(proc)


def test_transfer_ids_are_unique_per_field_and_bounded():
  from resilient_jax.runtime.multiprocess import transfer_id

  fields = [(s, a, mb, st, k) for s in (1, 2, 4_000_000) for a in (0, 1, 63) for mb in (0, 1, 65535)
            for st in (0, 1, 1023) for k in (0, 1, 2)]
  ids = {transfer_id(*f) for f in fields}
  assert len(ids) == len(fields) and max(ids) < 1 << 60
  with pytest.raises(ValueError):
    transfer_id(1, 0, 65536, 0, 0)


# ---------------------------------------------------------------- liveness and agreement parts

_RACE = """
import json, os, sys, threading
import jax
jax.distributed.initialize(sys.argv[1], num_processes=1, process_id=0)
from jax._src import distributed
from resilient_jax.runtime.liveness import first_writer_wins
client = distributed.global_state.client
out = {}
for key in ("decision/1/0", "decision/1/1"):
  got = [None] * 16
  start = threading.Barrier(16)
  def propose(i):
    start.wait()
    got[i] = first_writer_wins(client, key, {"proposal": i})
  threads = [threading.Thread(target=propose, args=(i,)) for i in range(16)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  out[key] = got
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_first_writer_wins_on_the_coordination_service():
  """16 threads race to decide each key: all of them read back the same stored proposal."""
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.run([sys.executable, "-c", _RACE, f"127.0.0.1:{port}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  for key, got in out.items():
    assert len({json.dumps(g) for g in got}) == 1, (key, got)
    assert got[0]["proposal"] in range(16)


def test_first_writer_wins_passes_other_errors_on():
  from resilient_jax.runtime.liveness import first_writer_wins

  class Client:
    def __init__(self, error):
      self.store, self.error = {"k": '{"commit": true}'}, error

    def key_value_set(self, key, value, allow_overwrite=False):
      assert not allow_overwrite
      raise RuntimeError(self.error)

    def key_value_try_get(self, key):
      return self.store[key]

  assert first_writer_wins(Client("ALREADY_EXISTS: key k"), "k", {"lost": [2]}) == {"commit": True}
  with pytest.raises(RuntimeError, match="UNAVAILABLE"):
    first_writer_wins(Client("UNAVAILABLE: the service is gone"), "k", {"lost": [2]})


@pytest.mark.parametrize("reachable, code", [(True, 6), (False, 5)])
def test_a_wait_that_times_out_without_the_service_is_the_services_loss(monkeypatch, reachable,
                                                                        code):
  """A wait past `distributed.wait_timeout_s` ends with 6 only while the coordination service
  answers; cut off from it (process 0's host cut off: `test_cluster_box.py`), the process ends as
  its watchdog would have, with 5 and its local copy, whichever noticed first."""
  from resilient_jax.config import DistributedConfig
  from resilient_jax.runtime import kvstore

  def end(c, message=None):
    raise SystemExit(c)

  monkeypatch.setattr(kvstore, "end_process", end)

  class Store(kvstore.KeyValueStore):
    cfg = DistributedConfig(enabled=True, wait_timeout_s=1)
    process_id = 1

    def check_coordinator(self):
      if not reachable:
        end(5)  # `Cluster.coordinator_lost`: the local copy, then exit 5

  with pytest.raises(SystemExit) as e:
    Store().poll("a key that never comes", lambda: None)
  assert e.value.code == code


class _Pending:
  """A stand-in for a pulled array: ready once `land` is called."""

  def __init__(self):
    self._landed = threading.Event()

  def land(self):
    self._landed.set()

  def is_ready(self):
    return self._landed.is_set()

  def block_until_ready(self):
    self._landed.wait()
    return self


def test_inbox_waits_for_the_first_arrival_or_a_dead_producer():
  """`Inbox.wait_any` returns as soon as one awaited pull lands (woken by it, not by polling),
  and, for a producer found dead while its pull is pending, returns with that pull settled:
  `take` then gives None (the caller computes on zeros and dooms the attempt) rather than an
  array that would hold its device's queue forever."""
  from types import SimpleNamespace

  from resilient_jax.runtime.inbox import Inbox

  dead: set[int] = set()
  cluster = SimpleNamespace(process_id=0, cfg=SimpleNamespace(wait_timeout_s=30),
                            dead=lambda ps: set(ps) & dead)
  inbox = Inbox(cluster)
  a, b = _Pending(), _Pending()
  inbox.put("a", 1, [a])
  inbox.put("b", 2, [b])
  inbox.put("gone", 1, None)  # the producer could not be reached: nothing to wait for
  assert not inbox.arrived("a") and not inbox.arrived("b") and inbox.arrived("gone")
  assert inbox.arrived("local")  # never pulled: a local key
  threading.Timer(0.3, b.land).start()
  inbox.wait_any(["a", "b"], "test")  # a timeout would end the process (`end_process`)
  assert inbox.arrived("b") and not inbox.arrived("a")
  assert inbox.take("b") == (2, [b])
  dead.add(1)
  inbox.wait_any(["a"], "test")
  assert inbox.take("a") == (1, None)
  inbox.clear()
  assert inbox.arrived("a")
  a.land()  # lets its watcher thread go


def test_heartbeat_monitor_needs_silence_and_the_observers_own_beats():
  from resilient_jax.runtime.liveness import HeartbeatMonitor

  m = HeartbeatMonitor(me=0, timeout_s=1.0, min_beats=5)
  assert m.observe({0: 1, 1: 1, 2: 1}, 0.0, [3]) == set()
  # Process 1 beats, 2 and 3 (never wrote) stay silent, but this process's own counter, as
  # the store saw it, did not move: a stall here or in the store proves nothing.
  assert m.observe({0: 1, 1: 5, 2: 1}, 1.5, [3]) == set()
  assert m.observe({0: 3, 1: 9, 2: 1}, 1.6, [3]) == set()
  assert m.observe({0: 9, 1: 13, 2: 1}, 2.0, [3]) == {2, 3}
  # A beat resets the clock; so does a restarted counter (any change).
  assert m.observe({0: 10, 1: 14, 2: 2, 3: 1}, 2.1) == set()
  assert m.observe({0: 30, 1: 20, 2: 2, 3: 1}, 2.9) == set()
  assert m.observe({0: 31, 1: 21, 2: 2, 3: 1}, 3.2) == {2, 3}


def test_probe_tells_a_refused_port_from_a_listening_one():
  import socket

  from resilient_jax.runtime.liveness import parse_address, probe_address

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    address = "{}:{}".format(*s.getsockname())
    assert probe_address(address) is False
  assert probe_address(address) is True  # closed: nothing listens (the kernel refuses)
  assert parse_address("[::1]:8476") == ("::1", 8476)


def test_a_process_declared_dead_exits_7():
  """The survivors mark the lost processes (a frozen one reads its mark once let go) and cut
  their pending pulls from them; the lost process itself exits 7."""
  code = ("from resilient_jax.runtime.cluster import Cluster\n"
          "class Store:\n"
          "  keys = {}\n"
          "  def key_value_set(self, k, v, overwrite): self.keys[k] = v\n"
          "class Connection:\n"
          "  def _poison_connection(self): print('poisoned', flush=True)\n"
          "c = Cluster.__new__(Cluster); c.process_id = 2; c.client = Store()\n"
          "c.generations = {3: 1}\n"
          "c._connections = {1: Connection()}\n"
          "c.declared_dead([1, 3], 'step 3'); print('still here', sorted(Store.keys), flush=True)\n"
          "c.declared_dead([2], 'step 4')\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  from resilient_jax.exit_codes import EXIT_DECLARED_DEAD

  assert proc.returncode == EXIT_DECLARED_DEAD == 7
  # Marked per generation: process 3 was admitted back once, so its successor is meant.
  assert "poisoned\nstill here ['declared/1/0', 'declared/3/1']" in proc.stdout, proc.stderr
  assert "declared this one dead (step 4)" in proc.stderr


def _alone_in_a_job(tmp_path, process_id: int):
  """`launch.train` as process `process_id` of a 2-process job whose coordinator port nobody
  else uses (process 1: nothing answers there; process 0: process 1 never comes)."""
  import socket

  from tests.helpers import run_launcher

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = run_launcher(
    "--config=configs/gpt_tiny.py:runlocal", f"--workdir={tmp_path}",
    "--config.distributed.enabled=true", f"--config.distributed.coordinator=127.0.0.1:{port}",
    "--config.distributed.num_processes=2", f"--config.distributed.process_id={process_id}",
    "--config.distributed.wait_timeout_s=2", timeout=120)
  return proc, port


def test_a_coordinator_that_never_answers_is_one_line_and_the_wait_exit(tmp_path):
  """A wrong or dead coordinator address: the process says so in one line within
  `distributed.wait_timeout_s` and exits 6 (it hung five minutes, then aborted with 134)."""
  proc, port = _alone_in_a_job(tmp_path, 1)
  assert proc.returncode == 6, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
    f"process 1: nothing answers at the coordinator address 127.0.0.1:{port} after 2s "
    "(distributed.wait_timeout_s): is it right, and is process 0 up? exiting with code 6")


def test_the_coordination_service_listens_only_where_it_is_named():
  """An IP address (loopback for `launch.local`) binds the service there alone, not on every
  interface, so no other host can register as a process of the job; a host name (SLURM's
  coordinator) binds the first of its addresses that is this host's and not loopback, and
  loopback where it has none (never every interface, JAX's default). On real hosts:
  `test_cluster_box.py`."""
  from resilient_jax.runtime.joining import bind_address

  assert bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
  assert bind_address("[::1]:1234") == "[::1]:1234"
  assert bind_address("10.0.0.5:8476") == "10.0.0.5:8476"
  assert bind_address("node001:8476") == "127.0.0.1:8476"  # resolves nowhere here
  assert bind_address("localhost:8476") in ("127.0.0.1:8476", "[::1]:8476")  # loopback only
  assert bind_address("") is None  # no coordinator: JAX's own detection names it


def test_a_process_that_never_arrives_ends_the_wait_with_one_line(tmp_path):
  """Process 0 of a 2-process job whose process 1 never starts: JAX's join waits
  `distributed.wait_timeout_s` (not five minutes), and the process's last line says what it
  waited for; exit 6."""
  proc, port = _alone_in_a_job(tmp_path, 0)
  assert proc.returncode == 6, proc.stderr[-2000:]
  # Before it waits it says what for, and for how long at most (a progress line: stdout).
  assert f"process 0: joining the job at 127.0.0.1:{port} (2 processes), waiting at most 2s " \
    "(distributed.wait_timeout_s)" in proc.stdout, proc.stdout[-2000:]
  # The one line alone: JAX's fatal log and its C++ stack went to the file it names.
  log = tmp_path / "join.process_0.log"
  assert proc.stderr.splitlines() == [
    f"process 0: the job at 127.0.0.1:{port} did not form within 2s "
    "(distributed.wait_timeout_s): did all 2 processes start, with this coordinator address? "
    f"(JAX's own log of it: {log}); exiting with code 6"], proc.stderr[-3000:]
  assert "Terminating process because the JAX distributed service detected fatal errors" in \
    log.read_text()


def test_a_join_that_returns_prints_what_it_caught_and_keeps_no_file(tmp_path):
  """`native_log_to` on its own: what the native side writes to stderr during a join that
  returns reaches stderr as before, and the file goes; one that aborts leaves the user the
  abort's one line, and the file."""
  script = """
import os, sys
from resilient_jax.runtime.joining import exit_on_abort, native_log_to
log = sys.argv[1]
with native_log_to(log):
  os.write(2, b"W native warning\\n")
print("removed" if not os.path.exists(log) else "kept", flush=True)
exit_on_abort(6, "the job did not form")
with native_log_to(log):
  os.write(2, b"F fatal log\\n*** Check failure stack trace: ***\\n")
  os.abort()
"""
  log = tmp_path / "join.log"
  proc = subprocess.run([sys.executable, "-c", script, str(log)], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 6 and proc.stdout == "removed\n", proc
  assert proc.stderr == "W native warning\nthe job did not form; exiting with code 6\n"
  assert log.read_text() == "F fatal log\n*** Check failure stack trace: ***\n"


def test_sigterm_to_the_launcher_preempts_the_job_with_a_checkpoint(tmp_path):
  """A scheduler's SIGTERM (or Ctrl-C) to `launch.local`: every process gets one SIGTERM,
  stops after the step in flight with a checkpoint of it, and the launcher exits 9 (it used to
  SIGKILL them on Ctrl-C, and leave them training on after a SIGTERM)."""
  import signal
  import time

  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "launch.local", "--num_processes=2", "--",
         "--config=configs/gpt_tiny.py:runlocal", f"--workdir={workdir}",
         "--config.mesh.dp=2", "--config.mesh.pp=1", "--config.train.steps=500"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  metrics = workdir / "metrics.jsonl"
  deadline = time.monotonic() + 240
  while not (metrics.exists() and len(read_rows(metrics)) >= 2):
    if proc.poll() is not None or time.monotonic() > deadline:  # a bound on the wait
      proc.kill()
      pytest.fail("the job ended or stalled before its second step: "
                  + proc.communicate()[0][-3000:])
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 9, out[-3000:]
  assert "[launch] exit codes: p0=9, p1=9" in out
  last = read_rows(metrics)[-1]["step"]
  assert 2 <= last < 500 and store.committed_steps(workdir / "checkpoints") == [last]
