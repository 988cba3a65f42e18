"""Every bad input to `launch.train`, `launch.local` and `launch.simulate`: one line, exit 2.

Each case asserts exit code 2, exactly one stderr line starting `error: `, no traceback, no
exception class name and no escaped quote, and that the line names the offending flag, key or
file (its needles). All but the cases marked `jax` must also fail before JAX starts a backend.

Starting Python and importing the launchers' dependencies costs about a second of CPU per
process, too much for a table this long. So one harness process (this file run as a module,
`python -m tests.test_bad_inputs RESULTS.json < CASES.json`) imports the dependencies once and
forks a child per case, before any JAX backend exists. The child imports its launcher (absl's
flags are global: each child defines them afresh), sends stdout and stderr to files and calls
`cli.run(main, argv)` as `python -m` would.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = ("--config=configs/gpt_tiny.py:runlocal", "--workdir={tmp}/w")
GRID = ("--config.mesh.dp=2", "--config.mesh.pp=2")
LOCAL = ("--num_processes=4", "--")
SIM = ("--config=configs/sim/gpt3_1_3b.py:runlocal", "--out={tmp}/sim")


@dataclasses.dataclass(frozen=True)
class Case:
  """`python -m launcher ARGS` must fail naming every needle (`{tmp}`: a scratch directory,
  `{ro}`: a directory nobody may write to, `{port}`: a port another program listens on)."""

  id: str
  launcher: str
  args: tuple[str, ...]
  needles: tuple[str, ...]
  env: tuple[tuple[str, str], ...] = ()
  jax: bool = False
  """The check needs JAX's devices (the backend may start)."""
  file_size_limit: int = 0
  """Bytes any file the case writes may grow to (RLIMIT_FSIZE; 0: no limit): a disk that takes
  no more bytes while it still lets a file be created, as a full one does."""


def train(id: str, *args: str, needles: tuple[str, ...] | str, **kw) -> Case:
  return Case(id, "launch.train", args, (needles,) if isinstance(needles, str) else needles, **kw)


def local(id: str, *args: str, needles: tuple[str, ...] | str) -> Case:
  return Case(id, "launch.local", args, (needles,) if isinstance(needles, str) else needles)


def simulate(id: str, *args: str, needles: tuple[str, ...] | str) -> Case:
  return Case(id, "launch.simulate", args, (needles,) if isinstance(needles, str) else needles)


