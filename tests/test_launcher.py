"""`python -m launch.train` end to end (its bad inputs: tests/test_bad_inputs.py)."""

import json

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
