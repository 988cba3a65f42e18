"""Simulation configs: GPT-3 models on A100 clusters (`python -m launch.simulate --config=...`).

Every file's `get_config(arg)` takes the variant after the colon: nothing (the default size),
a device count (`configs/sim/gpt3_6_7b.py:16384`), or `runlocal` (a tiny grid and a two-hour
trace that simulate in seconds). `gpt3_config` holds what the files share.

Hardware numbers: A100-SXM4-80GB (312 TFLOP/s dense bf16, 2039 GB/s HBM), 8 per node on NVLink
(300 GB/s per direction) with one 200 Gb/s InfiniBand HCA per GPU (25 GB/s). Failure rates:
one failure per 15,000 device-hours, about what the OPT-175B logbook shows (roughly 100
hardware failures in two months on 992 A100s); Llama 3 reports about a third of that rate
(419 interruptions in 54 days on 16,384 H100s). Every value can be overridden on the command
line, e.g. `--config.trace.device_mtbf_hours=50000`.
"""

from __future__ import annotations

import ml_collections

MIN_DEVICES, MAX_DEVICES = 64, 16384


def _sweep_failures(dp: int) -> str:
  """0, 1, 2, 4, ... up to half of a stage's workers."""
  ks = [0]
  k = 1
  while k <= dp // 2:
    ks.append(k)
    k *= 2
  return ",".join(str(k) for k in ks)


def gpt3_config(
  arg: str | None,
  *,
  file: str,
  name: str,
  num_layers: int,
  d_model: int,
  num_heads: int,
  pp: int,
  tp: int,
  microbatches: int,
  default_devices: int,
) -> ml_collections.ConfigDict:
  """A GPT-3-family simulation config.

  Args:
    arg: None, a device count, or "runlocal".
    file: the config file, for error messages.
    name: the model's label.
    num_layers: transformer blocks.
    d_model: width.
    num_heads: attention heads.
    pp: pipeline stages.
    tp: devices per worker (tensor parallel).
    microbatches: micro-batches per pipeline per step.
    default_devices: cluster size when `arg` is empty.

  Returns:
    The ConfigDict.

  Raises:
    ValueError: for an unknown variant or a device count the layout cannot use.
  """
  devices = default_devices
  runlocal = arg == "runlocal"
  if arg and not runlocal:
    if not arg.isdigit():
      raise ValueError(f"unknown variant {arg!r} of {file} (use runlocal or a device count)")
    devices = int(arg)
    if not MIN_DEVICES <= devices <= MAX_DEVICES or devices % (2 * pp * tp):
      raise ValueError(
        f"{file}:{arg}: devices must be in [{MIN_DEVICES}, {MAX_DEVICES}] and a multiple of "
        f"2 * pp * tp = {2 * pp * tp} (at least two pipelines)"
      )
  c = ml_collections.ConfigDict()
  c.model = dict(
    name=name,
    num_layers=num_layers,
    d_model=d_model,
    num_heads=num_heads,
    seq_len=2048,
    vocab_size=50257,
  )
  c.device = dict(
    name="A100-80GB", peak_tflops=312.0, hbm_gbps=2039.0, memory_gb=80.0, efficiency=0.5
  )
  c.network = dict(
    intra_node_gbps=300.0, inter_node_gbps=25.0, intra_latency_us=2.0, inter_latency_us=5.0
  )
  c.cluster = dict(devices=devices, devices_per_node=8, placement="pipeline")
  c.parallel = dict(
    pp=pp,
    tp=tp,
    microbatches=microbatches,
    micro_batch_size=1,
    schedule="zb-h1",
    memory_cap=0,
    recompute=False,
  )
  c.profile = dict(path="")  # a measured per-stage profile JSON replaces the spec cost model
  c.recovery = dict(detect_s=30.0, regroup_s=10.0, restart_s=600.0, checkpoint_interval_s=1800.0)
  c.trace = dict(
    hours=24.0,
    device_mtbf_hours=15000.0,
    node_mtbf_hours=200000.0,
    repair_hours=6.0,
    seed=0,
    csv="",
  )
  dp = devices // (pp * tp)
  # The sweep fails workers of the last stage: it also runs the output head, so it is the
  # slowest stage and the one whose extra load the others' bubbles cannot hide.
  c.sweep = dict(failures=_sweep_failures(dp), placement="stage", stage=-1, seed=0)
  c.sim = dict(policies="all", bin_minutes=10.0, exact_ops=12000)
  if runlocal:
    # Two pipelines of four stages (one node each), a two-hour trace with a failure or two.
    c.cluster.devices = 2 * 4 * tp
    c.parallel.update(pp=4, microbatches=4)
    c.trace.update(hours=2.0, device_mtbf_hours=8.0 * tp, node_mtbf_hours=0.0, repair_hours=0.5)
    c.sweep.failures = "0,1"
    c.sim.bin_minutes = 2.0
  return c
