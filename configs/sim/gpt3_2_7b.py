"""Simulated GPT-3 2.7B: 32 layers, d_model 2560; 4 stages, one GPU per worker.

Run:
  python -m launch.simulate --config=configs/sim/gpt3_2_7b.py --out=/tmp/sim

Variants (`--config=configs/sim/gpt3_2_7b.py:VARIANT`):
  (none)    512 A100s, a 24-hour Poisson failure trace, every available policy.
  N         N devices, 64 <= N <= 16384 and a multiple of 2 * pp * tp, e.g. :16384.
  runlocal  two 4-stage pipelines and a two-hour trace: seconds on a laptop (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import gpt3_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return gpt3_config(
    arg,
    file="configs/sim/gpt3_2_7b.py",
    name="GPT-3 2.7B",
    num_layers=32,
    d_model=2560,
    num_heads=32,
    pp=4,
    tp=1,
    microbatches=16,
    default_devices=512,
  )