CASES = [
  # ---- launch.train: the workdir
  train("workdir-is-a-file", TRAIN[0], "--workdir={tmp}/file",
        needles=("--workdir={tmp}/file", "not a directory")),
  train("workdir-under-a-file", TRAIN[0], "--workdir={tmp}/file/run",
        needles=("--workdir={tmp}/file/run", "{tmp}/file is a file")),
  train("workdir-read-only", TRAIN[0], "--workdir={ro}", needles=("--workdir={ro}", "write")),
  train("workdir-missing", TRAIN[0], needles="--workdir is required"),
  train("metrics-jsonl-is-a-directory", TRAIN[0], "--workdir={tmp}/metrics_dir",
        needles=("--workdir={tmp}/metrics_dir", "metrics.jsonl is a directory")),
  train("config-json-is-a-directory", TRAIN[0], "--workdir={tmp}/config_dir",
        needles=("--workdir={tmp}/config_dir", "config.json is a directory")),
  train("checkpoints-is-a-file", TRAIN[0], "--workdir={tmp}/checkpoints_file",
        "--config.checkpoint.every_steps=2",
        needles=("--workdir={tmp}/checkpoints_file", "checkpoints is a file")),
  train("workdir-on-a-full-disk", TRAIN[0], "--workdir={tmp}/full",
        needles=("--workdir={tmp}/full", "cannot write there"), file_size_limit=1024),
  # ---- the config file
  train("config-syntax-error", "--config={tmp}/syntax.py", TRAIN[1],
        needles=("--config={tmp}/syntax.py", "line 2", "invalid syntax")),
  train("config-get-config-raises", "--config={tmp}/raises.py", TRAIN[1],
        needles=("--config={tmp}/raises.py", "no tiny model today")),
  train("config-file-missing", "--config=configs/does_not_exist.py", TRAIN[1],
        needles=("--config=configs/does_not_exist.py", "no such file")),
  train("config-is-a-directory", "--config=configs", TRAIN[1],
        needles=("--config=configs", "directory")),
  train("config-flag-missing", TRAIN[1], needles="--config is required"),
  train("config-flag-without-value", "--config", TRAIN[1], needles="--config: missing value"),
  train("config-unknown-variant", "--config=configs/gpt_tiny.py:bogus", TRAIN[1],
        needles=("--config=configs/gpt_tiny.py:bogus", "unknown variant 'bogus'")),
  # ---- overrides
  train("override-unknown-section", *TRAIN, "--config.foo.bar=1",
        needles="--config.foo.bar: no such key (config has no section foo)"),
  train("override-misspelt-key", *TRAIN, "--config.mesh.ddp=2",
        needles="--config.mesh.ddp: no such key (did you mean mesh.dp?)"),
  train("override-unknown-key", *TRAIN, "--config.mesh.nope=1",
        needles="--config.mesh.nope: no such key (mesh has no key nope)"),
  train("override-key-under-a-value", *TRAIN, "--config.mesh.dp.x=1",
        needles="--config.mesh.dp.x: no such key"),
  train("override-section-with-a-value", *TRAIN, "--config.mesh=3",
        needles="--config.mesh: mesh is a section"),
  train("override-not-an-int", *TRAIN, "--config.mesh.dp=abc",
        needles="--config.mesh.dp=abc: not an integer"),
  train("override-not-a-number", *TRAIN, "--config.optimizer.learning_rate=fast",
        needles="--config.optimizer.learning_rate=fast: not a number"),
  train("override-not-a-bool", *TRAIN, "--config.distributed.enabled=maybe",
        needles="--config.distributed.enabled=maybe: not true or false"),
  train("override-without-value", *TRAIN, "--config.mesh.dp",
        needles="--config.mesh.dp: missing value"),
  train("override-without-config", TRAIN[1], "--config.mesh.dp=2", needles="--config=FILE"),
  # ---- flags
  train("unknown-flag", *TRAIN, "--bogus=1", needles="unknown flag --bogus"),
  train("misspelt-flag", *TRAIN, "--workdri=/tmp", needles="did you mean --workdir?"),
  train("positional-argument", *TRAIN, "extra", needles="unexpected arguments extra"),
  # ---- values (resilient_jax/config.py)
  train("learning-rate-inf", *TRAIN, "--config.optimizer.learning_rate=inf",
        needles=("optimizer.learning_rate", "inf")),
  train("b1-above-1", *TRAIN, "--config.optimizer.b1=5", needles="optimizer.b1"),
  train("b2-negative", *TRAIN, "--config.optimizer.b2=-3", needles="optimizer.b2"),
  train("weight-decay-negative", *TRAIN, "--config.optimizer.weight_decay=-100",
        needles="optimizer.weight_decay"),
  train("optimizer-unknown", *TRAIN, "--config.optimizer.name=adamax", needles="optimizer.name"),
  train("steps-zero", *TRAIN, "--config.train.steps=0", needles="train.steps"),
  train("seed-beyond-int64", *TRAIN, "--config.train.seed=18446744073709551616",
        needles=("train.seed=18446744073709551616", "int64")),
  train("seed-negative", *TRAIN, "--config.train.seed=-1", needles=("train.seed", "-1")),
  train("schedule-unknown", *TRAIN, "--config.pipeline.schedule=bogus",
        needles="pipeline.schedule"),
  train("more-stages-than-layers", *TRAIN, "--config.mesh.pp=9", needles="mesh.pp"),
  train("batch-not-divisible", *TRAIN, "--config.train.global_batch=15",
        needles="train.global_batch"),
  train("partition-wrong-length", *TRAIN, "--config.pipeline.partition=1,1",
        needles="pipeline.partition"),
  train("dp-zero", *TRAIN, "--config.mesh.dp=0", needles="mesh.dp"),
  train("model-unknown", *TRAIN, "--config.model.name=bert", needles="model.name"),
  train("remat-unknown", *TRAIN, "--config.model.remat=dots", needles=(
    "model.remat='dots'", "none, full, dots_saveable")),
  train("activation-budget-negative", *TRAIN, "--config.resilience.activation_budget_mb=-1",
        needles="resilience.activation_budget_mb must be a non-negative number"),
  train("policy-unknown", *TRAIN, "--config.resilience.policy=pray",
        needles="resilience.policy"),
  train("bamboo-one-stage", *TRAIN, "--config.mesh.pp=1", "--config.resilience.policy=bamboo",
        needles="resilience.policy=bamboo"),
  train("coordinator-not-host-port", *TRAIN, "--config.distributed.coordinator=localhost",
        needles="distributed.coordinator"),
  train("trace-steps-malformed", *TRAIN, "--config.profile.trace_steps=3-4",
        needles=("profile.trace_steps", "3-4")),
  train("trace-steps-past-the-end", *TRAIN, "--config.profile.trace_steps=2,9",
        needles=("profile.trace_steps", "9")),
  train("faults-malformed", *TRAIN, "--config.faults.schedule=x", needles="faults.schedule"),
  train("faults-no-stage", *TRAIN, "--config.faults.schedule=2:1", needles="faults.schedule"),
  train("faults-past-the-end", *TRAIN, "--config.faults.schedule=9:0.0",
        needles=("faults.schedule", "9:0.0")),
  train("faults-outside-grid", *TRAIN, "--config.faults.schedule=2:5.0",
        needles=("faults.schedule", "2:5.0")),
  train("faults-worker-fails-twice", *TRAIN, "--config.faults.schedule=1:0.1,3:0.1",
        needles=("faults.schedule", "3:0.1", "already failed at step 1")),
  train("rejoin-never-failed", *TRAIN, "--config.faults.schedule=2:+0.1",
        needles=("faults.schedule", "2:+0.1", "cannot rejoin")),
  train("rejoin-same-step", *TRAIN, "--config.faults.schedule=2:0.1,2:+0.1",
        needles=("faults.schedule", "2:+0.1", "cannot rejoin")),
  train("nonfinite-malformed", *TRAIN, "--config.faults.nonfinite=2.1",
        needles=("faults.nonfinite", "STEP:STAGE")),
  train("nonfinite-outside-grid", *TRAIN, "--config.faults.nonfinite=2:7",
        needles=("faults.nonfinite", "2:7")),
  train("eval-every-negative", *TRAIN, "--config.train.eval_every=-2",
        needles=("train.eval_every", "-2")),
  train("eval-batches-zero", *TRAIN, "--config.train.eval_every=2",
        "--config.train.eval_batches=0", needles=("train.eval_batches", "0")),
  train("data-path-missing", *TRAIN, "--config.train.data=tokens",
        "--config.train.data_path={tmp}/missing.bin",
        needles="train.data_path='{tmp}/missing.bin'"),
  train("init-from-missing", *TRAIN, "--config.checkpoint.init_from={tmp}/no_run",
        needles="checkpoint.init_from='{tmp}/no_run'"),
  train("fewer-devices-than-workers", *TRAIN, *GRID, needles="need 4 devices",
        env=(("XLA_FLAGS", "--xla_force_host_platform_device_count=2"),), jax=True),
  # ---- launch.local
  local("local-too-few-processes", "--num_processes=2", "--", *TRAIN, *GRID,
        needles=("--num_processes=2 --devices_per_process=1", "must fill")),
  local("local-kill-b0-under-1f1b", "--num_processes=4", "--kill=3:0:B0", "--", *TRAIN, *GRID,
        needles=("--kill entry 3:0:B0", "BW0..BW3")),
  local("local-kill-w-under-1f1b", "--num_processes=4", "--kill=3:1:W0", "--", *TRAIN, *GRID,
        needles="--kill entry 3:1:W0"),
  local("local-kill-another-workers-op", "--num_processes=4", "--kill=2:3:F1", "--", *TRAIN,
        *GRID, needles=("--kill entry 2:3:F1", "F4..F7")),
  local("local-kill-fr-without-bamboo", "--num_processes=4", "--kill=2:1:FR0", "--", *TRAIN,
        *GRID, needles="--kill entry 2:1:FR0"),
  local("local-kill-after-last-step", "--num_processes=4", "--kill=9:1", "--", *TRAIN, *GRID,
        needles=("--kill entry 9:1", "after step 3")),
  local("local-kill-ar-without-peers", "--num_processes=2", "--kill=2:1:AR", "--", *TRAIN,
        "--config.mesh.dp=1", "--config.mesh.pp=2", needles=("--kill entry 2:1:AR", "all-reduce")),
  local("local-kill-save-without-a-checkpoint", "--num_processes=4", "--kill=2:1:save", "--",
        *TRAIN, *GRID, needles=("--kill entry 2:1:save", "saves no checkpoint")),
  local("local-kill-malformed", "--num_processes=4", "--kill=3:1:X2", "--", *TRAIN, *GRID,
        needles=("--kill entry 3:1:X2", "not STEP:PROCESS")),
  local("local-kill-unknown-process", "--num_processes=4", "--kill=3:9", "--", *TRAIN, *GRID,
        needles="below --num_processes=4"),
  local("local-kill-twice", "--num_processes=4", "--kill=3:1,4:1", "--", *TRAIN, *GRID,
        needles="process 1 twice"),
  local("local-relaunch-malformed", "--num_processes=4", "--kill=1:1", "--relaunch=2:1:F0", "--",
        *TRAIN, *GRID, needles="--relaunch=2:1:F0 is not STEP:PROCESS"),
  local("local-relaunch-process-0", "--num_processes=4", "--kill=1:1", "--relaunch=2:0", "--",
        *TRAIN, *GRID, needles=("--relaunch=2:0", "coordination service")),
  local("local-relaunch-not-lost", "--num_processes=4", "--kill=1:1", "--relaunch=2:2", "--",
        *TRAIN, *GRID, needles="process 2 is not named in --kill or --stop"),
  local("local-relaunch-before-kill", "--num_processes=4", "--kill=2:1", "--relaunch=2:1", "--",
        *TRAIN, *GRID, needles="must come after process 1 is lost (step 2)"),
  local("local-relaunch-at-last-step", "--num_processes=4", "--kill=1:1", "--relaunch=3:1", "--",
        *TRAIN, *GRID, needles="the run ends after step 3"),
  local("local-relaunch-holds-busy-process-0", "--num_processes=4", "--kill=1:1", "--stop=1:0",
        "--relaunch=2:1", "--", *TRAIN, *GRID, needles="process 0 holds at step 2"),
  local("local-zero-processes", "--num_processes=0", "--", *TRAIN, needles="--num_processes"),
  local("local-processes-not-an-int", "--num_processes=four", "--", *TRAIN,
        needles="--num_processes=four: not an integer"),
  local("local-bad-port", "--port=70000", "--", *TRAIN, needles="--port=70000"),
  local("local-port-taken", "--num_processes=4", "--port={port}", "--", TRAIN[0],
        "--workdir={tmp}/port_taken", *GRID,
        needles=("--port={port}", "127.0.0.1:{port} is already taken by another program")),
  local("local-no-train-args", "--num_processes=4", needles="after --"),
  local("local-no-workdir", *LOCAL, TRAIN[0], *GRID, needles="--workdir is required"),
  local("local-workdir-is-a-file", *LOCAL, TRAIN[0], "--workdir={tmp}/file", *GRID,
        needles="--workdir={tmp}/file"),
  local("local-bad-override", *LOCAL, *TRAIN, *GRID, "--config.mesh.ddp=2",
        needles="--config.mesh.ddp: no such key (did you mean mesh.dp?)"),
  local("local-config-syntax-error", *LOCAL, "--config={tmp}/syntax.py", TRAIN[1],
        needles=("--config={tmp}/syntax.py", "line 2")),
  local("local-no-devices", "--num_processes=4", "--devices_per_process=0", "--", *TRAIN, *GRID,
        needles="--devices_per_process must be >= 1"),
  local("local-idle-devices", "--num_processes=4", "--devices_per_process=2", "--", *TRAIN,
        *GRID, needles=("--devices_per_process=2", "4 processes x 2 devices = 8 exactly")),
  local("local-unknown-flag", "--bogus", "--", *TRAIN, needles="unknown flag --bogus"),
  local("local-unknown-train-flag", *LOCAL, *TRAIN, *GRID, "--bogus",
        needles="unknown flag --bogus"),
  # ---- launch.simulate
  simulate("sim-out-is-a-file", SIM[0], "--out={tmp}/file",
           needles=("--out={tmp}/file", "not a directory")),
  simulate("sim-out-under-a-file", SIM[0], "--out={tmp}/file/sim", needles="--out={tmp}/file/sim"),
  simulate("sim-out-read-only", SIM[0], "--out={ro}", needles="--out={ro}"),
  simulate("sim-out-missing", SIM[0], needles="--out is required"),
  simulate("sim-config-missing", SIM[1], needles="--config is required"),
  simulate("sim-config-file-missing", "--config=configs/sim/nope.py", SIM[1],
           needles="--config=configs/sim/nope.py"),
  simulate("sim-config-syntax-error", "--config={tmp}/syntax.py", SIM[1],
           needles=("--config={tmp}/syntax.py", "line 2")),
  simulate("sim-bad-variant", "--config=configs/sim/gpt3_1_3b.py:7", SIM[1],
           needles=("--config=configs/sim/gpt3_1_3b.py:7", "devices must be")),
  simulate("sim-misspelt-key", *SIM, "--config.parallel.ppp=3",
           needles="--config.parallel.ppp: no such key (did you mean parallel.pp?)"),
  simulate("sim-value-out-of-range", *SIM, "--config.parallel.pp=0", needles="parallel.pp"),
  simulate("sim-unknown-policy", *SIM, "--config.sim.policies=pray", needles="sim.policies"),
  simulate("sim-trace-missing", *SIM, "--config.trace.csv={tmp}/missing.csv",
           needles="{tmp}/missing.csv"),
  simulate("sim-profile-missing", *SIM, "--config.profile.path={tmp}/missing.json",
           needles="{tmp}/missing.json"),
  simulate("sim-unknown-flag", *SIM, "--bogus", needles="unknown flag --bogus"),
  simulate("sim-positional-argument", *SIM, "extra", needles="unexpected arguments extra"),
]

