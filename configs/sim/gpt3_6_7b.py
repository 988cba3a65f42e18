"""Simulated GPT-3 6.7B: 32 layers, d_model 4096; 8 stages (a node per pipeline), 1 GPU per worker.

Run:
  python -m launch.simulate --config=configs/sim/gpt3_6_7b.py --out=/tmp/sim

Variants (`--config=configs/sim/gpt3_6_7b.py:VARIANT`):
  (none)    4096 A100s, a 24-hour Poisson failure trace, every available policy.
  N         N devices, 64 <= N <= 16384 and a multiple of 2 * pp * tp, e.g. :16384.
  runlocal  two 4-stage pipelines and a two-hour trace: seconds on a laptop (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import gpt3_config

MODEL = dict(name="GPT-3 6.7B", num_layers=32, d_model=4096, num_heads=32, pp=8, tp=1,
             microbatches=16)
"""The model and its layout, shared with `configs/sim/hosts.py`."""


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return gpt3_config(arg, file="configs/sim/gpt3_6_7b.py", default_devices=4096, **MODEL)
