"""Model and hardware specifications: what the cost model turns into per-op seconds.

The numbers a simulation rests on are few and public: a GPT's shape (layers, width, sequence,
vocabulary), a device's peak FLOP/s and memory bandwidth, and the bandwidth and latency of the
links inside and between nodes. Keeping them as plain frozen dataclasses, validated once, lets a
config file, a test and a notebook describe a cluster the same way.
"""

from __future__ import annotations

import dataclasses

from resilient_jax.checks import require_ints, require_numbers

__all__ = ["DeviceSpec", "ModelSpec", "NetworkSpec", "StageFlops"]


def _positive(owner: str, **values: float) -> None:
  require_numbers(f"{owner}.", values, positive=True)


def _non_negative(owner: str, **values: float) -> None:
  require_numbers(f"{owner}.", values)


@dataclasses.dataclass(frozen=True)
class StageFlops:
  """FLOPs of one micro-batch through one pipeline stage, and the bytes it moves.

  Attributes:
    f: forward FLOPs.
    b: input-gradient (B) FLOPs.
    w: weight-gradient (W) FLOPs.
    params: parameters the stage holds.
    hbm_bytes: bytes one op reads or writes in device memory (weights plus activations), for
      the memory-bound side of the roofline.
    tp_allreduces_f: tensor-parallel all-reduces of one activation in F (two per layer).
    tp_allreduces_b: the same in B (W needs none: its inputs are local).
  """

  f: float
  b: float
  w: float
  params: float
  hbm_bytes: float
  tp_allreduces_f: int
  tp_allreduces_b: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A GPT-style decoder, enough to count its FLOPs and parameters.

  Attributes:
    name: label for tables and plots.
    num_layers: transformer blocks.
    d_model: hidden width h.
    num_heads: attention heads (informational: FLOPs do not depend on it).
    seq_len: tokens per sample S.
    vocab_size: vocabulary V (the output head is a V x h matmul on the last stage).
    ffn_mult: MLP width as a multiple of h.
  """

  name: str
  num_layers: int
  d_model: int
  num_heads: int
  seq_len: int
  vocab_size: int
  ffn_mult: int = 4

  def __post_init__(self):
    keys = ("num_layers", "d_model", "num_heads", "seq_len", "vocab_size", "ffn_mult")
    require_ints("model.", {k: getattr(self, k) for k in keys})

  @property
  def layer_params(self) -> int:
    """Weights of one block: QKV and output projections (4h^2), the MLP (2*ffn*h^2), biases."""
    h, f = self.d_model, self.ffn_mult * self.d_model
    return 4 * h * h + 2 * h * f + 9 * h + f

  @property
  def params(self) -> int:
    """All parameters, token and position embeddings included (the head is tied)."""
    return self.num_layers * self.layer_params + (self.vocab_size + self.seq_len) * self.d_model

  def layers_per_stage(self, pp: int) -> tuple[int, ...]:
    """An even split of the blocks; the first stages take the remainder, because the last stage
    also runs the output head."""
    if pp > self.num_layers:
      raise ValueError(f"pp={pp} stages but the model has only {self.num_layers} layers")
    q, r = divmod(self.num_layers, pp)
    return tuple(q + (1 if s < r else 0) for s in range(pp))

  def stage_flops(self, pp: int, tokens: int, *, recompute: bool = False) -> list[StageFlops]:
    """Per-stage FLOPs for a micro-batch of `tokens` tokens (samples x seq_len).

    Matmuls cost 2 FLOPs per multiply-add. Per token and block, F runs the dense layers
    (2 * (4 + 2*ffn_mult) h^2 = 24 h^2 with ffn_mult 4) and attention's two S x h products
    (4 S h). The backward of a matmul is two matmuls of the same size, one per operand: B takes
    the input gradients of the dense layers and both operand gradients of attention (8 S h), W
    the weight gradients. The last stage adds the 2 h V head (and its B and W); with
    `recompute`, B re-runs F first.

    Args:
      pp: pipeline stages.
      tokens: tokens per micro-batch.
      recompute: whether activations are recomputed in the backward.

    Returns:
      One `StageFlops` per stage.
    """
    h, s, v = self.d_model, self.seq_len, self.vocab_size
    dense = 2 * (4 + 2 * self.ffn_mult) * h * h * tokens
    attn = 4 * s * h * tokens
    head = 2 * h * v * tokens
    out = []
    for stage, layers in enumerate(self.layers_per_stage(pp)):
      last = stage == pp - 1
      f = layers * (dense + attn) + (head if last else 0)
      b = layers * (dense + 2 * attn) + (head if last else 0) + (f if recompute else 0)
      w = layers * dense + (head if last else 0)
      params = layers * self.layer_params
      if stage == 0:
        params += (v + s) * h
      if last and pp > 1:
        params += v * h  # the tied head needs its own copy on the last stage
      # bf16 weights read once per op plus ~34 bytes of activations per token, layer and unit
      # of width (Korthikanti et al. 2022, flash attention: no S^2 term).
      hbm = 2 * params + 34 * tokens * h * layers
      out.append(StageFlops(f, b, w, params, hbm, 2 * layers, 2 * layers))
    return out


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One accelerator.

  Attributes:
    name: label, e.g. "A100-80GB".
    peak_tflops: dense bf16 peak, in TFLOP/s.
    hbm_gbps: memory bandwidth, in GB/s.
    memory_gb: device memory, in GB.
    efficiency: the fraction of peak (FLOPs and bandwidth) a real kernel reaches.
  """

  name: str
  peak_tflops: float
  hbm_gbps: float
  memory_gb: float
  efficiency: float = 0.5

  def __post_init__(self):
    _positive(
      "device",
      peak_tflops=self.peak_tflops,
      hbm_gbps=self.hbm_gbps,
      memory_gb=self.memory_gb,
      efficiency=self.efficiency,
    )
    if self.efficiency > 1:
      raise ValueError(f"device.efficiency must be in (0, 1], got {self.efficiency}")

  def op_seconds(self, flops: float, hbm_bytes: float) -> float:
    """Roofline time of an op: the slower of its compute and its memory traffic."""
    return max(
      flops / (self.peak_tflops * 1e12 * self.efficiency),
      hbm_bytes / (self.hbm_gbps * 1e9 * self.efficiency),
    )


@dataclasses.dataclass(frozen=True)
class NetworkSpec:
  """Links, per device and direction.

  Attributes:
    intra_node_gbps: bandwidth between devices of one node (NVLink), GB/s.
    inter_node_gbps: bandwidth of one device's share of the node's network (InfiniBand), GB/s.
    intra_latency_us: per-message latency inside a node, microseconds.
    inter_latency_us: per-message latency between nodes, microseconds.
  """

  intra_node_gbps: float
  inter_node_gbps: float
  intra_latency_us: float
  inter_latency_us: float

  def __post_init__(self):
    _positive("network", intra_node_gbps=self.intra_node_gbps, inter_node_gbps=self.inter_node_gbps)
    _non_negative(
      "network", intra_latency_us=self.intra_latency_us, inter_latency_us=self.inter_latency_us
    )

  def link(self, inter_node: bool) -> tuple[float, float]:
    """`(bytes per second, latency in seconds)` of an intra- or inter-node link."""
    if inter_node:
      return self.inter_node_gbps * 1e9, self.inter_latency_us * 1e-6
    return self.intra_node_gbps * 1e9, self.intra_latency_us * 1e-6
