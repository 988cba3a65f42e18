"""Model-FLOPs utilisation (MFU): the share of the devices' peak that the model's own arithmetic
uses, the figure training reports compare across systems.

`mfu = tokens/s x training FLOPs per token / (devices x peak FLOP/s)`, with training FLOPs per
token 6 x the forward's multiply-adds per token (a multiply-add is 2 FLOPs; the backward costs
twice the forward), from the model's own cost description (`ModelConfig.costs`), and devices
the job's configured ones (utilisation of the allocation: failed devices count, as they do in
the bill). Nothing re-run or recomputed (re-routed work, Bamboo's redundant forwards,
rematerialisation) counts as model FLOPs.

The peak is `profile.peak_tflops` when set, else the device kind's dense bf16 peak from its
vendor's data sheet when it is in `PEAK_TFLOPS`, else there is no MFU (a CPU has none worth
quoting).
"""

from __future__ import annotations

from resilient_jax.config import RunConfig

PEAK_TFLOPS = {
  "H100": 989.4, "H200": 989.4, "A100": 312.0, "L4": 121.0,
  "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0,
}
"""Dense bf16 TFLOP/s per device by a prefix of `jax.Device.device_kind` (NVIDIA's and Google's
data sheets; H100 and H200: the SXM parts)."""


def peak_flops(cfg: RunConfig, device_kind: str) -> float | None:
  """FLOP/s of one device at its peak, or None when not known (see the module docstring)."""
  if cfg.profile.peak_tflops > 0:
    return cfg.profile.peak_tflops * 1e12
  kind = device_kind.replace("NVIDIA ", "")
  for prefix, tflops in PEAK_TFLOPS.items():
    if kind.startswith(prefix):
      return tflops * 1e12
  return None


def training_flops_per_token(cfg: RunConfig) -> float:
  """6 x the forward's multiply-adds per token (blocks and head)."""
  m = cfg.model
  c = m.costs()
  return 6.0 * (m.num_layers * c.block_flops + c.head_flops) / m.seq_len


def mfu(cfg: RunConfig, tokens_per_s: float, device_kind: str) -> float | None:
  """The step's MFU (a fraction), or None without a known peak."""
  peak = peak_flops(cfg, device_kind)
  if peak is None:
    return None
  return tokens_per_s * training_flops_per_token(cfg) / (cfg.mesh.num_devices * peak)
