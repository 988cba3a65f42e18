"""The example model families' config sections (`model.name`: `gpt`, `llama`), apart from the
models: importing them, as every launcher, planner and the simulator does to read a config,
imports neither JAX nor Flax (`resilient_jax.spec.model.FAMILIES`). `build` imports the model's
module by its name (`family_module`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from resilient_jax.spec.model import ModelConfig, ModelCosts


def family_module(name: str) -> Any:
  """`models/NAME.py`, imported when a model of the family is built (big_vision's way: the
  family is chosen by name, so the configs import no model, no JAX, and no model imports back
  into a module that imports it), under this package's own name (`resilient_jax.examples`
  installed). It provides `from_config(config, seed)`."""
  return importlib.import_module(f"{__package__}.{name}")


@dataclasses.dataclass(frozen=True)
class GPTConfig(ModelConfig):
  name: str = "gpt"
  vocab_size: int = 256
  seq_len: int = 32
  num_layers: int = 4
  num_heads: int = 2
  d_model: int = 64
  mlp_ratio: int = 4
  tied_head: bool = False
  dtype: str = "float32"
  """Compute dtype (`bfloat16`: mixed precision; parameters, gradients, their accumulation
  and the data-parallel reduction stay float32)."""
  param_dtype: str = "float32"
  remat: str = "none"
  """Per-block rematerialisation: `none`, `full`, or a `jax.checkpoint_policies` name
  (`resilient_jax.spec.model.REMAT`)."""

  def __post_init__(self):
    self.check_positive("vocab_size", "seq_len", "num_layers", "num_heads", "d_model",
                        "mlp_ratio")
    self.check_precision()
    self.check_remat()
    if self.d_model % self.num_heads:
      raise ValueError(
        f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}"
      )

  def costs(self) -> ModelCosts:
    t, d, f, v = self.seq_len, self.d_model, self.mlp_ratio * self.d_model, self.vocab_size
    return ModelCosts(
      block_flops=t * (d * 3 * d + d * d + 2 * d * f) + 2 * t * t * d,
      head_flops=t * d * v,
      embed_params=(v + t) * d,
      block_params=4 * d * d + 2 * d * f + 9 * d + f,
      head_params=2 * d + (0 if self.tied_head else d * v + v),
      hidden=d,
    )

  def build(self, seed: Any) -> Any:
    return family_module(self.name).from_config(self, seed)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
  name: str = "llama"
  vocab_size: int = 256
  seq_len: int = 32
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  """Key/value heads (grouped-query attention); must divide `num_heads`."""
  d_model: int = 64
  mlp_ratio: int = 4
  """The SwiGLU hidden width is 2/3 of `mlp_ratio * d_model`, rounded up to a multiple of 8."""
  tied_head: bool = False
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "float32"
  """Compute dtype, as for GPT (`bfloat16`: parameters and gradients stay float32)."""
  param_dtype: str = "float32"
  remat: str = "none"
  """Per-block rematerialisation, as for GPT."""

  def __post_init__(self):
    self.check_remat()
    self.check_positive("vocab_size", "seq_len", "num_layers", "num_heads", "num_kv_heads",
                        "d_model", "mlp_ratio")
    if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
      raise ValueError(f"model.d_model={self.d_model} must split into model.num_heads="
                       f"{self.num_heads} heads of even width (rotary embeddings)")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                       f"model.num_heads={self.num_heads}")
    if not self.rope_theta > 0 or not self.norm_eps > 0:
      raise ValueError("model.rope_theta and model.norm_eps must be positive")
    self.check_precision()

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def hidden(self) -> int:
    return -(-(2 * self.mlp_ratio * self.d_model // 3) // 8) * 8

  def costs(self) -> ModelCosts:
    t, d, v, f = self.seq_len, self.d_model, self.vocab_size, self.hidden
    kv = self.num_kv_heads * self.head_dim
    return ModelCosts(
      block_flops=t * (2 * d * d + 2 * d * kv + 3 * d * f) + 2 * t * t * d,
      head_flops=t * d * v,
      embed_params=v * d,
      block_params=2 * d * d + 2 * d * kv + 3 * d * f + 2 * d,
      head_params=d + (0 if self.tied_head else d * v),
      hidden=d,
    )

  def build(self, seed: Any) -> Any:
    return family_module(self.name).from_config(self, seed)
