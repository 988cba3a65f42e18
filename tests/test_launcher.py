"""`python -m launch.train` end to end, and its handling of bad input."""

import json

import pytest

from tests.helpers import run_launcher

CONFIG = "--config=configs/gpt_tiny.py:runlocal"


def test_train_end_to_end(tmp_path):
  proc = run_launcher(
    CONFIG,
    f"--workdir={tmp_path}",
    "--config.mesh.dp=2",
    "--config.mesh.pp=4",
    "--config.pipeline.schedule=zb-h1",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "step    3/3" in proc.stdout and "samples/s" in proc.stdout
  assert str(tmp_path / "metrics.jsonl") in proc.stdout
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 3 and rows[-1]["live_workers"] == 8
  assert (tmp_path / "timeline.png").exists()


@pytest.mark.parametrize(
  "args,env,needle",
  [
    (["--config.pipeline.schedule=bogus"], {}, "pipeline.schedule"),
    (["--config.mesh.pp=9"], {}, "mesh.pp"),
    (["--config.train.global_batch=15"], {}, "train.global_batch"),
    (["--config.pipeline.partition=1,1"], {}, "pipeline.partition"),
    (["--config.mesh.dp=0"], {}, "mesh.dp"),
    (["--config.faults.schedule=x"], {}, "faults.schedule"),
    (["--config.mesh.nope=1"], {}, "nope"),
    (
      ["--config.mesh.dp=2", "--config.mesh.pp=2"],
      {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
      "need 4 devices",
    ),
  ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, args, env, needle):
  proc = run_launcher(CONFIG, f"--workdir={tmp_path}", *args, env=env)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  err = proc.stderr.strip().splitlines()
  assert len(err) == 1 and needle in err[0], proc.stderr
  assert "Traceback" not in proc.stderr


def test_missing_config_file_exit_2(tmp_path):
  proc = run_launcher("--config=configs/does_not_exist.py", f"--workdir={tmp_path}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
