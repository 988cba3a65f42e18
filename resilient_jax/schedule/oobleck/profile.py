"""The per-layer profile Oobleck plans from, and its errors."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

import numpy as np

from resilient_jax.schedule.errors import ScheduleError

LayerRange = tuple[int, int]
"""Layers `[lo, hi)` of one stage."""


class InstantiationError(ScheduleError):
  """No combination of the templates uses exactly the given nodes (with enough pipelines)."""


class LayersLostError(ScheduleError):
  """Some layer has no live replica left: only a restart from a checkpoint can recover."""


def _floats(name: str, values: Iterable[float], n: int | None) -> tuple[float, ...]:
  out = tuple(float(v) for v in values)
  if n is not None and len(out) != n:
    raise ValueError(f"LayerProfile.{name} has {len(out)} entries, expected {n}")
  for v in out:
    if not math.isfinite(v) or v < 0:
      raise ValueError(f"LayerProfile.{name}: {v!r} is not a finite non-negative number")
  return out


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Per-layer costs of one micro-batch, the input of template planning.

  Attributes:
    forward: forward time of each layer.
    backward_input: input-gradient (B) time of each layer.
    backward_weight: weight-gradient (W) time of each layer; B + W is the fused backward.
    param_bytes: bytes of each layer's gradients, the volume of its data-parallel all-reduce.
    state_bytes: bytes resident on a node that owns the layer (parameters, gradients, optimizer
      state): what must be copied when the layer moves to another node.
    activation_bytes: bytes a layer stashes per micro-batch between its forward and backward.
    optimizer: optimizer-step time of each layer; None means zero.
    stage_overhead: fixed time added to every F and every B of a stage (launch, send/receive),
      which makes more stages cost more.
    stage_bytes: fixed memory of every node (runtime, workspace, communication buffers).
  """

  forward: tuple[float, ...]
  backward_input: tuple[float, ...]
  backward_weight: tuple[float, ...]
  param_bytes: tuple[float, ...]
  state_bytes: tuple[float, ...]
  activation_bytes: tuple[float, ...]
  optimizer: tuple[float, ...] | None = None
  stage_overhead: float = 0.0
  stage_bytes: float = 0.0

  def __post_init__(self):
    n = len(tuple(self.forward))
    if n < 1:
      raise ValueError("LayerProfile needs at least one layer")
    for name in (
      "forward",
      "backward_input",
      "backward_weight",
      "param_bytes",
      "state_bytes",
      "activation_bytes",
    ):
      object.__setattr__(self, name, _floats(name, getattr(self, name), n))
    opt = (0.0,) * n if self.optimizer is None else self.optimizer
    object.__setattr__(self, "optimizer", _floats("optimizer", opt, n))
    for name in ("stage_overhead", "stage_bytes"):
      object.__setattr__(self, name, _floats(name, (getattr(self, name),), 1)[0])

  @property
  def num_layers(self) -> int:
    return len(self.forward)

  @classmethod
  def uniform(
    cls,
    num_layers: int,
    *,
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    param_bytes: float = 1.0,
    state_bytes: float = 8.0,
    activation_bytes: float = 1.0,
    stage_overhead: float = 0.0,
    stage_bytes: float = 0.0,
  ) -> LayerProfile:
    """`num_layers` identical layers."""
    n = num_layers
    return cls(
      forward=(forward,) * n,
      backward_input=(backward_input,) * n,
      backward_weight=(backward_weight,) * n,
      param_bytes=(param_bytes,) * n,
      state_bytes=(state_bytes,) * n,
      activation_bytes=(activation_bytes,) * n,
      stage_overhead=stage_overhead,
      stage_bytes=stage_bytes,
    )

  @classmethod
  def gpt(
    cls,
    num_layers: int,
    hidden: int,
    *,
    seq_len: int = 2048,
    micro_batch: int = 1,
    vocab: int = 50304,
    flops_per_s: float = 150e12,
    grad_bytes_per_param: float = 2.0,
    state_bytes_per_param: float = 16.0,
    hbm_bytes_per_s: float | None = None,
    stage_overhead: float = 0.0,
    stage_bytes: float = 0.0,
  ) -> LayerProfile:
    """An analytic profile of a GPT with `num_layers` transformer blocks.

    The token embedding is folded into the first layer and the final norm and (untied) LM head
    into the last, so the profile has exactly `num_layers` layers. Forward FLOPs of a block are
    `tokens * (24 h^2 + 4 s h)` and the head's `2 * tokens * h * vocab`; B and W each cost about
    one forward. Stashed activations follow Korthikanti et al. (2022) with flash attention:
    `34 * s * b * h` bytes per block, plus fp32 logits for the head.

    Args:
      num_layers: transformer blocks.
      hidden: model width h.
      seq_len: tokens per sequence s.
      micro_batch: sequences per micro-batch b.
      vocab: vocabulary size.
      flops_per_s: achieved FLOP/s of one node.
      grad_bytes_per_param: bytes of a gradient element (all-reduce volume).
      state_bytes_per_param: resident bytes per parameter (16 for mixed-precision Adam: bf16
        weight and gradient, fp32 master weight and two moments).
      hbm_bytes_per_s: memory bandwidth for the optimizer step (it streams the state once);
        None makes the step free.
      stage_overhead: as for `LayerProfile`.
      stage_bytes: as for `LayerProfile`.

    Returns:
      The profile.
    """
    if num_layers < 1 or hidden < 1:
      raise ValueError("num_layers and hidden must be positive")
    h, s = float(hidden), float(seq_len)
    tokens = s * micro_batch
    block_params = 12 * h * h + 13 * h
    block_f = tokens * (24 * h * h + 4 * s * h) / flops_per_s
    params = [block_params] * num_layers
    fwd = [block_f] * num_layers
    bwd = [block_f] * num_layers
    act = [34 * tokens * h] * num_layers
    params[0] += vocab * h + s * h
    params[-1] += vocab * h + 2 * h
    head_f = 2 * tokens * h * vocab / flops_per_s
    fwd[-1] += head_f
    bwd[-1] += head_f
    act[-1] += 4 * tokens * vocab
    state = [p * state_bytes_per_param for p in params]
    opt = None if hbm_bytes_per_s is None else [b / hbm_bytes_per_s for b in state]
    return cls(
      forward=fwd,
      backward_input=bwd,
      backward_weight=list(bwd),
      param_bytes=[p * grad_bytes_per_param for p in params],
      state_bytes=state,
      activation_bytes=act,
      optimizer=opt,
      stage_overhead=stage_overhead,
      stage_bytes=stage_bytes,
    )

  @functools.cached_property
  def _prefix(self) -> dict[str, np.ndarray]:
    # Prefix sums make every stage quantity an O(1) difference, the DP's inner loop.
    names = (
      "forward",
      "backward_input",
      "backward_weight",
      "param_bytes",
      "state_bytes",
      "activation_bytes",
      "optimizer",
    )
    return {n: np.concatenate([[0.0], np.cumsum(getattr(self, n))]) for n in names}

  def range_sum(self, name: str, lo: int, hi: int) -> float:
    """Sum of the per-layer field `name` over layers `[lo, hi)`."""
    p = self._prefix[name]
    return float(p[hi] - p[lo])

  def stage_time(self, lo: int, hi: int) -> float:
    """F + B + W of one micro-batch on a stage holding layers `[lo, hi)`, overheads included."""
    return (
      self.range_sum("forward", lo, hi)
      + self.range_sum("backward_input", lo, hi)
      + self.range_sum("backward_weight", lo, hi)
      + 2 * self.stage_overhead
    )

  def stage_memory(self, lo: int, hi: int, inflight: int) -> float:
    """Peak bytes of a node holding layers `[lo, hi)` with `inflight` micro-batches stashed."""
    return (
      self.stage_bytes
      + self.range_sum("state_bytes", lo, hi)
      + inflight * self.range_sum("activation_bytes", lo, hi)
    )
