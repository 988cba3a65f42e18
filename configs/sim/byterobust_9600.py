"""A ByteRobust-like job: 9,600 H100-class GPUs for 90 days, its failure categories and stragglers.

Run:
  python -m launch.simulate --config=configs/sim/byterobust_9600.py --out=/tmp/byterobust

ByteRobust (Wan et al. 2025) reports 97% ETTR for a three-month job on 9,600 GPUs but not the
model, its layout nor the shares of its failure categories. This preset fills them in, each an
assumption docs/simulator.md names: a Llama-3-70B-shaped dense model (80 layers of width 8,192,
sequence 8,192) at tensor parallel 8, 8 stages and 150 pipelines of 16 sequences; the failure
rate of Meta's research clusters (Kokolis et al. 2024: a mean time to failure of 1.8 h at
16,384 GPUs, i.e. one failure per ~29,500 GPU-hours); the mix `byterobust` of
`resilient_jax/sim/mixes.py`; warm standbys that take a failed host's place in 15 minutes; and
stragglers (its "MFU decline"), one episode per 200,000 device-hours at half speed for 20
minutes.

Variants: `runlocal`: two 4-stage pipelines and a six-hour trace of the same mix (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import llama3_16k

DEVICES = 9600
DAYS = 90
GPU_HOURS_PER_FAILURE = 16384 * 1.8  # Kokolis et al. 2024: MTTF 1.8 h at 16k GPUs
LAYERS, WIDTH = 80, 8192
PARAMS = LAYERS * 12 * WIDTH**2 + 2 * llama3_16k.VOCAB * WIDTH
D2H_BYTES_PER_S = 25e9  # a GPU's share of a PCIe Gen5 x16 switch uplink, as for Llama 3


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  runlocal = arg == "runlocal"
  if arg and not runlocal:
    raise ValueError(f"unknown variant {arg!r} of configs/sim/byterobust_9600.py (use runlocal)")
  c = llama3_16k.get_config(arg)
  if runlocal:
    c.trace.mix = "byterobust"
    return c
  c.model.update(name="70B (Llama 3 70B shape)", num_layers=LAYERS, d_model=WIDTH, num_heads=64)
  c.cluster.devices = DEVICES
  c.parallel.update(pp=8)
  # Written at Llama 3's storage bandwidth in the background; what blocks is each device's share
  # to host memory at `D2H_BYTES_PER_S` (the assumption configs/sim/llama3_16k.py states).
  c.recovery.update(checkpoint_write_s=16 * PARAMS / llama3_16k.STORAGE_BYTES_PER_S,
                    checkpoint_blocking_s=16 * PARAMS / DEVICES / D2H_BYTES_PER_S)
  c.trace.update(
    hours=DAYS * 24.0,
    mix="byterobust",
    device_mtbf_hours=GPU_HOURS_PER_FAILURE,
    repair_hours=0.25,  # warm standby hosts
    straggler_mtbs_hours=200000.0,
    straggler_speed=0.5,
    straggler_hours=1 / 3,
  )
  return c
