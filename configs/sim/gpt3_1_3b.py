"""Simulated GPT-3 1.3B: 24 layers, d_model 2048; 4 stages, one GPU per worker.

Run:
  python -m launch.simulate --config=configs/sim/gpt3_1_3b.py --out=/tmp/sim

Variants (`--config=configs/sim/gpt3_1_3b.py:VARIANT`):
  (none)    256 A100s, a 24-hour Poisson failure trace, every available policy.
  N         N devices, 64 <= N <= 16384 and a multiple of 2 * pp * tp, e.g. :16384.
  runlocal  two 4-stage pipelines and a two-hour trace: seconds on a laptop (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import gpt3_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return gpt3_config(
    arg,
    file="configs/sim/gpt3_1_3b.py",
    name="GPT-3 1.3B",
    num_layers=24,
    d_model=2048,
    num_heads=16,
    pp=4,
    tp=1,
    microbatches=16,
    default_devices=256,
  )