# Python's exception class names (`ValueError:`, `KeyError`) and escaped quotes never reach a user.
_PYTHON_NOISE = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|\\['\"]")


def _read_only_dir(tmp: str) -> str | None:
  """A directory this user cannot create files in (root ignores modes: a sysfs one then)."""
  ro = os.path.join(tmp, "read_only")
  os.makedirs(ro, exist_ok=True)
  os.chmod(ro, 0o555)
  for candidate in (ro, "/sys/kernel"):
    try:
      fd, probe = tempfile.mkstemp(dir=candidate)
    except OSError:
      return candidate
    os.close(fd)
    os.unlink(probe)
  return None


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, dict]:
  tmp = str(tmp_path_factory.mktemp("bad_inputs"))
  with open(os.path.join(tmp, "file"), "w") as f:
    f.write("not a directory\n")
  os.makedirs(os.path.join(tmp, "metrics_dir", "metrics.jsonl"))
  os.makedirs(os.path.join(tmp, "config_dir", "config.json"))
  os.makedirs(os.path.join(tmp, "checkpoints_file"))
  with open(os.path.join(tmp, "checkpoints_file", "checkpoints"), "w") as f:
    f.write("not a folder\n")
  with open(os.path.join(tmp, "syntax.py"), "w") as f:
    f.write("import ml_collections\ndef get_config(:\n  pass\n")
  with open(os.path.join(tmp, "raises.py"), "w") as f:
    f.write("def get_config(arg=None):\n  raise ValueError('no tiny model today')\n")
  # Another program's port: listening all through the cases.
  taken = socket.socket()
  taken.bind(("127.0.0.1", 0))
  taken.listen()
  names = {"tmp": tmp, "ro": _read_only_dir(tmp) or "{ro}", "port": taken.getsockname()[1]}
  cases = [
    {"id": c.id, "launcher": c.launcher, "argv": [a.format(**names) for a in c.args],
     "env": dict(c.env), "file_size_limit": c.file_size_limit}
    for c in CASES
  ]
  out = os.path.join(tmp, "results.json")
  with taken:
    proc = subprocess.run(
      [sys.executable, "-m", "tests.test_bad_inputs", out], input=json.dumps(cases), cwd=ROOT,
      capture_output=True, text=True, timeout=600,
    )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out) as f:
    return json.load(f), names


