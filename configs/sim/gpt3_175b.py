"""Simulated GPT-3 175B: 96 layers, d_model 12288; 16 stages, 8-way tensor-parallel workers.

Run:
  python -m launch.simulate --config=configs/sim/gpt3_175b.py --out=/tmp/sim

Variants (`--config=configs/sim/gpt3_175b.py:VARIANT`):
  (none)    4096 A100s, a 24-hour Poisson failure trace, every available policy.
  N         N devices, 64 <= N <= 16384 and a multiple of 2 * pp * tp, e.g. :16384.
  runlocal  two 4-stage pipelines and a two-hour trace: seconds on a laptop (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import gpt3_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return gpt3_config(
    arg,
    file="configs/sim/gpt3_175b.py",
    name="GPT-3 175B",
    num_layers=96,
    d_model=12288,
    num_heads=96,
    pp=16,
    tp=8,
    microbatches=32,
    default_devices=4096,
  )
