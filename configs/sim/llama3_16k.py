"""Llama 3 405B on 16,384 H100s through 54 days of Llama 3's published failure mix: goodput.

Run:
  python -m launch.simulate --config=configs/sim/llama3_16k.py --out=/tmp/llama3

The job as the Llama 3 paper describes it (Llama Team 2024, Table 4 and section 3.3): 126
layers of width 16,384, sequence 8,192, tensor parallel 8 inside a host, 16 pipeline stages,
128 data-parallel pipelines, 16 sequences per pipeline per step (16M tokens). The trace has
its 419 unexpected interruptions in 54 days by component (Table 5; `resilient_jax/sim/mixes.py`):
one failure per 50,677 GPU-hours on average, GPUs and their memory failing alone, hosts, and a
rack's top-of-rack switch taking its two hosts. docs/simulator.md states every assumption and
its source. It prints, besides the sweep, each policy's ETTR with its losses.

Variants (`--config=configs/sim/llama3_16k.py:VARIANT`):
  (none)    the 16k-GPU job and the 54-day trace.
  runlocal  two 4-stage pipelines and a six-hour trace of the same mix (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import gpt3_config

DEVICES = 16384
DAYS = 54
INTERRUPTIONS = 419  # unexpected ones (466 with the 47 planned)
LAYERS, WIDTH, VOCAB = 126, 16384, 128256
# Checkpoint: parameters, fp32 master weights and two Adam moments (16 bytes a parameter), written
# at the 2 TB/s Llama 3's storage sustains (section 3.3.1), as one blocking save.
PARAMS = LAYERS * 12 * WIDTH**2 + 2 * VOCAB * WIDTH
STORAGE_BYTES_PER_S = 2e12
# What blocks training is only the copy of each device's own share of that state (the
# distributed layout: every device saves 1/devices of it) from HBM to host memory; the write to
# storage then runs in the background. 25 GB/s a GPU is an assumption: half of a PCIe Gen5 x16
# link's 64 GB/s a direction, as two GPUs share a PCIe switch's uplink on an HGX H100 board.
D2H_BYTES_PER_S = 25e9


def blocking_save_s(params: int, devices: int) -> float:
  """Seconds a save blocks training: each device's share of the state, to host memory."""
  return 16 * params / devices / D2H_BYTES_PER_S


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  runlocal = arg == "runlocal"
  if arg and not runlocal:
    raise ValueError(f"unknown variant {arg!r} of configs/sim/llama3_16k.py (use runlocal)")
  c = gpt3_config("runlocal" if runlocal else str(DEVICES), file="configs/sim/llama3_16k.py",
                  name="Llama 3 405B", num_layers=LAYERS, d_model=WIDTH, num_heads=128, pp=16,
                  tp=8, microbatches=16, default_devices=DEVICES)
  c.model.update(seq_len=8192, vocab_size=VOCAB)
  # H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM; NVLink 450 GB/s per direction, one 400 Gb/s
  # RoCE NIC per GPU (50 GB/s).
  c.device = dict(name="H100-80GB", peak_tflops=989.0, hbm_gbps=3350.0, memory_gb=80.0,
                  efficiency=0.5)
  c.network = dict(intra_node_gbps=450.0, inter_node_gbps=50.0, intra_latency_us=2.0,
                   inter_latency_us=5.0)
  c.recovery = dict(
    detect_s=10.0,  # the runtime's heartbeat timeout: a silent host (a crash is seen in 0.1 s)
    regroup_s=0.72,  # benchmarks/replan.py at 16,384 devices, worst pattern
    regroup_steps=1.0,  # the runtime's resilience.regroup_steps: new groups and compiles
    restart_s=600.0,  # a whole-job restart at this scale: minutes
    checkpoint_interval_s=0.0,  # Young/Daly for each policy's restores
    checkpoint_write_s=16 * PARAMS / STORAGE_BYTES_PER_S,  # to storage, in the background
    checkpoint_blocking_s=blocking_save_s(PARAMS, DEVICES),  # device to host: 16 ms
  )
  c.trace = dict(
    hours=DAYS * 24.0,
    mix="llama3",
    device_mtbf_hours=DEVICES * DAYS * 24.0 / INTERRUPTIONS,
    node_mtbf_hours=0.0,
    repair_hours=0.5,  # hardware: until a spare host from the pool takes the failed one's place
    transient_repair_hours=1 / 6,  # software, hangs: the process relaunched
    nodes_per_switch=2,  # a rack: two 8-GPU hosts under one top-of-rack switch
    straggler_mtbs_hours=0.0,  # Llama 3 publishes none; e.g. 500000 to add them
    straggler_speed=0.5,
    straggler_hours=0.5,
    seed=0,
    csv="",
  )
  c.sweep.update(failures="0,1,16", stage=-1)
  c.sim.update(bin_minutes=360.0)
  if runlocal:
    # Llama 3's own 8,192-token sequences: a step's compute then outweighs the gradient
    # all-reduce as at full scale (with 1,024 the all-reduce was 40 forwards, and dropping a
    # pipeline sped steps up).
    c.model.update(num_layers=8, d_model=1024, num_heads=8, seq_len=8192, vocab_size=32000)
    c.parallel.update(tp=1)
    c.cluster.update(devices=8, devices_per_node=1)
    c.recovery.update(checkpoint_write_s=5.0, checkpoint_blocking_s=0.5)
    c.trace.update(hours=6.0, device_mtbf_hours=8 * 2.0, repair_hours=1.0, nodes_per_switch=2,
                   straggler_mtbs_hours=16.0)
    c.sweep.failures = "0,1"
    c.sim.bin_minutes = 10.0
  return c