def test_the_table_covers_every_launcher():
  assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
  assert {c.launcher for c in CASES} == {"launch.train", "launch.local", "launch.simulate"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(results, case):
  got, names = results
  if "{ro}" in names["ro"] and any("{ro}" in a for a in case.args):
    pytest.skip("no directory here is read-only for this user")
  r = got[case.id]
  err = r["stderr"]
  lines = err.strip().splitlines()
  assert r["code"] == 2, (r["code"], err[-2000:])
  assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
  assert "Traceback" not in err
  assert not _PYTHON_NOISE.search(lines[0]), lines[0]
  for needle in case.needles:
    assert needle.format(**names) in lines[0], lines[0]
  if not case.jax:
    assert not r["jax_started"], "a JAX backend started before the input was rejected"


def test_a_workdir_entry_of_the_wrong_kind_is_left_as_it_was(results):
  """A directory where a run's file belongs, or a file where its `checkpoints` folder does:
  refused at the start (the latter used to train, then exit 4 at the first save), and the
  workdir holds what it held before."""
  got, names = results
  for case, entry in (("metrics-jsonl-is-a-directory", "metrics_dir"),
                      ("config-json-is-a-directory", "config_dir"),
                      ("checkpoints-is-a-file", "checkpoints_file")):
    assert got[case]["code"] == 2, got[case]
    workdir = os.path.join(names["tmp"], entry)
    assert len(os.listdir(workdir)) == 1, os.listdir(workdir)
  with open(os.path.join(names["tmp"], "checkpoints_file", "checkpoints")) as f:
    assert f.read() == "not a folder\n"


def test_a_taken_port_is_refused_before_anything_starts(results):
  """`launch.local --port=P` with P another program's: refused before the workdir is made or
  any process started (process 0 died of a traceback or a SIGSEGV there, and the others
  waited out their join printing C++ stacks)."""
  got, names = results
  r = got["local-port-taken"]
  assert r["code"] == 2 and "[p0]" not in r["stdout"], r
  assert not os.path.exists(os.path.join(names["tmp"], "port_taken"))


# ---------------------------------------------------------------- the harness


# What the launchers import while they check their input: imported once, before the forks.
_PRELOAD = (
  "absl.flags", "ml_collections.config_flags", "launch.cli", "resilient_jax.config",
  "resilient_jax.examples.gpt", "resilient_jax.examples.llama", "resilient_jax.policy.coordinator",
  "resilient_jax.schedule.plan", "resilient_jax.sim", "resilient_jax.runtime.setup",
)
_CASE_TIMEOUT_S = 120


def _child(case: dict, out_path: str, err_path: str) -> None:
  """Runs one case in a forked child; never returns."""
  code = 1
  try:
    for fd, path in ((1, out_path), (2, err_path)):
      f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(f, fd)
      os.close(f)
    os.environ.update(case["env"])
    if case["file_size_limit"]:
      import resource
      import signal

      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
      _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
      resource.setrlimit(resource.RLIMIT_FSIZE, (case["file_size_limit"], hard))
    from launch import cli

    module = importlib.import_module(case["launcher"])
    try:
      cli.run(module.main, [f"{case['launcher']}.py", *case["argv"]])
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else 1
  except BaseException:  # noqa: BLE001 - the test reports it
    import traceback

    traceback.print_exc()
  finally:
    from jax._src import xla_bridge

    started = bool(xla_bridge._backends)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(out_path + ".jax", "w") as f:
      f.write("1" if started else "0")
    os._exit(code)


def _run_case(case: dict, scratch: str) -> dict:
  out_path = os.path.join(scratch, f"{case['id']}.out")
  err_path = os.path.join(scratch, f"{case['id']}.err")
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    _child(case, out_path, err_path)
  deadline = time.monotonic() + _CASE_TIMEOUT_S
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      code = os.waitstatus_to_exitcode(status)
      break
    if time.monotonic() > deadline:
      os.kill(pid, 9)
      os.waitpid(pid, 0)
      code = "timeout"
      break
    time.sleep(0.005)

  def read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""

  return {"code": code, "stdout": read(out_path), "stderr": read(err_path),
          "jax_started": read(out_path + ".jax") != "0"}


def _harness(results_path: str) -> None:
  """Reads cases (JSON) from stdin and writes `{id: {code, stdout, stderr, jax_started}}`."""
  cases = json.load(sys.stdin)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  for name in _PRELOAD:
    importlib.import_module(name)
  with tempfile.TemporaryDirectory() as scratch:
    results = {c["id"]: _run_case(c, scratch) for c in cases}
  with open(results_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  _harness(sys.argv[1])
