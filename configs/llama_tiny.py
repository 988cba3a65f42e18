"""A tiny Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, no
biases; `models/llama.py`) on simulated CPU devices; every other section as in gpt_tiny.py.

Run:
  python -m launch.train --config=configs/llama_tiny.py --workdir=/tmp/llama

Variants (`--config=configs/llama_tiny.py:NAME`):
  default   4 layers, d=64, 4 query and 2 key/value heads, synthetic data, 2x2 grid.
  runlocal  the smallest thing that exercises every code path.
"""

import ml_collections
from resilient_jax.configs import gpt_tiny


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "runlocal"):
    raise ValueError(f"unknown variant {arg!r} of configs/llama_tiny.py (choose runlocal)")
  c = gpt_tiny.get_config(arg or None)
  c.model = ml_collections.ConfigDict(dict(
    name="llama",
    vocab_size=256,
    seq_len=c.model.seq_len,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    d_model=c.model.d_model,
    mlp_ratio=4,
    tied_head=False,
    rope_theta=10000.0,
    norm_eps=1e-5,
    dtype=c.model.dtype,  # compute dtype; bfloat16 for mixed precision
    param_dtype=c.model.param_dtype,
    remat=c.model.remat,  # per block: none, full, or a jax.checkpoint_policies name
    module=c.model.module,
  ))
  return c
