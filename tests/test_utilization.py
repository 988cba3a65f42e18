"""MFU (`observe/utilization.py`): tokens/s x 6 x forward multiply-adds per token over the
configured devices' peak."""

import pytest

from resilient_jax.observe.utilization import mfu, peak_flops, training_flops_per_token
from tests.helpers import tiny_config


def test_mfu_is_the_model_flops_over_the_devices_peak():
  cfg = tiny_config(mesh__dp=2, mesh__pp=2)
  m, c = cfg.model, cfg.model.costs()
  per_token = 6 * (m.num_layers * c.block_flops + c.head_flops) / m.seq_len
  assert training_flops_per_token(cfg) == pytest.approx(per_token)
  # A known device kind: its dense bf16 peak; an explicit peak wins; a CPU has none.
  assert peak_flops(cfg, "NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
  assert peak_flops(cfg, "TPU v5p") == pytest.approx(459e12)
  assert mfu(cfg, 1000.0, "cpu") is None
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, profile__peak_tflops=2.0)
  assert mfu(cfg, 1000.0, "cpu") == pytest.approx(1000.0 * per_token / (4 * 2e12))
  assert peak_flops(cfg, "NVIDIA H100 80GB HBM3") == pytest.approx(2e12)
