"""Train a model on a DP x PP grid: `python -m launch.train --config=configs/gpt_tiny.py ...`.

On a machine without accelerators the launcher creates `mesh.dp * mesh.pp` simulated CPU
devices itself. A workdir with checkpoints is resumed from, on whatever layout is configured.
Exit codes: 0 done, 2 bad configuration or flags, 3 failures left no device to continue on
(or a whole stage, with resilience.restore_on_stage_loss=false, or in a multi-process job), 4 a
checkpoint could not be written; multi-process jobs (`--config.distributed.enabled=true`, see
launch/local.py and launch/CLUSTERS.md) also: 5 the coordination service (process 0) was lost,
requeue the job; 6 a survivor waited past distributed.wait_timeout_s; 7 the other processes
declared this one dead (its heartbeat stopped for distributed.heartbeat_timeout_s) and went on
without it.
"""

from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from launch import cli

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a configs/*.py file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, timelines, schedules.")

EXIT_CHECKPOINT = 4


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {' '.join(argv[1:])}")
  if not _WORKDIR.value:
    cli.fail("--workdir is required")

  from resilient_jax.config import ConfigError, from_config_dict

  try:
    # The config file is loaded lazily, on first access: its errors surface here.
    if _CONFIG.value is None:
      cli.fail("--config is required (e.g. --config=configs/gpt_tiny.py)")
    cfg = from_config_dict(_CONFIG.value)
  except ConfigError as e:
    cli.fail(str(e))
  except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
    cli.fail(f"--config: {cli.last_line(e)}")

  from resilient_jax import runtime_setup

  if cfg.distributed.enabled:
    runtime_setup.configure_jax(num_cpu_devices=1)
    _run_distributed(cfg, os.path.abspath(_WORKDIR.value))
    return
  runtime_setup.configure_jax(num_cpu_devices=cfg.mesh.num_workers)

  from resilient_jax.checkpoint import CheckpointError
  from resilient_jax.coordinator import EXIT_NO_DEVICES, EXIT_STAGE_LOST, NoDevicesLeft, StageLost
  from resilient_jax.trainer import train

  workdir = os.path.abspath(_WORKDIR.value)
  print(
    f"training {cfg.mesh.dp}x{cfg.mesh.pp} (dp x pp), schedule {cfg.pipeline.schedule}, "
    f"{cfg.train.steps} steps; outputs in {workdir}",
    flush=True,
  )
  try:
    result = train(cfg, workdir, log=lambda line: print(line, flush=True))
  except NoDevicesLeft as e:
    cli.fail(str(e), EXIT_NO_DEVICES)
  except StageLost as e:  # only with resilience.restore_on_stage_loss=false
    cli.fail(str(e), EXIT_STAGE_LOST)
  except ConfigError as e:  # too few devices, or a checkpoint of another model or batch
    cli.fail(str(e))
  except CheckpointError as e:
    cli.fail(str(e), EXIT_CHECKPOINT)
  _report(result.metrics, workdir)


def _report(metrics: list[dict], workdir: str) -> None:
  if metrics:
    print(f"done: {len(metrics)} steps, final loss {metrics[-1]['loss']:.4f}")
  order = ["metrics.jsonl", "recovery.json", "timeline.png", "timeline.json", "schedule.txt"]
  files = sorted(os.listdir(workdir), key=lambda n: (order.index(n) if n in order else 99, n))
  for name in files:
    if name.startswith("."):
      continue
    path = os.path.join(workdir, name)
    print(f"  {path}{'/' if os.path.isdir(path) else ''}")


def _run_distributed(cfg, workdir: str) -> None:
  """One process of a multi-process job; every exit goes through `Cluster.finish`/`exit_now`
  (a normal interpreter exit would block in the distributed client's shutdown)."""
  from resilient_jax.checkpoint import CheckpointError
  from resilient_jax.config import ConfigError
  from resilient_jax.coordinator import EXIT_STAGE_LOST, NeedsRestore
  from resilient_jax.distributed_trainer import DistributedTrainer
  from resilient_jax.runtime.cluster import Cluster, exit_now

  cluster = Cluster(cfg.distributed)
  chief = cluster.process_id == 0
  if chief:
    print(
      f"training {cfg.mesh.dp}x{cfg.mesh.pp} (dp x pp) on {cluster.num_processes} processes, "
      f"schedule {cfg.pipeline.schedule}, {cfg.train.steps} steps; outputs in {workdir}",
      flush=True,
    )
  try:
    trainer = DistributedTrainer(cfg, workdir, cluster, log=lambda line: print(line, flush=True))
    metrics = trainer.run()
  except ConfigError as e:
    exit_now(cli.EXIT_BAD_CONFIG, f"error: {e}")
  except NeedsRestore as e:  # a whole stage is gone
    exit_now(EXIT_STAGE_LOST, f"error: {e}; relaunch the job on the surviving hosts (it "
             "resumes from the latest checkpoint)")
  except CheckpointError as e:
    exit_now(EXIT_CHECKPOINT, f"error: {e}")
  except Exception:
    cluster.check_coordinator()  # its loss surfaces as many kinds of errors: exit 5
    raise
  if chief:
    _report(metrics, workdir)
  cluster.finish(0)


if __name__ == "__main__":
  cli.run(main)
