"""Train a model on a DP x PP grid: `python -m launch.train --config=configs/gpt_tiny.py ...`.

On a machine without accelerators the launcher creates `mesh.dp * mesh.pp * mesh.tp` simulated
CPU devices itself. A workdir with checkpoints is resumed from, on whatever layout is configured.
With `--config.distributed.enabled=true` this is one process of a `jax.distributed` job, driving
all its host's devices and the workers `mesh.placement` puts there (see launch/local.py and
launch/CLUSTERS.md); the same training loop runs either way. Exit codes
(`resilient_jax/exit_codes.py`): 0 done, 2 bad configuration or flags, 3 failures left no
device to continue on (or a whole stage, with resilience.restore_on_stage_loss=false), 4 a
checkpoint could not be written, 8 too many non-finite steps in a row, 9 preempted (SIGTERM or
SIGINT: stopped after the step in flight with a checkpoint of it); multi-process jobs also: 5
this process lost the coordination service (process 0 lost, or this host cut off: once process
0 is gone, requeue the job); 6 a wait passed distributed.wait_timeout_s (joining included: JAX's
own log of a join that never formed is in WORKDIR/join.process_N.log); 7 the other processes
declared this one dead (its heartbeat stopped for distributed.heartbeat_timeout_s) and went on
without it, or (any run) a newer job took the workdir's lease, so this one stopped before
committing a checkpoint: do not requeue it. Bad input is one `error:` line and exit 2 (an
unusable workdir too: a file where its `checkpoints` folder belongs); docs/configuration.md's
"Exit codes" table has the line of each end.

Progress lines are absl log lines at INFO (stdout by default; `--log_dir`, `--alsologtostderr`,
`--verbosity`: see `--helpfull`); the final loss and the list of outputs are printed to stdout.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from absl import logging

from . import cli

if TYPE_CHECKING:
  from resilient_jax.config import RunConfig

_FLAGS = cli.define_train_flags()


def main(argv: list[str]) -> None:
  started = time.time()
  cfg, workdir = cli.train_inputs(argv, _FLAGS)
  from resilient_jax.training.preemption import stop_on_signals

  # A scheduler's SIGTERM stops the job after the step in flight, with a checkpoint. Installed
  # before anything is built: a signal while the trainer is built ends the process with the
  # same exit code 9 at once (nothing trained yet, nothing to checkpoint), not 143.
  with stop_on_signals() as attach:
    _train(cfg, workdir, started, attach)


def _train(cfg: RunConfig, workdir: str, started: float, attach: Callable[[Any], None]) -> None:
  """Joins the job (if any), builds the trainer, hands it to the signal handlers (`attach`),
  trains and reports."""
  # Flax imports IPython, when installed, only to ask whether it is running inside it, which
  # a training process never is: 0.2 s of CPU at every process start (and every relaunch).
  sys.modules.setdefault("IPython", None)

  from resilient_jax.runtime import setup as runtime_setup

  cluster = None
  if cfg.distributed.enabled:
    # A process drives all its host's devices; on a CPU host (a rehearsal) it simulates its
    # share of the grid, unless XLA_FLAGS already says how many (launch/local.py sets it).
    procs = cfg.distributed.num_processes
    runtime_setup.configure_jax(num_cpu_devices=max(cfg.mesh.num_devices // procs, 1)
                                if procs else 1)
    from resilient_jax.runtime.cluster import Cluster

    try:
      cluster = Cluster(cfg.distributed, join_log=_join_log(cfg, workdir))
    except ValueError as e:  # jax.distributed found no cluster and no coordinator was given
      cli.fail(f"distributed.enabled=true: {cli.last_line(e)} (no SLURM, TPU VM, GKE or MPI "
               "environment was detected; set distributed.coordinator, num_processes and "
               "process_id, or start the job with launch/local.py)")
    attach(None)  # jax.distributed.initialize installed its own SIGTERM handler: ours again
  else:
    runtime_setup.configure_jax(num_cpu_devices=cfg.mesh.num_devices)
  chief = cluster is None or cluster.process_id == 0
  if chief:
    where = f" on {cluster.num_processes} processes" if cluster else ""
    grid = (f"{cfg.mesh.dp}x{cfg.mesh.pp} (dp x pp)" if cfg.mesh.tp == 1 else
            f"{cfg.mesh.dp}x{cfg.mesh.pp}x{cfg.mesh.tp} (dp x pp x tp)")
    logging.info(
      "training %s%s, schedule %s, policy %s, %d steps; outputs in %s",
      grid, where, cfg.pipeline.schedule, cfg.resilience.policy, cfg.train.steps, workdir,
    )
    for line in config_lines(cfg):  # the resolved configuration, as config.json keeps it
      logging.info("%s", line)

  from resilient_jax.exit_codes import EXIT_OK, EXIT_PREEMPTED, end_process, exit_code_for
  from resilient_jax.training.loop import Trainer
  from resilient_jax.training.preemption import steady_gc

  try:
    # Progress: absl logging at INFO; the goodput's wall time counts from the process's start.
    from resilient_jax.training.api import as_source, run_config, user_code

    model, loss_fn, data = user_code(cfg)  # the user's own, where the config names them
    source = None if data is None else as_source(data)
    if model is not None:
      cfg = run_config(cfg, model, loss_fn=loss_fn, data=source)
    trainer = Trainer(cfg, workdir, cluster=cluster, started=started, model=model,
                      loss_fn=loss_fn, data=source)
    attach(trainer)
    with steady_gc():
      result = trainer.run()
  except Exception as e:
    code = exit_code_for(e)
    if code == EXIT_PREEMPTED:  # not an error: the run stopped as asked, with a checkpoint
      print(f"preempted: {e}", file=sys.stderr, flush=True)
      if cluster is not None:
        cluster.finish(code)
      sys.exit(code)
    if cluster is not None:
      if code is None:
        cluster.check_coordinator()  # its loss surfaces as many kinds of errors: exit 5
        raise
      end_process(code, f"error: {e}")
    if code is None:
      raise
    cli.fail(str(e), code)
  if chief:
    _report(result.metrics, workdir, started)
  if cluster is not None:
    # A normal interpreter exit would block in the distributed client's shutdown.
    cluster.finish(EXIT_OK)


def _join_log(cfg: RunConfig, workdir: str) -> str:
  """Where JAX's own log of this process's join goes, for a join that never forms to end in one
  line naming it (`Cluster`'s `join_log`): in the workdir, which every process can write, under
  a name of its own (the host's, when the process id is left to auto-detection)."""
  import socket

  pid = cfg.distributed.process_id
  return os.path.join(workdir, f"join.process_{pid}.log" if pid >= 0 else
                      f"join.{socket.gethostname()}.{os.getpid()}.log")


def config_lines(cfg) -> list[str]:
  """The resolved configuration, a line per section: `config mesh: dp=2 pp=4 tp=1 ...`."""
  import dataclasses

  lines = []
  for field in dataclasses.fields(cfg):
    section = getattr(cfg, field.name)
    if dataclasses.is_dataclass(section):
      values = " ".join(f"{f.name}={getattr(section, f.name)!r}"
                        for f in dataclasses.fields(section))
      lines.append(f"config {field.name}: {values}")
  return lines


def _report(metrics: list[dict], workdir: str, started: float) -> None:
  """The run's result on stdout, whatever the logging flags: its final loss and its files."""
  from resilient_jax.files import run_outputs

  if metrics:
    print(f"done: {len(metrics)} steps, final loss {metrics[-1]['loss']:.4f}")
  written, earlier = run_outputs(workdir, started)
  for name in written:
    path = os.path.join(workdir, name)
    print(f"  {path}{'/' if os.path.isdir(path) else ''}")
  if earlier:
    print(f"  left by an earlier run (not written by this one): {', '.join(earlier)}")
  log = cli.log_file()
  if log:
    print(f"log: {log}")


def run() -> None:
  """The `resilient-jax-train` console script (the same program as `python -m launch.train`)."""
  cli.run(main)


if __name__ == "__main__":
  run()
